"""Prompt rows in the shapes users have, read from files or handed over from Python: what PPO trains on and
evaluates, what SFT's gold evaluation and rejection sampling (``tether sample``) read — one reader for all.

Shapes (detected per file): ``prompt`` (+ any other columns, e.g. ``answer``); GSM8K ``question`` +
``answer`` ("… #### N", reduced to N); SVAMP ``Body`` + ``Question`` + ``Answer`` (prompt = Body + " " +
Question); HH-RLHF transcripts ``chosen`` (prompt = the text up to and including the last
"\\n\\nAssistant:"). A ``prompt`` may be a list of chat messages (TRL's conversational form), rendered by the
policy's chat template. Every other column travels with its prompt and reaches rules as a keyword list;
rules get each prompt as it was given (text or messages).
"""

from __future__ import annotations

from tether.inputs.conversations import ASSISTANT
from tether.errors import DataError


def _to_prompt(record: dict) -> dict | None:
    """Normalise one record to ``{"prompt": str, **fields}``; None when no prompt can be found."""
    from tether.rules.library import gold_integer

    if "prompt" in record:
        return dict(record)
    if "Body" in record and "Question" in record:  # SVAMP
        out = {k: v for k, v in record.items() if k not in ("Body", "Question", "Answer")}
        out["prompt"] = f"{str(record['Body']).strip()} {str(record['Question']).strip()}"
        out["answer"] = str(gold_integer(record.get("Answer")))
        return out
    if "question" in record:  # GSM8K
        out = {k: v for k, v in record.items() if k not in ("question", "answer")}
        out["prompt"] = record["question"]
        if "answer" in record:
            out["answer"] = str(gold_integer(record["answer"]))
            out["solution"] = record["answer"]
        return out
    if "chosen" in record and isinstance(record["chosen"], str) and ASSISTANT in record["chosen"]:
        text = record["chosen"]
        return {"prompt": text[: text.rindex(ASSISTANT) + len(ASSISTANT)]}
    return None


def load_prompts(path: str, skip_invalid: bool = False) -> list[dict]:
    """Prompt rows of ``path`` (each ``{"prompt": str or messages, **fields}``); one-line errors name file and row."""
    from tether.inputs.records import read_records, record_location

    return prompt_rows(read_records(path, skip_invalid=skip_invalid), lambda n: record_location(path, n), path,
                       skip_invalid)


def prompts_from_data(data, name: str = "prompts") -> list[dict]:
    """Prompt rows handed over from Python: a ``datasets.Dataset`` or a list of rows, of prompt texts, or of
    message lists (:func:`tether.inputs.records.python_records`); rows are named ``"NAME: row N"`` in errors. A
    path string (or ``hf:org/name``) is read as the file it names (:func:`load_prompts`)."""
    import os

    from tether.inputs.records import python_records

    if isinstance(data, (str, os.PathLike)):
        return load_prompts(os.fspath(data))

    records = [(n, r if isinstance(r, dict) else {"prompt": r}) for n, r in python_records(data, name)]
    return prompt_rows(records, lambda n: f"{name}: row {n}", name)


def prompt_rows(records: list[tuple[int, dict]], location, name: str, skip_invalid: bool = False) -> list[dict]:
    """Normalised prompt rows of numbered ``records``; ``location(number)`` names a row in errors. A prompt
    given as chat messages must end with the user's turn (the policy answers it)."""
    from tether.inputs.conversations import check_messages

    rows, skipped = [], 0
    for number, record in records:
        row = _to_prompt(record) if isinstance(record, dict) else None
        problem = None
        if row is None:
            problem = f"no prompt column (expected 'prompt', 'question', 'Body'+'Question' or an HH 'chosen'); " \
                      f"found {sorted(record)[:6] if isinstance(record, dict) else type(record).__name__}"
        elif isinstance(row["prompt"], (list, tuple)):
            row["prompt"] = check_messages(row["prompt"], location(number), "prompt", last_role="user")
        elif not isinstance(row["prompt"], str) or not row["prompt"].strip():
            problem = "empty prompt"
        if problem:
            if skip_invalid:
                skipped += 1
                continue
            raise DataError(f"{location(number)}: {problem}")
        rows.append(row)
    if not rows:
        raise DataError(f"{name}: no prompts" + (f" ({skipped} invalid rows skipped)" if skipped else ""))
    return rows


def collate_fields(rows: list[dict]) -> dict[str, list]:
    """The non-prompt columns of ``rows`` as keyword lists (missing values are None)."""
    keys = sorted({k for r in rows for k in r if k != "prompt"})
    return {k: [r.get(k) for r in rows] for k in keys}
