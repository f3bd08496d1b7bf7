"""Reading data files (JSONL, CSV, Parquet, JSON arrays, ``datasets`` folders, Hub datasets ``hf:org/name``) and
preference pairs (A3).

``read_records`` is the generic reader: every record with its line or row number, and a one-line
:class:`~tether.errors.DataError` naming the file, the line/row and what is wrong for anything it cannot
read (``skip_invalid=True`` turns a bad row into a counted skip instead). ``load_preference_pairs`` turns
records into :class:`PreferencePair` s, in either shape:

- ``prompt`` / ``chosen`` / ``rejected``: the replies are ``chosen`` and ``rejected``;
- whole transcripts ``chosen`` / ``rejected`` (HH-RLHF): the prompt is the shared prefix up to and
  including the last ``"\\n\\nAssistant:"``, the replies are what follows it;
- TRL's conversational form, message lists (:func:`tether.conversations.conversational_pair`): the pair's
  prompt is then the messages, rendered by the reward model's chat template like any prompt.
``pairs_from_data`` reads the same rows handed over from Python (a ``datasets.Dataset`` or a list of rows).

Pairs whose two sides are identical, or whose transcripts do not share the prompt, carry no preference:
they are skipped and counted, never an error. Numbering: line numbers (1-based) for JSONL, JSON-lines
and CSV files (the line where the record starts); 1-based record/row numbers for JSON arrays, Parquet and
dataset folders.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

from tether.conversations import (  # noqa: F401 - ASSISTANT, split_transcript, transcript_messages: this module's API
    ASSISTANT, conversational_pair, prompt_key, split_transcript, transcript_messages)
from tether.errors import DataError
from tether.hub import dataset_records, is_hub_dataset

SUFFIXES = (".jsonl, .jsonl.gz, .json, .json.gz, .csv, .csv.gz, .parquet, a folder saved with datasets' save_to_disk, "
            "or a Hub dataset hf:org/name[:config][:split]")


# ----------------------------------------------------------------------------------------- records
def _kind(path: Path) -> str:
    """``"jsonl"``, ``"json"`` (array), ``"csv"``, ``"parquet"`` or ``"dataset"`` from the path and, for
    ``.json``, from the first character (a ``.json`` file may hold JSON lines); ``"hub"`` for ``hf:org/name``."""
    if is_hub_dataset(path):
        return "hub"
    if path.is_dir():
        return "dataset"
    name = path.name.lower()
    base = name[:-3] if name.endswith(".gz") else name
    if base.endswith(".jsonl"):
        return "jsonl"
    if base.endswith(".csv"):
        return "csv"
    if base.endswith(".parquet") and not name.endswith(".gz"):
        return "parquet"
    if base.endswith(".json"):
        head = _read_bytes(path)[:4096].lstrip()
        return "json" if head.startswith(b"[") else "jsonl"
    suffix = "".join(path.suffixes) or "(none)"
    raise DataError(f"{path}: unknown file type '{suffix}' (expected {SUFFIXES})")


def record_location(path: str | Path, number: int) -> str:
    """``"FILE: line N"`` or ``"FILE: row N"`` for record ``number`` of ``read_records(path)``."""
    path = Path(path)
    try:
        unit = {"jsonl": "line", "csv": "line", "json": "record"}.get(_kind(path), "row")
    except (DataError, OSError):
        unit = "row"
    return f"{path}: {unit} {number}"


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if path.name.lower().endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: not a valid gzip file ({e})") from None
    return raw


def _not_utf8(path: Path, raw: bytes, err: UnicodeDecodeError, offset: int = 0) -> DataError:
    line = raw.count(b"\n", 0, offset + err.start) + 1
    return DataError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[offset + err.start]:02x})")


def read_records(path: str | Path, *, skip_invalid: bool = False,
                 skipped: list[str] | None = None) -> list[tuple[int, dict]]:
    """All records of a data file as ``(line or row number, record)``, in file order.

    Formats: JSONL (``.jsonl``, ``.jsonl.gz``; blank lines ignored), a JSON array of objects (``.json``,
    e.g. SVAMP.json), CSV with a header row, Parquet, and a folder written by ``datasets``'
    ``save_to_disk``; ``hf:org/name[:config][:split]``, a Hugging Face Hub dataset (:mod:`tether.hub`), rows
    numbered from 1. Unreadable rows (invalid JSON, not an object, non-UTF-8 bytes, wrong number of CSV
    fields) raise a one-line :class:`DataError`; with ``skip_invalid`` they are dropped and a message for
    each is appended to ``skipped`` (when given). Field checks are the caller's business.
    """
    path = Path(path)
    if is_hub_dataset(path):  # hf:org/name[:config][:split]: rows through datasets.load_dataset
        return dataset_records(str(path))
    if not path.exists():
        raise DataError(f"{path}: file not found")
    kind = _kind(path)
    bad: list[str] = []

    def reject(message: str) -> None:
        if not skip_invalid:
            raise DataError(message)
        bad.append(message)

    if kind == "jsonl":
        records = _read_jsonl(path, reject)
    elif kind == "json":
        records = _read_json_array(path, reject)
    elif kind == "csv":
        records = _read_csv(path, reject)
    elif kind == "parquet":
        records = _read_parquet(path)
    else:
        records = _read_dataset(path)
    if skipped is not None:
        skipped.extend(bad)
    return records


def _read_jsonl(path: Path, reject) -> list[tuple[int, dict]]:
    raw = _read_bytes(path)
    out, offset = [], 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        start, offset = offset, offset + len(line) + 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            reject(str(_not_utf8(path, raw, e, start)))
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            reject(f"{path}: line {number}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            reject(f"{path}: line {number}: expected a JSON object, got {type(record).__name__}")
            continue
        out.append((number, record))
    return out


def _read_json_array(path: Path, reject) -> list[tuple[int, dict]]:
    raw = _read_bytes(path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw, e) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects or JSON lines")
    out = []
    for number, record in enumerate(data, start=1):
        if isinstance(record, dict):
            out.append((number, record))
        else:
            reject(f"{path}: record {number}: expected a JSON object, got {type(record).__name__}")
    return out


def _read_csv(path: Path, reject) -> list[tuple[int, dict]]:
    raw = _read_bytes(path)
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (spreadsheet exports)
        raw = raw[3:]
    # Undecodable bytes become lone surrogates so that the row holding them can be named (or skipped).
    reader = csv.reader(io.StringIO(raw.decode("utf-8", errors="surrogateescape"), newline=""))
    out, line, header = [], 1, None
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise DataError(f"{path}: line {reader.line_num}: invalid CSV ({e})") from None
        number, line = line, reader.line_num + 1
        if not row:
            continue
        bad_byte = next((m for v in row for m in re.findall("[\udc80-\udcff]", v)), None)
        if header is None:
            if bad_byte:
                raise DataError(f"{path}: line {number}: not UTF-8 text (byte 0x{ord(bad_byte) - 0xdc00:02x})")
            header = row
        elif len(row) != len(header):
            reject(f"{path}: line {number}: expected {len(header)} fields, got {len(row)}")
        elif bad_byte:
            reject(f"{path}: line {number}: not UTF-8 text (byte 0x{ord(bad_byte) - 0xdc00:02x})")
        else:
            out.append((number, dict(zip(header, row))))
    return out


def _read_parquet(path: Path) -> list[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    return list(enumerate(table.to_pylist(), start=1))


def _read_dataset(path: Path) -> list[tuple[int, dict]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{path}: not a dataset folder saved with save_to_disk ({str(e).splitlines()[0]})") from None
    if isinstance(data, datasets.DatasetDict):
        if len(data) != 1:
            raise DataError(f"{path}: holds the splits {', '.join(data)}; "
                            f"pass one of them, e.g. {path / next(iter(data))}")
        data = next(iter(data.values()))
    return list(enumerate(data.to_list(), start=1))


# ------------------------------------------------------------------------------------ preference pairs
@dataclass(frozen=True)
class PreferencePair:
    """One human preference: ``chosen`` ≻ ``rejected`` as replies to ``prompt``. ``source`` is
    ``"FILE: line N"`` (for messages). For transcripts the prompt keeps the ``"\\n\\nHuman: …\\n\\nAssistant:"``
    text and each reply keeps its leading space, so ``prompt + reply`` is the original transcript."""

    prompt: str
    chosen: str
    rejected: str
    source: str = ""


@dataclass
class PairStats:
    """Counts from loading pairs; ``summary()`` is the one-line report."""

    rows: int = 0
    pairs: int = 0
    identical: int = 0
    no_shared_prompt: int = 0
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = (f"{self.rows} rows read, {self.pairs} pairs kept; skipped: {self.identical} identical sides, "
                f"{self.no_shared_prompt} no shared prompt, {self.invalid} invalid")
        if self.invalid_examples:
            text += f" (first: {self.invalid_examples[0]})"
        return text


def _text_field(record: dict, key: str, where: str, allow_empty: bool = False) -> str:
    if key not in record or record[key] is None:
        raise DataError(f"{where}: missing field '{key}' (found: {', '.join(map(str, record)) or 'none'})")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be text, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def pair_from_record(record: dict, where: str) -> PreferencePair | str:
    """A :class:`PreferencePair`, or the reason it carries no preference (``"identical"``,
    ``"no_shared_prompt"``); a :class:`DataError` for a malformed record."""
    if any(isinstance(record.get(k), (list, tuple)) for k in ("chosen", "rejected", "prompt")):
        result = conversational_pair(record, where)
        return result if isinstance(result, str) else PreferencePair(*result, where)
    chosen = _text_field(record, "chosen", where)
    rejected = _text_field(record, "rejected", where)
    if "prompt" in record and record["prompt"] is not None:
        prompt = _text_field(record, "prompt", where)
        reply_chosen, reply_rejected = chosen, rejected
    else:
        split_c, split_r = split_transcript(chosen), split_transcript(rejected)
        if split_c is None or split_r is None or split_c[0] != split_r[0]:
            return "identical" if chosen == rejected else "no_shared_prompt"
        prompt, reply_chosen, reply_rejected = split_c[0], split_c[1], split_r[1]
    if reply_chosen == reply_rejected:
        return "identical"
    return PreferencePair(prompt, reply_chosen, reply_rejected, where)


def load_preference_pairs(paths: Iterable[str | Path], *, skip_invalid: bool = False
                          ) -> tuple[list[PreferencePair], PairStats]:
    """Preference pairs from every file in ``paths`` (in order) and the counts of what was skipped."""
    paths = [Path(p) for p in paths]
    pairs: list[PreferencePair] = []
    stats = PairStats()
    for path in paths:
        bad: list[str] = []
        records = read_records(path, skip_invalid=skip_invalid, skipped=bad)
        stats.rows += len(bad)
        if records and _kind(path) in ("csv", "parquet", "dataset", "hub"):
            missing = [k for k in ("chosen", "rejected") if k not in records[0][1]]
            if missing:  # a missing column is the whole file's problem, not one row's
                raise DataError(f"{path}: missing column '{missing[0]}' "
                                f"(columns: {', '.join(map(str, records[0][1]))})")
        pairs += _pairs_of(records, lambda number: record_location(path, number), stats, skip_invalid, bad)
    return _some_pairs(pairs, stats, ", ".join(str(p) for p in paths))


def pairs_from_data(data, name: str = "pairs", *, skip_invalid: bool = False
                    ) -> tuple[list[PreferencePair], PairStats]:
    """Preference pairs from rows handed over from Python (:func:`python_records`); rows are named
    ``"NAME: row N"`` in errors. A list of :class:`PreferencePair` is taken as it is; a path string (or
    ``hf:org/name``) is read as the file it names."""
    if isinstance(data, (str, PathLike)):
        return load_preference_pairs([data], skip_invalid=skip_invalid)
    if isinstance(data, (list, tuple)) and data and all(isinstance(p, PreferencePair) for p in data):
        return list(data), PairStats(rows=len(data), pairs=len(data))
    stats, bad = PairStats(), []
    pairs = _pairs_of(python_records(data, name), lambda number: f"{name}: row {number}", stats, skip_invalid, bad)
    return _some_pairs(pairs, stats, name)


def _pairs_of(records: list[tuple[int, object]], location, stats: PairStats, skip_invalid: bool,
              bad: list[str]) -> list[PreferencePair]:
    """The pairs of ``records`` (``location(number)`` names a row), counting what is skipped in ``stats``."""
    pairs = []
    stats.rows += len(records)
    for number, record in records:
        where = location(number)
        try:
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a row of fields, got {type(record).__name__}")
            result = pair_from_record(record, where)
        except DataError as e:
            if not skip_invalid:
                raise
            bad.append(str(e))
            continue
        if isinstance(result, PreferencePair):
            pairs.append(result)
        elif result == "identical":
            stats.identical += 1
        else:
            stats.no_shared_prompt += 1
    stats.invalid += len(bad)
    stats.invalid_examples.extend(bad[:1])
    stats.pairs += len(pairs)
    return pairs


def _some_pairs(pairs: list[PreferencePair], stats: PairStats, names: str) -> tuple[list[PreferencePair], PairStats]:
    if not pairs:
        raise DataError(f"{names}: no usable preference pairs ({stats.summary()})")
    return pairs, stats


def python_records(data, name: str) -> list[tuple[int, object]]:
    """Rows handed over from Python, numbered from 1: a ``datasets.Dataset`` (one split) or a list of rows."""
    if isinstance(data, dict) and data and all(hasattr(v, "column_names") for v in data.values()):
        raise DataError(f"{name}: holds the splits {', '.join(map(str, data))}; pass one of them")
    if not (hasattr(data, "column_names") or isinstance(data, (list, tuple))):
        raise DataError(f"{name}: expected a datasets.Dataset or a list of rows, got {type(data).__name__}")
    rows = data.to_list() if hasattr(data, "column_names") else list(data)  # a datasets.Dataset: its rows
    if not rows:
        raise DataError(f"{name}: no rows")
    return list(enumerate(rows, start=1))


def split_pairs(pairs: list[PreferencePair], eval_fraction: float, seed: int
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Deterministic ``(train, held_out)`` split of preference pairs **by prompt** (:func:`split_by_prompt`)."""
    return split_by_prompt(pairs, eval_fraction, seed)


