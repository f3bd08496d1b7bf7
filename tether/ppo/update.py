"""Steps 8–9 of a PPO step: epochs of shuffled minibatch updates on the frozen experience, with the KL early
stop (SPEC B9, B6, B10, B16). :func:`ppo_epochs` is called once per step by :func:`tether.ppo.step.ppo_step`.

Per minibatch: zero the gradients, forward and backward each micro-batch (gradient accumulation, weighted by its
share of the minibatch's tokens over all processes), check the losses are finite on every process, unscale,
clip each model's gradient norm, step the optimisers and schedulers.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from tether.core.advantages import masked_mean
from tether.core.group import group_permutation
from tether.core.kl import kl_penalty
from tether.core.losses import cispo_policy_loss, gspo_policy_loss, ppo_policy_loss, ppo_value_loss
from tether.ppo.forward import critic_values, forward_response
from tether.ppo.records import Experience
from tether.sharding import grad_norm_value


def ppo_epochs(run, cfg, experience: Experience, step: int) -> tuple[dict, int]:
    """ppo.epochs × shuffled minibatches of clipped policy and value updates (B9, B6), with gradient
    accumulation, per-model grad-norm clipping, critic warm-up and the KL early stop (B10). The shuffle moves
    whole groups (the K samples of a prompt stay together in one minibatch, B17; K = 1: the rows). After an epoch
    whose mean approx KL to π_old exceeds ``ppo.early_stop_factor × ppo.target_kl``, no further epoch runs.
    Returns the mean stats of the applied updates and the number of epochs run. Minibatches hold
    ``minibatch_size`` rows; a batch of fewer groups than ``--batch-size`` (a short ``--filter-groups`` step on one
    process) makes fewer of them, the last one smaller."""
    p = run.processes
    critic_only = step <= cfg.critic.warmup_steps
    sums: dict[str, float] = {}
    applied = skipped = 0
    ratio_max = 0.0
    epochs_run = 0
    # A per-step generator makes the minibatch order independent of everything else (exact resume).
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    for _ in range(cfg.ppo.epochs):
        order = group_permutation(len(experience) // cfg.samples_per_prompt, cfg.samples_per_prompt, g).to(p.device)
        epoch_kl = []
        for start in range(0, len(experience), cfg.minibatch_size):
            stats = minibatch_update(run, cfg, experience.select(order[start:start + cfg.minibatch_size]),
                                     critic_only)
            if stats is None:  # non-finite loss or gradient norm: no update, its stats left out of the means
                skipped += 1
                continue
            ratio_max = max(ratio_max, stats.pop("ratio_max", 0.0))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            applied += 1
            epoch_kl.append(stats.get("policy/approx_kl", 0.0))
        epochs_run += 1
        approx_kl = p.global_mean(torch.tensor(sum(epoch_kl) / max(len(epoch_kl), 1)))
        if early_stop_due(cfg, approx_kl, critic_only):
            break
    out = {k: p.global_mean(torch.tensor(v / applied)) for k, v in sums.items()}
    out.update({"health/skipped_updates": skipped, "ppo/updates": applied})
    if not critic_only:
        out["policy/ratio_max"] = p.global_max(torch.tensor(ratio_max))
    return out, epochs_run


def early_stop_due(cfg, approx_kl: float, critic_only: bool) -> bool:
    """B10: stop the epoch loop once the epoch's approx KL to π_old passes ``early_stop_factor × target_kl``
    (its own key: the KL controller's ``kl.target`` is a KL to the reference, another quantity)."""
    return bool(cfg.ppo.early_stop and not critic_only and approx_kl > cfg.ppo.early_stop_factor * cfg.ppo.target_kl)


def minibatch_update(run, cfg, minibatch: Experience, critic_only: bool) -> dict | None:
    """One optimizer update on ``minibatch``: its micro-batches' weighted losses backward, then clip and step.
    Returns the token-weighted stats of the update, or None when it was skipped (B16)."""
    p, m = run.processes, run.models
    if cfg.ppo.trim_padding:  # micro-batches of similar lengths: less padding left after trimming
        total = minibatch.rollout.query_mask.sum(dim=1) + minibatch.rollout.lengths
        minibatch = minibatch.select(torch.argsort(total, stable=True))
    # The losses are token means over the minibatch of *all* processes. DDP averages gradients over
    # processes, so a micro-batch weighs (its tokens × world size / all processes' tokens): processes
    # holding more tokens weigh more, exactly as one process with the whole minibatch would. (Dr. GRPO: rows
    # × max_new_tokens in place of tokens, loss_normaliser.)
    n_tokens = max(p.global_sum(loss_normaliser(cfg, minibatch)), 1.0) / p.world_size
    run.optim.policy_optimizer.zero_grad(set_to_none=True)
    if run.optim.critic_optimizer is not None:
        run.optim.critic_optimizer.zero_grad(set_to_none=True)
    micro = cfg.minibatch_size // cfg.ppo.grad_accumulation
    stats: dict[str, float] = {}
    ratio_max = 0.0
    for m0 in range(0, len(minibatch), micro):
        # a step short of groups alone (--filter-groups) ends on a smaller minibatch: its micro-batches too
        mb = minibatch.select(torch.arange(m0, min(m0 + micro, len(minibatch)), device=p.device))
        mb = mb.trimmed() if cfg.ppo.trim_padding else mb
        weight = loss_normaliser(cfg, mb) / n_tokens
        with p.no_sync([x for x in (m.policy_model, m.critic) if x is not None], last=m0 + micro >= len(minibatch)):
            mb_stats = minibatch_loss(run, cfg, mb, critic_only, weight)
        ratio_max = max(ratio_max, mb_stats.pop("ratio_max", 0.0))
        for k, v in mb_stats.items():
            stats[k] = stats.get(k, 0.0) + v * weight.item()
    # B16: a NaN loss can still give finite (zero) gradients (clamp passes none through NaN), and
    # Adam would then move the weights on its momentum alone: every process checks its losses.
    finite = float(all(map(math.isfinite, stats.values())))
    if p.global_sum(torch.tensor(finite)) != p.world_size:
        return None
    step_stats = clip_and_step(run.optim, cfg, critic_only)
    if step_stats is None:
        return None
    return {**stats, **step_stats, "ratio_max": ratio_max}


def loss_normaliser(cfg, experience: Experience) -> torch.Tensor:
    """What the token terms of the loss over ``experience``'s rows are divided by: their valid tokens (a token
    mean, B9), or for Dr. GRPO their kept rows × max_new_tokens, a constant per response (Liu et al. 2025 §3.1:
    a token of a long response weighs what one of a short response does, so length is not rewarded by the
    normalisation). Rows ``--mask-truncated`` leaves out count in neither (:attr:`Experience.loss_mask`)."""
    mask = experience.loss_mask
    if cfg.advantage.estimator == "dr_grpo":
        return mask.any(dim=1).sum() * cfg.generation.max_new_tokens
    return mask.sum()


def minibatch_loss(run, cfg, mb: Experience, critic_only: bool, weight: torch.Tensor) -> dict:
    """Forward one micro-batch, backward ``weight ×`` (−L_CLIP + c1·L_VF − c2·H + β·KL) (times the fp16 loss
    scale); returns its stats. L_VF only with a critic; β·KL only with kl.penalty_in = loss: the token mean of
    k3(π, π_ref) = π_ref/π − log(π_ref/π) − 1 (GRPO's, Shao et al. 2024 eq. 4). The entropy's graph is built
    only when c2 > 0: over a large vocabulary its softmax is the biggest tensor saved for backward."""
    m = run.models
    mask = mb.loss_mask.float()  # --mask-truncated: a truncated row's tokens weigh nothing in any loss term
    entropy_coef = cfg.ppo.entropy_coef
    with m.precision.autocast():  # the forwards only: log-probs, values and the losses are fp32
        with (torch.no_grad() if critic_only else torch.enable_grad()):
            logprobs, entropy, hidden = forward_response(m.policy_model, mb.rollout, cfg.generation.temperature,
                                                         need_hidden=m.critic_is_head,
                                                         need_entropy=entropy_coef > 0 or mb.from_forward is not None,
                                                         entropy_grad=entropy_coef > 0, options=m.forward)
        values = critic_values(m.critic, mb.rollout, hidden)  # (B, T+1), None without a critic
    if mb.from_forward is not None:  # ppo.old_logprobs auto (tether.ppo.skips): π_old is this forward's policy
        mb.from_forward.record(logprobs, entropy)
        mb = replace(mb, logprobs_old=logprobs.detach())  # ratio 1 exactly, the gradient A_t·∇log π
    loss, stats = None, {}
    if values is not None:
        clip_v = cfg.ppo.clip_range_value or None
        value_loss, value_stats = ppo_value_loss(values[:, :-1], mb.values_old, mb.returns, mask, clip_v)
        loss = cfg.ppo.vf_coef * value_loss
        stats = {"value/loss": value_loss.item(), "value/clip_fraction": value_stats["clip_fraction"].item()}
    if not critic_only:
        # Dr. GRPO: every token term over the micro-batch's rows × max_new_tokens, not its tokens
        normaliser = loss_normaliser(cfg, mb).clamp(min=1) if cfg.advantage.estimator == "dr_grpo" else None

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return masked_mean(x, mask) if normaliser is None else (x * mask).sum() / normaliser

        policy_loss, policy_stats = policy_loss_term(cfg.ppo, logprobs, mb, mask)
        if normaliser is not None:  # the token mean Σ/n_tokens made Σ/normaliser
            policy_loss = policy_loss * mask.sum().clamp(min=1.0) / normaliser
        loss = policy_loss if loss is None else loss + policy_loss
        if entropy_coef > 0:
            loss = loss - entropy_coef * token_mean(entropy)
        if cfg.kl.penalty_in == "loss":
            kl_loss = token_mean(kl_penalty(logprobs, mb.logprobs_ref, "k3", k3_clip=cfg.kl.k3_clip))
            loss = loss + run.optim.kl_controller.value * kl_loss
            stats["policy/kl_loss"] = kl_loss.item()
        stats.update({"policy/loss": policy_loss.item(),
                      **{f"policy/{k}": policy_stats[k].item()
                         for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high")},
                      "policy/approx_kl": policy_stats["approx_kl"].item(),
                      "policy/ratio_mean": policy_stats["ratio_mean"].item(),
                      "policy/ratio_std": policy_stats["ratio_std"].item(),
                      "ratio_max": policy_stats["ratio_max"].item()})
    run.processes.backward(run.optim.scaler.scale(loss * weight))
    return stats


def policy_loss_term(ppo, logprobs: torch.Tensor, mb: Experience, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The policy loss ``ppo.policy_loss`` names (docs/losses.md) on one micro-batch, a token mean over ``mask``
    with the off-policy weights (B19): ``(loss, stats)`` of :mod:`tether.core.losses`. GSPO clips its sequence
    ratio by its own range (``ppo.gspo_clip_range``); the others clip token ratios by ``ppo.clip_range``."""
    args = (logprobs, mb.logprobs_old, mb.advantages, mask)
    if ppo.policy_loss in ("gspo", "gspo_token"):
        return gspo_policy_loss(*args, ppo.gspo_clip_range, weights=mb.is_weights,
                                clip_range_high=ppo.gspo_clip_range_high, token_level=ppo.policy_loss == "gspo_token")
    loss_fn = cispo_policy_loss if ppo.policy_loss == "cispo" else ppo_policy_loss
    return loss_fn(*args, ppo.clip_range, weights=mb.is_weights, clip_range_high=ppo.clip_range_high)


def clip_and_step(optim, cfg, critic_only: bool) -> dict | None:
    """Unscale (fp16), clip each model's gradient norm, step optimisers and schedulers; returns norms and the
    learning rates this update used, or None when a gradient norm is NaN/Inf (B16): then nothing steps, so no
    NaN reaches the weights or Adam's moments, and the fp16 loss scale halves (an overflow of the scaled loss's
    gradients is the expected way to find the largest scale that fits). The norms are of the synchronised
    gradients (under FSDP2 over all processes' shards), so every process makes the same choice.
    ``optim``: :class:`~tether.ppo.setup.Optimisation`."""
    max_norm = cfg.optim.max_grad_norm or float("inf")
    scaler, out = optim.scaler, {}
    if not critic_only:
        scaler.unscale_(optim.policy_optimizer)  # the norm and its clip are of the true gradients
        out["policy/grad_norm"] = grad_norm_value(torch.nn.utils.clip_grad_norm_(optim.policy_params, max_norm))
    if optim.critic_optimizer is not None:
        scaler.unscale_(optim.critic_optimizer)
        out["value/grad_norm"] = grad_norm_value(torch.nn.utils.clip_grad_norm_(optim.critic_params, max_norm))
    if not all(math.isfinite(v) for v in out.values()):
        scaler.update()  # fp16: saw inf, so S /= 2; nothing stepped (the next minibatch zeroes the gradients)
        return None
    if not critic_only:
        # The LR this update applies, read before the scheduler moves on to the next one's.
        out["policy/lr"] = optim.policy_optimizer.param_groups[0]["lr"]
        scaler.step(optim.policy_optimizer)  # finite gradients: a plain optimizer.step()
        optim.policy_scheduler.step()
    if optim.critic_optimizer is not None:
        out["value/lr"] = optim.critic_optimizer.param_groups[0]["lr"]
        scaler.step(optim.critic_optimizer)
    scaler.update()
    if optim.critic_scheduler is not None:
        optim.critic_scheduler.step()
    return out
