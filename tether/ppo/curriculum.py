"""An online prompt curriculum (SPEC B18): each training prompt's recent pass rate, remembered across steps and
checkpoints, and the weights the prompt stream draws with.

A *visit* is one step in which a prompt was sampled: its pass rate is the share of its K samples whose score
passed (score > ``pass_threshold``; a NaN score counts as not passed). A prompt keeps its last ``memory`` visits.
Its weight in the next draw is

    w = min_weight   when every remembered visit passed all its samples (solved) or none (unsolved),
    w = 1            otherwise, and for a prompt never visited,

so prompts that teach nothing under a group baseline (K/K or 0/K: no spread, advantage 0) are drawn less often —
never excluded, since a policy that improves may start solving an unsolved one.

One draw per step for all processes: every round of a step draws ``--batch-size`` × processes prompts at once,
seeded by (seed, draw count) alone — the same on every process, whose table is the same — and each process takes
its own slice, so no two processes train on one prompt. Draws are without replacement within a step: a later round
(``--filter-groups``) draws from the prompts the step has not taken yet, and only a step that needs more prompts than
there are starts a new pass over all of them (wrap-around, as the plain stream does). A resumed run draws the same
prompts (the table and the draw count are the state). Each step's visits are gathered from all processes and
recorded once per prompt: a prompt drawn twice in one step (only past a wrap-around) makes one visit, the share of
all its samples that passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Curriculum:
    n_prompts: int
    memory: int = 2
    min_weight: float = 0.25
    pass_threshold: float = 0.5
    visits: dict[int, list[float]] = field(default_factory=dict)  # prompt index -> pass rates, oldest first

    def weights(self) -> torch.Tensor:
        """(n_prompts,) the draw weight of every prompt (module docstring)."""
        w = torch.ones(self.n_prompts, dtype=torch.float64)
        for index, rates in self.visits.items():
            if len(rates) == self.memory and (all(r == 1.0 for r in rates) or all(r == 0.0 for r in rates)):
                w[index] = self.min_weight
        return w

    def pass_rates(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """(B,) scores of B = G·K rows, the K samples of each prompt adjacent → (G,) share of samples that passed."""
        passed = torch.nan_to_num(scores.double(), nan=-torch.inf) > self.pass_threshold
        return passed.reshape(-1, k).double().mean(dim=1)

    def record(self, indices: list[int], rates: list[float]) -> None:
        """Remember one step's visits: ``indices`` and their pass ``rates`` (each over K samples), in step order. A
        prompt listed more than once makes one visit, the mean of its rates (the share of all its samples)."""
        pooled: dict[int, list[float]] = {}
        for index, rate in zip(indices, rates):
            pooled.setdefault(int(index), []).append(float(rate))
        for index, step_rates in pooled.items():
            kept = self.visits.setdefault(index, [])
            kept.append(sum(step_rates) / len(step_rates))
            del kept[:-self.memory]

    def draw(self, n: int, seed: int, taken: torch.Tensor | None = None) -> list[int]:
        """``n`` prompt indices drawn with :meth:`weights`, without replacement among the prompts not ``taken``
        ((n_prompts,) bool: drawn earlier in this pass; updated in place). When every prompt is taken a new pass
        begins: all of them again, so n ≥ n_prompts gives each prompt once (a weighted order) before any repeats."""
        g = torch.Generator().manual_seed(seed)
        weights = self.weights()
        taken = torch.zeros(self.n_prompts, dtype=torch.bool) if taken is None else taken
        out: list[int] = []
        while len(out) < n:
            if bool(taken.all()):
                taken.zero_()  # every prompt drawn in this pass: the next pass starts
            free = (~taken).nonzero().flatten()
            picked = free[torch.multinomial(weights[free], min(n - len(out), len(free)), replacement=False,
                                            generator=g)]
            taken[picked] = True
            out += picked.tolist()
        return out

    def state_dict(self) -> dict:
        return {"visits": {str(k): list(v) for k, v in self.visits.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.visits = {int(k): [float(x) for x in v] for k, v in state.get("visits", {}).items()}

    def summary(self) -> dict[str, float]:
        """Shares of the prompts (all of them) whose remembered visits say solved or unsolved, and visited at all."""
        full = [r for r in self.visits.values() if len(r) == self.memory]
        solved = sum(all(x == 1.0 for x in r) for r in full)
        unsolved = sum(all(x == 0.0 for x in r) for r in full)
        n = max(self.n_prompts, 1)
        return {"curriculum/solved_prompts": solved / n, "curriculum/unsolved_prompts": unsolved / n,
                "curriculum/visited_prompts": len(self.visits) / n}