def split_by_prompt(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic ``(train, held_out)`` split **by prompt** of items with a ``prompt`` (text or messages): all
    items of one prompt land on the same side, so no held-out prompt is ever seen in training. Prompts are sorted,
    then shuffled with ``random.Random(seed)``; whole prompt groups go to held-out until it holds ≥
    ``eval_fraction`` of the items. The result does not depend on the order of the input rows."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(prompt_key(item.prompt), []).append(item)
    prompts = sorted(groups)
    random.Random(seed).shuffle(prompts)
    target = max(1, round(eval_fraction * len(items)))
    held_out_prompts: set[str] = set()
    n_held_out = 0
    for prompt in prompts:
        if n_held_out >= target or len(held_out_prompts) == len(prompts) - 1:
            break
        held_out_prompts.add(prompt)
        n_held_out += len(groups[prompt])
    train = [p for p in items if prompt_key(p.prompt) not in held_out_prompts]
    held_out = [p for p in items if prompt_key(p.prompt) in held_out_prompts]
    return train, held_out


def shuffled_batches(lengths: list[int], batch_size: int, generator, group_by_length: bool) -> list[list[int]]:
    """One epoch of batches (lists of item indices), every item exactly once, in shuffled order (a
    ``torch.Generator`` draws it: the same generator state, the same epoch).

    ``group_by_length``: shuffle, cut into chunks of 50 batches, sort each chunk by ``lengths`` (an item's
    length in tokens; a preference pair's longer text), cut into batches and shuffle the batches: padding shrinks
    to the spread inside a batch while which items meet stays random (Hugging Face's group_by_length does the
    same). Used by reward-model training (pairs) and SFT (sequences).
    """
    import torch

    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    chunk = 50 * batch_size
    order = [i for lo in range(0, len(order), chunk)
             for i in sorted(order[lo:lo + chunk], key=lambda j: -lengths[j])]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]


