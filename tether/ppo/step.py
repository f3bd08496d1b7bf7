"""Stage B: PPO against a reward, tethered to a frozen reference by a per-token KL penalty.

:func:`ppo_step` is the algorithm, top to bottom in data-flow order (reference 000 §B.3):

  1. rollout: sample responses (B1)                 6. GAE with the truncation bootstrap (B7)
  2. old log-probs, training-side forward (B2)      7. whiten advantages (B8); freeze: the Experience
  3. reference log-probs (B3)                       8. ppo_epochs × shuffled minibatches (B9, B6)
  4. values V_old(s_t) and V_old(s_T)               9. early stop on approx KL to π_old (B10)
  5. scores (B4) → per-token rewards (B5)          10. KL controller (B11)

It reads a :class:`~tether.ppo.setup.Run` (processes, models, optimisation, data) and makes the two
records of :mod:`tether.ppo.records`: the :class:`Rollout` (step 1) and the :class:`Experience` (end of
step 7), which the epoch loop only reads. The run loop around it is :mod:`tether.ppo.train`.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tether.core.advantages import gae, masked_mean, masked_var, shaped_rewards, whiten
from tether.core.kl import kl_penalty
from tether.core.losses import ppo_policy_loss, ppo_value_loss
from tether.core.stats import explained_variance, repetition_counts
from tether.ppo.perf import padding_fraction, step_flops
from tether.ppo.prompts import collate_fields
from tether.ppo.records import Experience, Rollout
from tether.ppo.rollout import critic_values, encode_prompts, forward_response
from tether.ppo.sharding import gathered, grad_norm_value
from tether.ppo.sources import dense_step_rewards, postprocess_scores, score_responses

# The scoring phase's parts (C2); perf/seconds_score is their sum.
SCORE_PHASES = ("logprobs_old", "reference", "values", "reward")


@dataclass
class PhaseTimer:
    """Wall seconds per phase of one step (C2). ``with timer(phase):`` times a block; ``timer.split(part)``
    inside a block charges the seconds since the block began (or the previous split) to ``part``, and a
    block with splits is charged only to its parts (the time after the last split goes to that part)."""

    seconds: dict = field(default_factory=dict)
    _mark: float = 0.0
    _last: str = ""

    @contextmanager
    def __call__(self, phase: str):
        self._mark, self._last = time.perf_counter(), phase
        yield
        self.split(self._last)

    def split(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._mark
        self._mark, self._last = now, part


def rollout_batch(models, cfg, rows: list[dict], greedy: bool = False) -> tuple[Rollout, list[str]]:
    """Encode prompts, sample responses with the run's rollout engine, decode the valid response tokens.
    ``models``: :class:`~tether.ppo.setup.Models`. A sharded policy is gathered once for the whole generation
    (collective: every process calls this). Sampling runs in the precision the log-probs are scored in (B1, C5)."""
    query, query_mask = encode_prompts(models.tokenizer, [r["prompt"] for r in rows], cfg.data.max_prompt_length,
                                       models.use_chat_template, cfg.data.system_prompt, cfg.data.prompt_template)
    g = cfg.generation
    device = models.unwrapped_policy.device
    with gathered(models.unwrapped_policy, models.fsdp), models.precision.autocast():
        rollout = models.engine.generate(query.to(device), query_mask.to(device), g.max_new_tokens, g.temperature,
                                         greedy=greedy, min_new_tokens=0 if greedy else g.min_new_tokens)
    texts = models.tokenizer.batch_decode([row[m.bool()] for row, m in zip(rollout.response, rollout.response_mask)],
                                          skip_special_tokens=True)
    return rollout, texts


@torch.no_grad()
def ppo_step(run, cfg, step: int) -> dict:
    """One PPO step on ``run`` (:class:`~tether.ppo.setup.Run`). Returns the metrics."""
    p, m, o, d = run.processes, run.models, run.optim, run.data
    timer = PhaseTimer()
    rows = d.prompts.next_batch()
    prompts, fields = [r["prompt"] for r in rows], collate_fields(rows)

    # 1. Rollout (B1): an engine holding its own weights takes the current ones first (C3; here, so a resumed
    # run is covered too), then samples with the KV cache until every row ended; EOS vs truncated recorded.
    if m.engine.syncs_weights:
        with timer("weight_sync"):
            m.engine.sync_weights(m.unwrapped_policy)
    with timer("generate"):
        rollout, responses = rollout_batch(m, cfg, rows)
    mask = rollout.response_mask.float()  # (B, T)
    lengths = rollout.lengths  # (B,)

    with timer("score"):  # charged to its parts, SCORE_PHASES (C2)
        # Steps 2-4 compute in the run's precision (C5): policy and reference alike, so that before any update
        # log π_old = log π_ref to the bit and the KL is exactly 0.
        with m.precision.autocast(), scoring_mode(m.fsdp):
            # 2. Old log-probs from the training-side forward (B2): ratio = 1 exactly on the first minibatch.
            logprobs_old, entropy, hidden = forward_response(m.policy_model, rollout, cfg.generation.temperature,
                                                             need_hidden=m.critic_is_head)
            timer.split("logprobs_old")
            # 3. Reference log-probs (B3): the adapter disabled (LoRA) or the frozen twin.
            with m.policy.reference_model(m.policy_model) as reference:
                logprobs_ref, _, _ = forward_response(reference, rollout, cfg.generation.temperature)
            timer.split("reference")
            # 4. Values of s_0 … s_T; V(s_T) bootstraps rows cut by max_new_tokens, 0 after EOS (B7).
            values_all = critic_values(m.critic, rollout, hidden)  # (B, T+1)
        values_old = values_all[:, :-1] * mask
        last_values = values_all[torch.arange(len(rollout), device=p.device), lengths] \
            * (~rollout.ended_with_eos).float()
        timer.split("values")
        # 5. Sequence scores from the reward sources (B4), then per-token rewards r̃_t (B5). A process reward
        # model's step rewards (A9) land on the tokens that end their steps, outside B4's normalisation.
        scores_raw = score_responses(d.sources, prompts, responses, fields, rollout.ended_with_eos).to(p.device)
        step_rewards = dense_step_rewards(d.sources, rollout.response, rollout.response_mask,
                                          m.tokenizer)  # (B, T), zeros without a PRM
        # B16: a row with a non-finite score, log-prob or value leaves this step's update (mask zeroed).
        valid, notes = finite_rows(d.sources, scores_raw, (logprobs_old, logprobs_ref, values_all[:, :-1]), mask)
        mask, logprobs_old, logprobs_ref, entropy, values_old, last_values, scores_raw, step_rewards = zero_rows(
            valid, mask, logprobs_old, logprobs_ref, entropy, values_old, last_values, scores_raw, step_rewards)
        step_totals = step_rewards.sum(dim=1)  # (B,)
        sequence_scores = postprocess_scores(scores_raw - step_totals, lengths, rollout.ended_with_eos, cfg.reward,
                                             d.running_scores, valid, gather=p.all_gather)  # all processes' rows
        kl = kl_penalty(logprobs_old, logprobs_ref, cfg.kl.estimator) * mask  # (B, T)
        rewards = shaped_rewards(sequence_scores, kl, o.kl_controller.value, mask) + step_rewards * mask
        scores = sequence_scores + step_totals  # what each response earned in all (objective/scores)
        # 6. GAE (B7). Returns use the un-whitened advantages.
        advantages, returns = gae(rewards, values_old, mask, cfg.gae.gamma, cfg.gae.lam, last_values)
        # 7. Whitening (B8) over the valid tokens of all ranks; then everything is frozen.
        if cfg.ppo.whiten_advantages:
            advantages = whiten(advantages, mask, distributed=p.world_size > 1)
        timer.split("reward")  # steps 5-7: reward sources, per-token rewards, GAE, whitening
    experience = Experience(rollout=rollout, logprobs_old=logprobs_old, logprobs_ref=logprobs_ref,
                            values_old=values_old, last_values=last_values, scores=scores, kl=kl,
                            rewards=rewards, advantages=advantages, returns=returns, valid=valid)

    # 8.–9. Epochs of shuffled minibatch updates, with the KL early stop (B9, B10).
    with timer("train"), torch.enable_grad():
        if p.global_sum(valid.sum()) > 0:
            train_stats, epochs_run = ppo_epochs(run, cfg, experience, step)
        else:  # every row dropped: no update at all (an optimizer step on zero gradients still moves Adam)
            train_stats, epochs_run = {"health/skipped_updates": 0, "ppo/updates": 0}, 0

    # 10. KL controller (B11) on this step's mean per-token KL to the reference.
    kl_mean = p.global_mean(masked_mean(kl, mask))
    beta_used = o.kl_controller.value
    o.kl_controller.update(kl_mean, n_steps=len(rollout) * p.world_size)

    return {
        **objective_metrics(p, scores, scores_raw, rewards, kl, mask, valid, kl_mean, beta_used),
        **train_stats,
        "policy/entropy": p.global_mean(masked_mean(entropy, mask)),
        **value_metrics(p, values_old, returns, mask),
        **response_metrics(p, rollout),
        **sampler_gap_metrics(p, rollout, logprobs_old, mask),
        **perf_metrics(timer, p.global_sum(lengths.sum().float())),
        **throughput_metrics(p, run.perf, timer, rollout, epochs_run, critic_only=step <= cfg.critic.warmup_steps),
        "ppo/epochs_run": epochs_run,
        "ppo/early_stopped": float(epochs_run < cfg.ppo.epochs),
        "health/dropped_rows": p.global_sum((~valid).sum().float()),
        "health/notes": notes,  # alert lines, popped by the run loop (not a metric)
    }


def scoring_mode(fsdp):
    """The grad mode of the scoring forwards: ``torch.inference_mode`` (12% faster than ``no_grad`` for the 10.7M
    bench policy's 64-row forward, bench/fast_paths.py); what it returns leaves inference mode through the
    functional ops after it (zero_rows, GAE), so the frozen experience holds ordinary tensors the losses may save
    for backward. Under FSDP2 ``no_grad``: its unshard/reshard writes parameter storage that training reuses."""
    return torch.no_grad() if fsdp is not None else torch.inference_mode()


def zero_rows(valid: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor (B, ...) with the rows where ``valid`` (B,) is False set to 0 (a NaN row becomes 0 too)."""
    return tuple(torch.where(valid.view(-1, *[1] * (t.dim() - 1)), t, 0.0) for t in tensors)


def objective_metrics(p, scores, scores_raw, rewards, kl, mask, valid, kl_mean: float, beta: float) -> dict:
    """Scores and KL over the kept rows of all processes (B12); ``beta`` is the coefficient this step used."""
    return {"objective/scores": p.global_mean(masked_mean(scores, valid)),
            "objective/scores_raw": p.global_mean(masked_mean(scores_raw, valid)),
            "objective/rlhf_reward": p.global_mean(masked_mean(rewards.sum(dim=1), valid)),
            "objective/kl": kl_mean,
            "objective/kl_max": p.global_max(kl[mask.bool()].max() if mask.any() else kl.new_zeros(())),
            # the health band's measure: a quantile is a property of the policy, the max grows with B·T
            # (several processes: the largest of their quantiles)
            "objective/kl_p99": p.global_max(kl[mask.bool()].float().quantile(0.99) if mask.any()
                                             else kl.new_zeros(())),
            "objective/kl_sequence": p.global_mean(kl.sum(dim=1).mean()),
            "objective/kl_coef": beta}


def finite_rows(sources: list, scores_raw: torch.Tensor, per_token: tuple, mask: torch.Tensor
                ) -> tuple[torch.Tensor, list[str]]:
    """(B,) bool: rows whose score and whose per-token tensors (on their valid tokens) are all finite (B16),
    and one alert line naming the dropped rows and why (a rule that raised says so)."""
    score_ok = torch.isfinite(scores_raw)
    token_ok = torch.stack([(torch.isfinite(x) | (mask == 0)).all(dim=1) for x in per_token]).all(dim=0)
    valid = score_ok & token_ok
    if valid.all():
        return valid, []
    errors = {}
    for source in sources:
        errors.update({i: f"{source.name} raised {e}" for i, e in getattr(source, "errors", {}).items()})
    reasons = [f"row {i}: " + (errors.get(i) or ("non-finite score" if not score_ok[i] else
                                                 "non-finite log-prob or value"))
               for i in (~valid).nonzero().flatten().tolist()]
    return valid, [f"dropped {len(reasons)} of {len(valid)} rows from the update (" + "; ".join(reasons) + ")"]


def value_metrics(p, values_old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict:
    return {"value/explained_variance": p.global_mean(explained_variance(values_old, returns, mask)),
            "value/mean": p.global_mean(masked_mean(values_old, mask)),
            "value/std": p.global_mean(masked_var(values_old, mask).sqrt()),
            "value/returns_std": p.global_mean(masked_var(returns, mask).sqrt())}


def response_metrics(p, rollout: Rollout) -> dict:
    lengths = rollout.lengths.float()
    repeated, n_grams = repetition_counts(rollout.response, rollout.response_mask, n=3)  # pooled over all rows
    return {"response/length_mean": p.global_mean(lengths.mean()),
            "response/length_min": p.global_min(lengths.min()),
            "response/length_max": p.global_max(lengths.max()),
            "response/truncated_fraction": p.global_mean((~rollout.ended_with_eos).float().mean()),
            "response/repetition": p.global_sum(repeated) / max(p.global_sum(n_grams), 1.0)}


def sampler_gap_metrics(p, rollout: Rollout, logprobs_old: torch.Tensor, mask: torch.Tensor) -> dict:
    """|log π_sampler(a_t) − log π_old(a_t)| over the response tokens, when the engine reports its own log-probs
    (vLLM): how far the distribution the tokens came from is from the one PPO scores (C3). A few 1e-6 in fp32;
    a large gap means the engine is not sampling the trained weights (a missed sync, a leaked sampling option)."""
    if rollout.logprobs_sampler is None:
        return {}
    gap = (rollout.logprobs_sampler - logprobs_old).abs() * mask
    return {"rollout/logprob_gap_mean": p.global_mean(masked_mean(gap, mask)),
            "rollout/logprob_gap_max": p.global_max(gap.max())}


def perf_metrics(timer: PhaseTimer, n_tokens: float) -> dict:
    """Seconds per phase (C2), their sum, tokens per second and the rollout share. Weight sync is 0.0 when
    the sampler reads the trained weights directly (the transformers engine)."""
    s = {phase: timer.seconds.get(phase, 0.0) for phase in ("generate", "weight_sync", *SCORE_PHASES, "train")}
    seconds_score = sum(s[phase] for phase in SCORE_PHASES)
    seconds_step = s["generate"] + s["weight_sync"] + seconds_score + s["train"]
    return {**{f"perf/seconds_{phase}": v for phase, v in s.items()},
            "perf/seconds_score": seconds_score, "perf/seconds_step": seconds_step,
            "perf/tokens_per_second": n_tokens / max(seconds_step, 1e-9),
            "perf/rollout_share": s["generate"] / max(seconds_step, 1e-9)}


def throughput_metrics(p, perf, timer: PhaseTimer, rollout: Rollout, epochs_run: int, critic_only: bool) -> dict:
    """Model FLOPs per second over the device's peak (C6): for the step, generation and training (per device:
    all processes' FLOPs over world size), and the share of computed positions that are padding."""
    flops = step_flops(perf, rollout.query_mask, rollout.lengths, epochs_run, critic_only)
    per_device = {phase: p.global_sum(f) / p.world_size for phase, f in flops.items()}
    seconds = {phase: timer.seconds.get(phase, 0.0) for phase in flops}

    def mfu(total: float, secs: float) -> float:
        return total / (max(secs, 1e-9) * perf.peak)

    return {"perf/mfu": mfu(sum(per_device.values()), sum(timer.seconds.values())),  # over the whole step
            "perf/mfu_generate": mfu(per_device["generate"], seconds["generate"]),
            "perf/mfu_train": mfu(per_device["train"], seconds["train"]),
            "perf/tflops_step": sum(per_device.values()) / 1e12,
            "perf/padding_fraction": p.global_mean(padding_fraction(rollout.query_mask, rollout.response_mask))}


def ppo_epochs(run, cfg, experience: Experience, step: int) -> tuple[dict, int]:
    """ppo.epochs × shuffled minibatches of clipped policy and value updates (B9, B6), with gradient
    accumulation, per-model grad-norm clipping, critic warm-up and the KL early stop (B10)."""
    p, m = run.processes, run.models
    critic_only = step <= cfg.critic.warmup_steps
    sums: dict[str, float] = {}
    counts = skipped = 0
    ratio_max = 0.0
    epochs_run = 0
    # A per-step generator makes the minibatch order independent of everything else (exact resume).
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    micro = cfg.minibatch_size // cfg.ppo.grad_accumulation
    for epoch in range(cfg.ppo.epochs):
        order = torch.randperm(len(experience), generator=g).to(p.device)
        epoch_kl = []
        for start in range(0, len(experience), cfg.minibatch_size):
            minibatch = experience.select(order[start:start + cfg.minibatch_size])
            if cfg.ppo.trim_padding:  # micro-batches of similar lengths: less padding left after trimming
                total = minibatch.rollout.query_mask.sum(dim=1) + minibatch.rollout.lengths
                minibatch = minibatch.select(torch.argsort(total, stable=True))
            # The losses are token means over the minibatch of *all* processes. DDP averages gradients over
            # processes, so a micro-batch weighs (its tokens × world size / all processes' tokens): processes
            # holding more tokens weigh more, exactly as one process with the whole minibatch would.
            n_tokens = max(p.global_sum(minibatch.response_mask.sum()), 1.0) / p.world_size
            run.optim.policy_optimizer.zero_grad(set_to_none=True)
            run.optim.critic_optimizer.zero_grad(set_to_none=True)
            stats_mb: dict[str, float] = {}
            for m0 in range(0, len(minibatch), micro):
                mb = minibatch.select(torch.arange(m0, m0 + micro, device=p.device))
                mb = mb.trimmed() if cfg.ppo.trim_padding else mb
                weight = mb.response_mask.sum() / n_tokens
                with p.no_sync([m.policy_model, m.critic], last=m0 + micro >= len(minibatch)):
                    stats = minibatch_loss(run, cfg, mb, critic_only, weight)
                ratio_max = max(ratio_max, stats.pop("ratio_max", 0.0))
                for k, v in stats.items():
                    stats_mb[k] = stats_mb.get(k, 0.0) + v * weight.item()
            # B16: a NaN loss can still give finite (zero) gradients (clamp passes none through NaN), and
            # Adam would then move the weights on its momentum alone: every process checks its losses.
            finite = float(all(map(math.isfinite, stats_mb.values())))
            losses_ok = p.global_sum(torch.tensor(finite)) == p.world_size
            step_stats = clip_and_step(run.optim, cfg, critic_only) if losses_ok else None
            if step_stats is None:  # non-finite loss or gradient norm: no update, its stats left out of the means
                skipped += 1
                continue
            stats_mb.update(step_stats)
            for k, v in stats_mb.items():
                sums[k] = sums.get(k, 0.0) + v
            counts += 1
            epoch_kl.append(stats_mb.get("policy/approx_kl", 0.0))
        epochs_run += 1
        approx_kl = p.global_mean(torch.tensor(sum(epoch_kl) / max(len(epoch_kl), 1)))
        if cfg.ppo.early_stop and not critic_only and approx_kl > cfg.ppo.early_stop_factor * cfg.kl.target:
            break
    out = {k: p.global_mean(torch.tensor(v / counts)) for k, v in sums.items()}
    out.update({"health/skipped_updates": skipped, "ppo/updates": counts})
    if not critic_only:
        out["policy/ratio_max"] = p.global_max(torch.tensor(ratio_max))
    return out, epochs_run


def minibatch_loss(run, cfg, mb: Experience, critic_only: bool, weight: torch.Tensor) -> dict:
    """Forward one micro-batch, backward ``weight ×`` (−L_CLIP + c1·L_VF − c2·H) (times the fp16 loss scale);
    returns its stats."""
    m = run.models
    mask = mb.response_mask.float()
    with m.precision.autocast():  # the forwards only: log-probs, values and the losses are fp32
        with (torch.no_grad() if critic_only else torch.enable_grad()):
            logprobs, entropy, hidden = forward_response(m.policy_model, mb.rollout, cfg.generation.temperature,
                                                         need_hidden=m.critic_is_head)
        values = critic_values(m.critic, mb.rollout, hidden)[:, :-1]  # (B, T)
    clip_v = cfg.ppo.clip_range_value or None
    value_loss, value_stats = ppo_value_loss(values, mb.values_old, mb.returns, mask, clip_v)
    loss = cfg.ppo.vf_coef * value_loss
    stats = {"value/loss": value_loss.item(), "value/clip_fraction": value_stats["clip_fraction"].item()}
    if not critic_only:
        policy_loss, policy_stats = ppo_policy_loss(logprobs, mb.logprobs_old, mb.advantages, mask,
                                                    cfg.ppo.clip_range)
        entropy_mean = masked_mean(entropy, mask)
        loss = loss + policy_loss - cfg.ppo.entropy_coef * entropy_mean
        stats.update({"policy/loss": policy_loss.item(),
                      "policy/clip_fraction": policy_stats["clip_fraction"].item(),
                      "policy/approx_kl": policy_stats["approx_kl"].item(),
                      "policy/ratio_mean": policy_stats["ratio_mean"].item(),
                      "policy/ratio_std": policy_stats["ratio_std"].item(),
                      "ratio_max": policy_stats["ratio_max"].item()})
    run.processes.backward(run.optim.scaler.scale(loss * weight))
    return stats


def clip_and_step(optim, cfg, critic_only: bool) -> dict | None:
    """Unscale (fp16), clip each model's gradient norm, step optimisers and schedulers; returns norms and LRs,
    or None when a gradient norm is NaN/Inf (B16): then nothing steps, so no NaN reaches the weights or Adam's
    moments, and the fp16 loss scale halves (an overflow of the scaled loss's gradients is the expected way
    to find the largest scale that fits). The norms are of the synchronised gradients (under FSDP2 over all
    processes' shards), so every process makes the same choice. ``optim``: :class:`~tether.ppo.setup.Optimisation`."""
    max_norm = cfg.optim.max_grad_norm or float("inf")
    scaler, out = optim.scaler, {}
    if not critic_only:
        scaler.unscale_(optim.policy_optimizer)  # the norm and its clip are of the true gradients
        out["policy/grad_norm"] = grad_norm_value(torch.nn.utils.clip_grad_norm_(optim.policy_params, max_norm))
    scaler.unscale_(optim.critic_optimizer)
    out["value/grad_norm"] = grad_norm_value(torch.nn.utils.clip_grad_norm_(optim.critic_params, max_norm))
    if not all(math.isfinite(v) for v in out.values()):
        scaler.update()  # fp16: saw inf, so S /= 2; nothing stepped (the next minibatch zeroes the gradients)
        return None
    if not critic_only:
        scaler.step(optim.policy_optimizer)  # finite gradients: a plain optimizer.step()
        optim.policy_scheduler.step()
        out["policy/lr"] = optim.policy_scheduler.get_last_lr()[0]
    scaler.step(optim.critic_optimizer)
    scaler.update()
    optim.critic_scheduler.step()
    out["value/lr"] = optim.critic_scheduler.get_last_lr()[0]
    return out
