"""Forwards a PPO step can leave out because their result is known (issue 53 item 2): which ones, decided once at
set-up from the config, and the record that carries the training forward's log-probs back to the step.

(a) **Old log-probs** (``ppo.old_logprobs auto``). With one epoch of one minibatch, sampled by the current
weights (no ``--async-rollout``), π_old is the policy the single update's forward computes: that forward's
log-probs, detached, are log π_old exactly (ratio 1, clip inactive, the same gradient A_t·∇log π as the
separate pass gives to float rounding). It is valid only where nothing needs log π_old *before* the update:

- the per-token KL in the reward (``--kl-in reward`` with β > 0) enters GAE's rewards before the update;
- a value head reads the hidden states of that forward for V_old (GAE's baseline);
- ``--rollout-correction tis|mis`` weighs tokens by π_old/π_sampler in the loss it feeds;
- LoRA dropout makes two forwards of the same weights differ (the separate pass's ratio is not 1).

Everything read only after the update (objective/kl*, policy/entropy, the sampler gap and mismatch metrics, the
KL controller's input) is computed from the training forward's detached log-probs and entropy. The early stop
on approx KL to π_old has nothing to stop after the only epoch. Dynamic sampling judges scores, not log-probs.
One difference stays: B16 drops a row whose old log-probs are not finite before the update; here the update's
own non-finite check skips the whole (single) update instead.

(c) **Reference log-probs** (``kl.reference auto``): skipped when β = 0 for the whole run (``kl.coef 0``, the
fixed controller, ``--kl-in reward``): the rewards and advantages then do not read the KL. The KL metrics are
then *not computed*: objective/kl, kl_max, kl_p99 and kl_sequence are left out of the row (not written as 0),
and the KL controller (fixed at 0) is not updated. ``kl.reference always`` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardSkips:
    """What :func:`plan_skips` decided for the run, with the reason for each."""

    old_logprobs: bool = False   # (a) log π_old from the training forward, no separate pass
    reference: bool = False      # (c) no reference pass (β = 0 throughout, no KL metric asked)
    old_reason: str = ""
    reference_reason: str = ""

    @property
    def phases(self) -> tuple[str, ...]:
        """The scoring phases (perf/seconds_*) left out: their FLOPs count 0."""
        return tuple(name for name, on in (("logprobs_old", self.old_logprobs), ("reference", self.reference)) if on)


def old_logprobs_blocker(cfg, critic_is_head: bool) -> str:
    """Why log π_old cannot be taken from the training forward in this run ('' when it can)."""
    p = cfg.ppo
    if p.old_logprobs == "forward":
        return "ppo.old_logprobs forward"
    if p.epochs > 1:
        return f"ppo.epochs {p.epochs} > 1: a later epoch trains on a policy the first one moved"
    if p.mini_batches > 1:
        return f"ppo.mini_batches {p.mini_batches} > 1: a later minibatch trains on a policy the first one moved"
    if cfg.generation.async_rollout:
        return "--async-rollout 1: the batch was sampled by weights one update behind"
    if cfg.kl.penalty_in == "reward" and cfg.kl.coef > 0:
        return (f"the per-token KL in the reward (--kl-coef {cfg.kl.coef:g}, --kl-in reward) needs log pi_old "
                "before GAE; --kl-in loss or --kl-coef 0 lifts it")
    if critic_is_head:
        return "the value head reads the old forward's hidden states for V_old (--critic separate or a critic-free " \
               "--advantage lifts it)"
    if cfg.correction.mode != "none":
        return f"--rollout-correction {cfg.correction.mode} weighs tokens by pi_old / pi_sampler before the update"
    if cfg.model.lora_r and cfg.model.lora_dropout > 0:
        return "--lora-dropout > 0: two forwards of the same weights differ"
    return ""


def reference_blocker(cfg) -> str:
    """Why the reference forward must run in this run ('' when it can be left out)."""
    k = cfg.kl
    if k.reference == "always":
        return "kl.reference always"
    if k.penalty_in == "loss":
        return "--kl-in loss"
    if k.coef > 0 or k.controller != "fixed":
        return f"beta {k.coef:g} ({k.controller})"
    return ""


def plan_skips(cfg, critic_is_head: bool) -> ForwardSkips:
    old, ref = old_logprobs_blocker(cfg, critic_is_head), reference_blocker(cfg)
    return ForwardSkips(old_logprobs=not old, reference=not ref, old_reason=old, reference_reason=ref)


def startup_lines(cfg, skips: ForwardSkips) -> list[str]:
    """One line per forward left out, and one where ``ppo.old_logprobs auto`` is in the one-epoch, one-minibatch
    shape it is for but something else keeps the separate pass (saying what)."""
    lines = []
    if skips.old_logprobs:
        lines.append("old log-probs: taken from the training forward (one epoch, one minibatch, on-policy: "
                     "pi_old = pi, ratio 1); ppo.old_logprobs forward runs the separate pass")
    elif cfg.ppo.old_logprobs == "auto" and cfg.ppo.epochs == 1 and cfg.ppo.mini_batches == 1:
        lines.append(f"old log-probs: a separate forward, because {skips.old_reason}")
    if skips.reference:
        lines.append("reference forward: skipped (beta = 0 throughout); objective/kl* are not computed "
                     "(--kl-reference always computes them)")
    return lines


class TrainingForwardLog:
    """Collects the detached log-probs and entropy of the training forward, row by row, when log π_old is taken
    from it (a). Rides on the :class:`~tether.ppo.records.Experience` (field ``from_forward``): selecting rows
    selects its row numbers and keeps one shared store, so each micro-batch records under its original rows."""

    def __init__(self, rows: torch.Tensor, store: list | None = None):
        self.rows = rows                                   # (b,) the original row numbers of this selection
        self.store = [] if store is None else store

    def select(self, index: torch.Tensor) -> TrainingForwardLog:
        return TrainingForwardLog(self.rows[index.to(self.rows.device)], self.store)

    def record(self, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> None:
        self.store.append((self.rows, logprobs.detach(), None if entropy is None else entropy.detach()))

    def assemble(self, n_rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) log-probs and entropy of every recorded row (0 past each micro-batch's trimmed width; a row
        never recorded stays 0)."""
        logprobs = torch.zeros(n_rows, width, device=device)
        entropy = torch.zeros(n_rows, width, device=device) if all(e is not None for _, _, e in self.store) \
            else None
        for rows, lp, ent in self.store:
            logprobs[rows.to(device), :lp.shape[1]] = lp.float().to(device)
            if entropy is not None:
                entropy[rows.to(device), :ent.shape[1]] = ent.float().to(device)
        return logprobs, entropy


def training_logprobs(experience, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After the update of (a): log π_old and the entropy, (B, T) each, from the training forward's detached
    results, 0 on dropped rows as the separate pass's are (``mask`` (B, T): the kept rows' tokens)."""
    logprobs, entropy = experience.from_forward.assemble(len(experience), mask.shape[1], mask.device)
    keep = experience.valid[:, None].to(mask.device)
    return torch.where(keep, logprobs, 0.0), None if entropy is None else torch.where(keep, entropy, 0.0)
