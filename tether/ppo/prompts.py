"""Prompt datasets for PPO: file loading in the shapes users have, and a resumable, seeded stream.

Shapes (detected per file): ``prompt`` (+ any other columns, e.g. ``answer``); GSM8K ``question`` +
``answer`` ("… #### N", reduced to N); SVAMP ``Body`` + ``Question`` + ``Answer`` (prompt = Body + " " +
Question); HH-RLHF transcripts ``chosen`` (prompt = the text up to and including the last
"\\n\\nAssistant:"). Every other column travels with its prompt and reaches rule rewards as a keyword list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.data import ASSISTANT
from tether.errors import DataError


def _to_prompt(record: dict) -> dict | None:
    """Normalise one record to ``{"prompt": str, **fields}``; None when no prompt can be found."""
    from tether.rules import gold_integer

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
    """Prompt rows of ``path`` (each ``{"prompt": str, **fields}``); one-line errors name file and row."""
    from tether.data import read_records, record_location

    rows, skipped = [], 0
    for number, record in read_records(path, skip_invalid=skip_invalid):
        row = _to_prompt(record) if isinstance(record, dict) else None
        problem = None
        if row is None:
            problem = f"no prompt column (expected 'prompt', 'question', 'Body'+'Question' or an HH 'chosen'); " \
                      f"found {sorted(record)[:6] if isinstance(record, dict) else type(record).__name__}"
        elif not isinstance(row["prompt"], str) or not row["prompt"].strip():
            problem = "empty prompt"
        if problem:
            if skip_invalid:
                skipped += 1
                continue
            raise DataError(f"{record_location(path, number)}: {problem}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no prompts" + (f" ({skipped} invalid rows skipped)" if skipped else ""))
    return rows


def collate_fields(rows: list[dict]) -> dict[str, list]:
    """The non-prompt columns of ``rows`` as keyword lists (missing values are None)."""
    keys = sorted({k for r in rows for k in r if k != "prompt"})
    return {k: [r.get(k) for r in rows] for k in keys}


@dataclass
class PromptStream:
    """Seeded, reshuffled each epoch, split across ranks; ``state_dict`` is the data position (B14)."""

    rows: list[dict]
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    cursor: int = 0

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next_batch(self) -> list[dict]:
        """This rank's ``batch_size`` rows; the epoch wraps (and reshuffles) when too few remain."""
        stride = self.batch_size * self.world_size
        if self.cursor + stride > len(self.rows):
            if stride > len(self.rows):
                # Fewer prompts than a step needs: sample with wrap-around inside one permutation.
                order = self._order()
                start = self.cursor + self.rank * self.batch_size
                self.cursor += stride
                return [self.rows[order[(start + i) % len(order)]] for i in range(self.batch_size)]
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._order()
        start = self.cursor + self.rank * self.batch_size
        self.cursor += stride
        return [self.rows[i] for i in order[start:start + self.batch_size]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
