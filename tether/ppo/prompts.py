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
