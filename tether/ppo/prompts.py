"""Prompt datasets for PPO: file loading in the shapes users have, and a resumable, seeded stream.

Shapes (detected per file): ``prompt`` (+ any other columns, e.g. ``answer``); GSM8K ``question`` +
``answer`` ("… #### N", reduced to N); SVAMP ``Body`` + ``Question`` + ``Answer`` (prompt = Body + " " +
Question); HH-RLHF transcripts ``chosen`` (prompt = the text up to and including the last
"\\n\\nAssistant:"). A ``prompt`` may be a list of chat messages (TRL's conversational form), rendered by the
policy's chat template. Every other column travels with its prompt and reaches rule rewards as a keyword list;
rules get each prompt as it was given (text or messages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.conversations import ASSISTANT
from tether.ppo.curriculum import Curriculum
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
    """Prompt rows of ``path`` (each ``{"prompt": str or messages, **fields}``); one-line errors name file and row."""
    from tether.data import read_records, record_location

    return prompt_rows(read_records(path, skip_invalid=skip_invalid), lambda n: record_location(path, n), path,
                       skip_invalid)


def prompts_from_data(data, name: str = "prompts") -> list[dict]:
    """Prompt rows handed over from Python: a ``datasets.Dataset`` or a list of rows, of prompt texts, or of
    message lists (:func:`tether.data.python_records`); rows are named ``"NAME: row N"`` in errors."""
    from tether.data import python_records

    records = [(n, r if isinstance(r, dict) else {"prompt": r}) for n, r in python_records(data, name)]
    return prompt_rows(records, lambda n: f"{name}: row {n}", name)


def prompt_rows(records: list[tuple[int, dict]], location, name: str, skip_invalid: bool = False) -> list[dict]:
    """Normalised prompt rows of numbered ``records``; ``location(number)`` names a row in errors. A prompt
    given as chat messages must end with the user's turn (the policy answers it)."""
    from tether.conversations import check_messages

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


@dataclass
class PromptStream:
    """Seeded, reshuffled each epoch, split across ranks; ``state_dict`` is the data position (B14). With a
    :class:`~tether.ppo.curriculum.Curriculum` each draw is weighted by the prompts' recent pass rates instead
    (without replacement within a draw, seeded by seed, rank and the draw count), and its table is state too."""

    rows: list[dict]
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    cursor: int = 0
    curriculum: Curriculum | None = None
    draws: int = 0

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def draw(self) -> tuple[list[int], list[dict]]:
        """This rank's ``batch_size`` prompts: their indices in ``rows`` and the rows."""
        indices = self._next_indices()
        return indices, [self.rows[i] for i in indices]

    def next_batch(self) -> list[dict]:
        return self.draw()[1]

    def _next_indices(self) -> list[int]:
        if self.curriculum is not None:
            self.draws += 1
            return self.curriculum.draw(self.batch_size, (self.seed * 1_000_003 + self.rank) * 100_003 + self.draws)
        stride = self.batch_size * self.world_size
        if self.cursor + stride > len(self.rows):
            if stride > len(self.rows):
                # Fewer prompts than a step needs: sample with wrap-around inside one permutation.
                order = self._order()
                start = self.cursor + self.rank * self.batch_size
                self.cursor += stride
                return [order[(start + i) % len(order)] for i in range(self.batch_size)]
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._order()
        start = self.cursor + self.rank * self.batch_size
        self.cursor += stride
        return order[start:start + self.batch_size]

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "cursor": self.cursor, "draws": self.draws}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.draws = int(state.get("draws", 0))
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
