"""Prompt datasets for PPO: the rows in the shapes users have (:mod:`tether.inputs.prompt_rows`, shared with SFT and
``tether sample``; importable from here as before), the held-out split by prompt (:func:`split_held_out`), and a
resumable, seeded stream (:class:`PromptStream`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from tether.inputs.prompt_rows import (  # noqa: F401 - this module's API since before the move to tether.inputs
    collate_fields,
    load_prompts,
    prompt_rows,
    prompts_from_data,
)
from tether.ppo.curriculum import Curriculum



def prompt_group_key(prompt) -> str:
    """What makes two rows the same prompt: the text, or a conversation's messages (as canonical JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def split_held_out(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows, split **by prompt**: every row of one prompt lands on one side, so no held-out
    prompt is ever trained on, even where the file repeats it. The distinct prompts, in the order they first
    appear, are permuted by ``torch.randperm`` seeded with ``seed``; whole prompts from the front of the permutation
    are held out until they hold ``max(1, int(len(rows) * fraction))`` rows, and never the last one (something must
    be left to train on). The training rows follow the permutation. Where every prompt is distinct this is the
    row split of earlier versions, row for row (a recipe's held-out problems do not move)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(prompt_group_key(row["prompt"]), []).append(row)
    prompts = list(groups)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    target, held, n_held = max(1, int(len(rows) * fraction)), 0, 0
    while held < len(order) - 1 and n_held < target:
        n_held += len(groups[prompts[order[held]]])
        held += 1
    return ([row for i in order[held:] for row in groups[prompts[i]]],
            [row for i in order[:held] for row in groups[prompts[i]]])

@dataclass
class PromptStream:
    """Seeded, reshuffled each epoch, split across ranks; ``state_dict`` is the data position (B14). With a
    :class:`~tether.ppo.curriculum.Curriculum` each draw is weighted by the prompts' recent pass rates instead:
    one draw of ``n`` (``batch_size`` unless dynamic sampling oversamples) × world size for all processes
    (seeded by seed and the draw count, each rank its slice), without replacement within a step
    (:meth:`begin_step`), and its table is state too."""

    rows: list[dict]
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    cursor: int = 0
    curriculum: Curriculum | None = None
    draws: int = 0
    taken: torch.Tensor | None = None  # (len(rows),) bool: the prompts the curriculum drew this step (this pass)
    flat_share: float | None = None    # --filter-groups: recent steps' share of drawn groups with no spread (EMA)

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def draw(self, n: int | None = None) -> tuple[list[int], list[dict]]:
        """This rank's ``n`` prompts (default ``batch_size``; every rank draws the same ``n``): their indices in
        ``rows`` and the rows."""
        indices = self._next_indices(self.batch_size if n is None else n)
        return indices, [self.rows[i] for i in indices]

    def next_batch(self, n: int | None = None) -> list[dict]:
        return self.draw(n)[1]

    def begin_step(self) -> None:
        """A new step: the curriculum may draw every prompt again (a step's rounds draw without replacement)."""
        self.taken = None

    def _next_indices(self, n: int) -> list[int]:
        if self.curriculum is not None:  # one draw for all processes (the same seed, the same table), rank's slice
            self.draws += 1
            if self.taken is None:
                self.taken = torch.zeros(len(self.rows), dtype=torch.bool)
            every = self.curriculum.draw(n * self.world_size, self.seed * 1_000_003 * 100_003 + self.draws,
                                         self.taken)
            return every[self.rank * n:(self.rank + 1) * n]
        stride = n * self.world_size
        if self.cursor + stride > len(self.rows):
            if stride > len(self.rows):
                # Fewer prompts than a step needs: sample with wrap-around inside one permutation.
                order = self._order()
                start = self.cursor + self.rank * n
                self.cursor += stride
                return [order[(start + i) % len(order)] for i in range(n)]
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._order()
        start = self.cursor + self.rank * n
        self.cursor += stride
        return order[start:start + n]

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "cursor": self.cursor, "draws": self.draws, "flat_share": self.flat_share}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.draws = int(state.get("draws", 0))
        self.flat_share = state.get("flat_share")
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
