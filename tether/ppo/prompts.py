"""Prompt datasets for PPO: the rows in the shapes users have (:mod:`tether.prompt_rows`, shared with SFT and
``tether sample``; importable from here as before), and a resumable, seeded stream (:class:`PromptStream`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.prompt_rows import (  # noqa: F401 - this module's API since before the move to tether.prompt_rows
    collate_fields,
    load_prompts,
    prompt_rows,
    prompts_from_data,
)
from tether.ppo.curriculum import Curriculum


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