def balance_by_length(pairs: list[PreferencePair], seed: int) -> list[PreferencePair]:
    """A subset in which "chosen is longer" and "chosen is shorter" (in characters) are equally frequent:
    pairs of the larger group are dropped at random (seeded) down to the size of the smaller one;
    equal-length pairs are all kept. Order is preserved. On such data length alone predicts nothing."""
    longer = [i for i, p in enumerate(pairs) if len(p.chosen) > len(p.rejected)]
    shorter = [i for i, p in enumerate(pairs) if len(p.chosen) < len(p.rejected)]
    big, small = (longer, shorter) if len(longer) > len(shorter) else (shorter, longer)
    drop = set(random.Random(seed).sample(big, len(big) - len(small)))
    return [p for i, p in enumerate(pairs) if i not in drop]


def balance_by_reply(pairs: list[PreferencePair], seed: int) -> list[PreferencePair]:
    """The largest subset in which every reply text (whitespace-stripped) is chosen exactly as often as it is
    rejected: on it a reply alone predicts nothing, and a reward model lowers its loss only by reading the prompt.

    Where the pairs are a policy's own samples labelled by a checker, a reply the policy gets right more often than
    wrong ("The answer is 9." chosen 72 times, rejected 14) teaches a reward model to like that text whatever the
    question — a favourite a policy then converges on. Pairs are the edges chosen → rejected of a multigraph on
    reply texts; a subset with in-degree = out-degree everywhere is a circulation, and the largest one is a min-cost
    circulation with cost −1 per pair (networkx's network simplex; networkx comes with torch). Which pairs of one
    (chosen, rejected) text pair are kept is drawn at random (seeded); order is preserved. A pair whose two sides are
    the same text is balanced by itself and kept."""
    import networkx as nx

    by_texts: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(pairs):
        by_texts.setdefault((p.chosen.strip(), p.rejected.strip()), []).append(i)
    graph = nx.DiGraph()
    graph.add_edges_from((c, r, {"capacity": len(ids), "weight": -1}) for (c, r), ids in by_texts.items() if c != r)
    flow = nx.min_cost_flow(graph)
    rng, keep = random.Random(seed), set()
    for (c, r), ids in by_texts.items():
        keep.update(ids if c == r else rng.sample(ids, flow[c][r]))
    return [p for i, p in enumerate(pairs) if i in keep]
