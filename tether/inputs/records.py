"""Where inputs are read: data files (JSONL, CSV, Parquet, JSON arrays, ``datasets`` folders) and Hub datasets
``hf:org/name`` as numbered records, and rows handed over from Python.

``read_records`` is the generic reader: every record with its line or row number, and a one-line
:class:`~tether.errors.DataError` naming the file, the line/row and what is wrong for anything it cannot
read (``skip_invalid=True`` turns a bad row into a counted skip instead). ``python_records`` numbers the rows of a
``datasets.Dataset`` or a list given from Python the same way. What the records mean is read elsewhere: preference
pairs in :mod:`tether.inputs.pairs`, prompts in :mod:`tether.inputs.prompt_rows`, SFT rows in :mod:`tether.sft.data`.

Numbering: line numbers (1-based) for JSONL, JSON-lines and CSV files (the line where the record starts); 1-based
record/row numbers for JSON arrays, Parquet and dataset folders.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
from pathlib import Path

from tether.errors import DataError
from tether.hub import dataset_records, is_hub_dataset

SUFFIXES = (".jsonl, .jsonl.gz, .json, .json.gz, .csv, .csv.gz, .parquet, a folder saved with datasets' save_to_disk, "
            "or a Hub dataset hf:org/name[:config][:split]")


# ----------------------------------------------------------------------------------------- records
def source_kind(path: Path) -> str:
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
        unit = {"jsonl": "line", "csv": "line", "json": "record"}.get(source_kind(path), "row")
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
    kind = source_kind(path)
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
