"""SFT rows in the shapes people have them (S1), from files or from Python, and their split by prompt.

A row is read in one of these shapes (the first that fits):

- ``messages``: TRL's conversational language-modelling form, a list of ``{"role", "content"}`` ending with the
  assistant's turn; every assistant turn is trained (by the chat template, :mod:`tether.sft.tokens`);
- ``prompt`` + ``completion`` (TRL's prompt-completion form; also ``response``, or ``answer`` as the demo's rows
  have it): the prompt is text or messages ending with the user's turn, the completion text or one assistant
  message; only the completion is trained;
- GSM8K's ``question`` + ``answer``: the worked solution is the completion;
- ``text``: TRL's language-modelling form, plain text trained on every token (no chat template, no prompt
  template; EOS appended when the tokenizer does not end the text with it).

Every other field travels with the row (``columns``): a gold rule gets them as keyword lists, as PPO's rules do.
A row that fits no shape, or has an empty or mistyped field, is a one-line :class:`~tether.errors.DataError` naming
the file and the line or row (``skip_invalid``: skipped and counted instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.inputs.conversations import check_messages
from tether.errors import DataError

COMPLETION_KEYS = ("completion", "response", "answer")  # the first present names the trained reply
SHAPES = "'messages', 'prompt' + 'completion' (or 'response'/'answer'), 'question' + 'answer', or 'text'"


@dataclass(frozen=True)
class SFTRow:
    """One demonstration: ``prompt`` answered by ``completion``; or, ``whole_text``, a text trained on every token."""

    prompt: str | list[dict]   # what the policy is asked: text, or the messages before the last assistant turn;
                               # a ``text`` row: the text itself (so that the split by prompt splits by text)
    completion: str            # the reply trained on (the conversation's last assistant turn); "" for a text row
    all_turns: bool = False    # a ``messages`` row: every assistant turn in ``prompt`` is trained as well
    columns: dict = field(default_factory=dict)  # the row's other fields (a gold rule's keyword lists)
    source: str = ""           # "FILE: line N" or "NAME: row N"
    whole_text: bool = False   # TRL's {"text": ...} row: ``prompt`` is the text, every token is trained


@dataclass
class RowStats:
    """Counts from reading rows; ``summary()`` is the one-line report."""

    rows: int = 0
    kept: int = 0
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.rows} rows read, {self.kept} kept, {self.invalid} invalid skipped"
        return text + (f" (first: {self.invalid_examples[0]})" if self.invalid_examples else "")


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be text, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def _reply(record: dict, key: str, where: str) -> str:
    """The completion: text, or TRL's conversational completion (one assistant message)."""
    value = record[key]
    if isinstance(value, (list, tuple)):
        messages = check_messages(value, where, key)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise DataError(f"{where}: field '{key}' must be one assistant message, got "
                            f"{', '.join(m['role'] for m in messages)}")
        value = messages[0]["content"]
        if not value.strip():
            raise DataError(f"{where}: field '{key}': the reply is empty")
        return value
    return _text(record, key, where)


def row_from_record(record, where: str) -> SFTRow:
    """The :class:`SFTRow` of one record, or a one-line DataError naming ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a row of fields, got {type(record).__name__}")
    present = {k for k, v in record.items() if v is not None}
    if "messages" in present:
        messages = check_messages(record["messages"], where, "messages", last_role="assistant")
        if len(messages) < 2 or messages[-2]["role"] != "user":
            raise DataError(f"{where}: field 'messages': the last assistant reply must answer a user turn")
        if not messages[-1]["content"].strip():
            raise DataError(f"{where}: field 'messages': the last assistant reply is empty")
        columns = {k: v for k, v in record.items() if k != "messages"}
        return SFTRow(messages[:-1], messages[-1]["content"], True, columns, where)
    prompt_key = "prompt" if "prompt" in present else ("question" if "question" in present else None)
    reply_key = next((k for k in COMPLETION_KEYS if k in present), None)
    if (prompt_key is None or reply_key is None) and "text" in present:
        columns = {k: v for k, v in record.items() if k != "text"}
        return SFTRow(_text(record, "text", where), "", False, columns, where, whole_text=True)
    if prompt_key is None or reply_key is None:
        found = ", ".join(map(str, record)) or "none"
        raise DataError(f"{where}: expected {SHAPES} (found: {found})")
    if isinstance(record[prompt_key], (list, tuple)):
        prompt = check_messages(record[prompt_key], where, prompt_key, last_role="user")
    else:
        prompt = _text(record, prompt_key, where)
    columns = {k: v for k, v in record.items() if k != prompt_key}
    return SFTRow(prompt, _reply(record, reply_key, where), False, columns, where)


def _rows_of(records: list[tuple[int, object]], location, stats: RowStats, skip_invalid: bool) -> list[SFTRow]:
    rows = []
    stats.rows += len(records)
    for number, record in records:
        try:
            rows.append(row_from_record(record, location(number)))
        except DataError as e:
            if not skip_invalid:
                raise
            stats.invalid += 1
            if not stats.invalid_examples:
                stats.invalid_examples.append(str(e))
    stats.kept += len(rows)
    return rows


def load_rows(paths: list[str], skip_invalid: bool = False) -> tuple[list[SFTRow], RowStats]:
    """The rows of every file in ``paths``, in order, and what was read and skipped."""
    from tether.inputs.records import read_records, record_location

    rows, stats = [], RowStats()
    for path in paths:
        bad: list[str] = []
        records = read_records(path, skip_invalid=skip_invalid, skipped=bad)
        stats.rows += len(bad)
        stats.invalid += len(bad)
        if bad and not stats.invalid_examples:
            stats.invalid_examples.append(bad[0])
        rows += _rows_of(records, lambda n, p=path: record_location(p, n), stats, skip_invalid)
    if not rows:
        raise DataError(f"{', '.join(map(str, paths))}: no usable rows ({stats.summary()})")
    return rows, stats


def rows_from_data(data, name: str, skip_invalid: bool = False) -> tuple[list[SFTRow], RowStats]:
    """Rows handed over from Python: a ``datasets.Dataset`` or a list of records (or of :class:`SFTRow`); rows are
    named ``"NAME: row N"`` in errors. A path string (or a list of them, or ``hf:org/name``) is read as the files it
    names (:func:`load_rows`)."""
    import os

    from tether.inputs.records import python_records

    if isinstance(data, (str, os.PathLike)) or (isinstance(data, (list, tuple)) and data and
                                                all(isinstance(d, (str, os.PathLike)) for d in data)):
        return load_rows([os.fspath(d) for d in (data if isinstance(data, (list, tuple)) else [data])], skip_invalid)

    if isinstance(data, (list, tuple)) and data and all(isinstance(r, SFTRow) for r in data):
        return list(data), RowStats(rows=len(data), kept=len(data))
    stats = RowStats()
    rows = _rows_of(python_records(data, name), lambda n: f"{name}: row {n}", stats, skip_invalid)
    if not rows:
        raise DataError(f"{name}: no usable rows ({stats.summary()})")
    return rows, stats


def read_rows(files: list[str], given, name: str, skip_invalid: bool) -> tuple[list[SFTRow], RowStats]:
    """Rows from Python (``given``) when there are some, else from ``files``."""
    if given is not None:
        return rows_from_data(given, name, skip_invalid)
    return load_rows(files, skip_invalid)


def prompt_row(row: SFTRow) -> dict | None:
    """``row`` as a prompt row (``{"prompt": …, **columns}``): what a gold evaluation of held-out rows answers;
    None for a ``text`` row, which asks nothing."""
    return None if row.whole_text else {**row.columns, "prompt": row.prompt}
