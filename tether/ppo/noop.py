"""Did the step train anything? What the doctor's no-op checks read (issue 54; docs/diagnostics.md):

- :class:`WeightProbe`: ``ppo/param_update_norm`` = ‖θ_after − θ_before‖₂ over the policy's trainable parameters
  across the step's optimizer updates, measured exactly against a snapshot taken before them (not a sum of the
  optimizer's steps: clipping, Adam's moments and bf16 rounding decide what lands in the weights). When: every step
  while the trainable parameters are at most :data:`EVERY_STEP_ELEMENTS` (LoRA adapters, small models: the copy is
  cheap); above that (full fine-tuning of a large model) at steps 1 and 2 — what the no-op check reads — and every
  :data:`EVERY_N`-th step, the snapshot then kept in host memory, so that it adds nothing to the device's peak.
- :class:`WeightVersions`: the trainer's weight version (steps whose updates changed the policy) and the version
  the rollout engine last took (``rollout/weight_version``): an engine that holds its own copy of the weights and
  lags behind the trainer samples an older policy than PPO scores. Logged on-policy only: one step off (C7) the
  engine takes the weights while the step trains, and ``rollout/staleness`` says which update sampled the batch.
- ``advantages/nonzero_fraction``: the share of response tokens whose advantage is not 0 (:func:`advantage_metrics`).

:func:`before_update` and :func:`after_update` are the step's two calls around its update phase. Imports torch and
:mod:`tether.core.stats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tether.core.stats import nonzero_counts, squared_change

EVERY_STEP_ELEMENTS = 100_000_000  # 400 MB as an fp32 copy on the device: measured every step at or below
EVERY_N = 10  # above it: steps 1, 2 and every 10th


def measured_at(step: int, n_elements: int) -> bool:
    """Whether step ``step`` (1-based) measures the update norm for ``n_elements`` trainable elements."""
    return n_elements <= EVERY_STEP_ELEMENTS or step <= 2 or step % EVERY_N == 0


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (FSDP2: its shard of a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


class WeightProbe:
    """``snapshot(step)`` before the update phase, ``norm()`` after it: ‖θ_after − θ_before‖₂ over ``params``,
    reduced over the processes when they hold shards (``sharded``: FSDP2), else this process's (DDP: every process
    holds the same weights). None on a step that does not measure (:func:`measured_at`)."""

    def __init__(self, params: list[torch.Tensor], processes, sharded: bool):
        self.params, self.processes, self.sharded = params, processes, sharded
        self.n_elements = sum(p.numel() for p in params)
        self.before: list[torch.Tensor] | None = None
        self.policy_trains = True  # False in a critic warm-up step: the policy's version does not move

    def snapshot(self, step: int, policy_trains: bool = True) -> None:
        self.before, self.policy_trains = None, policy_trains
        if not self.params or not policy_trains or not measured_at(step, self.n_elements):
            return
        host = self.n_elements > EVERY_STEP_ELEMENTS  # a large copy goes to host memory, off the device's peak
        self.before = [_local(p).detach().to("cpu" if host else _local(p).device, copy=True) for p in self.params]

    def norm(self) -> float | None:
        if self.before is None:
            return None
        sq = squared_change(self.before, [_local(p) for p in self.params])
        self.before = None
        total = self.processes.global_sum(sq) if self.sharded else float(sq)
        return math.sqrt(max(float(total), 0.0))


@dataclass
class WeightVersions:
    """The trainer's weight version (steps whose updates changed the policy; checkpointed, so a resumed run counts
    on) and the version the rollout engine took at its last weight sync."""

    trainer: int = 0
    engine: int = 0

    def trained(self, updates: int, norm: float | None) -> None:
        """After a step's update phase: the policy changed when updates were applied and (where measured) moved it."""
        if updates > 0 and (norm is None or norm > 0.0):
            self.trainer += 1

    def synced(self) -> None:
        self.engine = self.trainer

    def metrics(self, engine_syncs: bool) -> dict:
        """``rollout/weight_version`` and ``rollout/weight_lag`` (trainer − engine, at sampling), for an engine that
        holds its own copy of the weights; {} for one that samples with the trained module itself."""
        if not engine_syncs:
            return {}
        return {"rollout/weight_version": self.engine, "rollout/weight_lag": self.trainer - self.engine}


def before_update(run, cfg, step: int) -> dict:
    """Before the update phase: snapshot the trainable weights (where this step measures; never in a critic warm-up
    step, which leaves the policy alone by design) and return the engine's weight version and lag as the batch was
    sampled."""
    if run.probe is None:
        run.probe = WeightProbe(run.optim.policy_params, run.processes, sharded=run.processes.fsdp is not None)
    run.probe.snapshot(step, policy_trains=step > cfg.critic.warmup_steps)
    return run.versions.metrics(run.models.engine.syncs_weights and run.data.ahead is None)


def after_update(run, train_stats: dict) -> dict:
    """After it: ``ppo/param_update_norm`` (where measured); the trainer's version moves on if the policy changed."""
    norm = run.probe.norm()
    updates = int(train_stats.get("ppo/updates", 0)) if run.probe.policy_trains else 0
    run.versions.trained(updates, norm)
    return {} if norm is None else {"ppo/param_update_norm": norm}


def advantage_metrics(p, advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """``advantages/nonzero_fraction`` over the valid response tokens of all processes (0 = nothing to learn)."""
    nonzero, total = nonzero_counts(advantages, mask)
    total = p.global_sum(total.double())
    return {"advantages/nonzero_fraction": p.global_sum(nonzero.double()) / total} if total > 0 else {}
