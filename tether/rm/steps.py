"""Step-labelled data for process reward models (A9): reading it, and making it from a gold rule.

Accepted rows (JSONL, JSON, CSV with list columns as JSON text, Parquet, a ``datasets`` folder):

- ``{"prompt": ..., "completions": [step, ...], "labels": [label, ...]}`` — TRL's stepwise supervision;
- ``{"prompt": ..., "steps": [step, ...], "labels": [...]}``;
- ``{"prompt": ..., "response": "step<sep>step", "labels": [...]}`` — the response split at the separator
  (:func:`tether.core.steps.split_steps`).

A label is good (1) or bad (0): ``true``/``false``, ``1`` (good) and ``0``/``-1`` (bad; PRM800K's
ratings, where 0 is "neutral" and counted as not good), ``"+"``/``"-"`` (Math-Shepherd). There is one
label per step (a row whose labels stop early, as PRM800K's stop at the first error, is refused: cut its
steps to its labels first).

The converter (:func:`label_with_rule`, ``tether label-steps``) turns ``(prompt, response)`` rows into
such data with a step rule: any callable ``rule(prompts, steps, **fields) -> list[list[bool]]`` named
``module:function`` — e.g. ``tether.demo.steps:step_labels`` checks each partial sum of the demo's
step task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from tether.core.steps import split_steps
from tether.inputs.records import read_records, record_location
from tether.errors import DataError, TetherError

# True == 1 and False == 0 as dict keys, so the numbers 1, 0 (and 1.0, 0.0) match too
GOOD = {True: 1, "+": 1, "1": 1, "true": 1, "good": 1}
BAD = {False: 0, -1: 0, "-": 0, "0": 0, "-1": 0, "false": 0, "bad": 0}


def unescape_separator(text: str) -> str:
    """A separator as typed on a command line or in YAML: ``\\n`` and ``\\t`` read as newline and tab."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


@dataclass
class StepExample:
    prompt: str
    steps: list[str]
    labels: list[int]  # 1 good, 0 bad, one per step
    where: str = ""  # "FILE: line N", for messages


def parse_label(value, where: str, k: int) -> int:
    """1 (good) or 0 (bad) from the accepted spellings; DataError naming the row and step otherwise."""
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    try:
        if key in GOOD:
            return GOOD[key]
        if key in BAD:
            return BAD[key]
    except TypeError:  # unhashable (a list, a dict)
        pass
    raise DataError(f"{where}: step {k + 1}: label {value!r} is not one of true/false, 1/0/-1, '+'/'-'")


def _list_field(record: dict, key: str, where: str) -> list:
    value = record[key]
    if isinstance(value, str):  # CSV cells hold lists as JSON text
        try:
            value = json.loads(value)
        except ValueError:
            raise DataError(f"{where}: field '{key}' must be a list (or JSON text of one)") from None
    if hasattr(value, "tolist"):  # numpy arrays from Parquet
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}: field '{key}' must be a list, got {type(value).__name__}")
    return list(value)


def example_from_record(record: dict, where: str, separator: str) -> StepExample:
    """One :class:`StepExample` from a row of any accepted shape (see module doc); one-line DataError."""
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be non-empty text")
    step_key = next((k for k in ("completions", "steps", "response") if k in record), None)
    if step_key is None or "labels" not in record:
        missing = "labels" if step_key else "completions, steps or response"
        raise DataError(f"{where}: missing field {missing} (found: {', '.join(map(str, record))})")
    if step_key == "response":
        if not isinstance(record["response"], str):
            raise DataError(f"{where}: field 'response' must be text")
        steps = split_steps(record["response"], separator)[0]
    else:
        steps = _list_field(record, step_key, where)
        bad = next((k for k, s in enumerate(steps) if not isinstance(s, str)), None)
        if bad is not None:
            raise DataError(f"{where}: step {bad + 1} is {type(steps[bad]).__name__}, not text")
        cut = next((k for k, s in enumerate(steps) if separator in s), None)
        if cut is not None:
            raise DataError(f"{where}: step {cut + 1} contains the step separator {separator!r}")
    labels = [parse_label(v, where, k) for k, v in enumerate(_list_field(record, "labels", where))]
    if not steps:
        raise DataError(f"{where}: no steps")
    if len(labels) != len(steps):
        raise DataError(f"{where}: {len(steps)} steps but {len(labels)} labels")
    return StepExample(prompt, [str(s) for s in steps], labels, where)


def load_step_examples(paths: Iterable[str | Path], separator: str = "\n", *, skip_invalid: bool = False
                       ) -> tuple[list[StepExample], dict]:
    """Every usable row of every file, in order, and counts (``rows``, ``examples``, ``invalid``, ``steps``,
    ``good_steps``). Bad rows raise a one-line DataError (file and line) unless ``skip_invalid``."""
    examples: list[StepExample] = []
    counts = {"rows": 0, "invalid": 0}
    for path in paths:
        skipped: list[str] = []
        records = read_records(path, skip_invalid=skip_invalid, skipped=skipped)
        counts["rows"] += len(records) + len(skipped)
        counts["invalid"] += len(skipped)
        for number, record in records:
            try:
                examples.append(example_from_record(record, record_location(path, number), separator))
            except DataError:
                if not skip_invalid:
                    raise
                counts["invalid"] += 1
    if not examples:
        raise DataError(f"{', '.join(map(str, paths))}: no usable step-labelled rows")
    counts.update(examples=len(examples), steps=sum(len(e.steps) for e in examples),
                  good_steps=sum(sum(e.labels) for e in examples))
    return examples, counts


def label_with_rule(rows: list[dict], rule: Callable, separator: str) -> list[StepExample]:
    """The converter: ``rows`` with ``prompt`` and ``response`` (other columns go to the rule as keyword
    lists) → step examples, each response split at ``separator`` and labelled by
    ``rule(prompts, steps, **fields) -> list[list[bool]]`` (one label per step)."""
    prompts = [r["prompt"] for r in rows]
    steps = [split_steps(r["response"], separator)[0] for r in rows]
    fields = {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "response")} if rows else {}
    labels = rule(prompts, steps, **fields)
    if len(labels) != len(rows):
        raise TetherError(f"step rule returned labels for {len(labels)} rows, expected {len(rows)}")
    out = []
    for i, (row_steps, row_labels) in enumerate(zip(steps, labels)):
        if len(row_labels) != len(row_steps):
            raise TetherError(f"step rule: row {i + 1} has {len(row_steps)} steps but {len(row_labels)} labels")
        out.append(StepExample(prompts[i], row_steps, [int(bool(y)) for y in row_labels], f"row {i + 1}"))
    return out


def write_step_examples(examples: list[StepExample], path: str | Path) -> None:
    """JSONL in the ``completions``/``labels`` shape (TRL's), written to a temporary file and renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "completions": e.steps,
                                "labels": [bool(y) for y in e.labels]}, ensure_ascii=False) + "\n")
    tmp.replace(path)
