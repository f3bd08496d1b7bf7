"""Preference pairs (A3): records read by :mod:`tether.inputs.records` turned into :class:`PreferencePair` s, the
counts of what was skipped, the held-out split by prompt, and the balanced subsets reward-model training can ask for.

``load_preference_pairs`` reads files, ``pairs_from_data`` the same rows handed over from Python (a
``datasets.Dataset`` or a list of rows). A row is a pair in any of these shapes:

- ``prompt`` / ``chosen`` / ``rejected``: the replies are ``chosen`` and ``rejected``;
- whole transcripts ``chosen`` / ``rejected`` (HH-RLHF): the prompt is the shared prefix up to and
  including the last ``"\\n\\nAssistant:"``, the replies are what follows it;
- TRL's conversational form, message lists (:func:`tether.inputs.conversations.conversational_pair`): the pair's
  prompt is then the messages, rendered by the reward model's chat template like any prompt.

Pairs whose two sides are identical, or whose transcripts do not share the prompt, carry no preference:
they are skipped and counted, never an error.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

from tether.errors import DataError
from tether.inputs.conversations import conversational_pair, split_transcript
from tether.inputs.records import python_records, read_records, record_location, source_kind
from tether.inputs.splits import split_by_prompt


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
        if records and source_kind(path) in ("csv", "parquet", "dataset", "hub"):
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


def split_pairs(pairs: list[PreferencePair], eval_fraction: float, seed: int
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Deterministic ``(train, held_out)`` split of preference pairs **by prompt** (:func:`split_by_prompt`)."""
    return split_by_prompt(pairs, eval_fraction, seed)


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
