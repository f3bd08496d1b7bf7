"""The metrics of one PPO step (SPEC B12, C2, C6), reduced over all processes.

Every mean is over the pooled elements of all processes — tokens for per-token quantities, kept rows for
per-row ones — never a mean of per-process means: with uneven token counts (responses of different lengths
on each process) those differ, and ``objective/kl`` is the KL controller's input.
"""

from __future__ import annotations

import torch

from tether.core.group import group_spread
from tether.core.length import soft_overlong_penalty
from tether.core.stats import quantile, repetition_counts
from tether.ppo.perf import PhaseTimer, padding_fraction, prompt_shares, step_flops
from tether.rollout.records import Rollout
from tether.rollout.weights import SyncSeconds

# The scoring phase's parts (C2); perf/seconds_score is their sum.
SCORE_PHASES = ("logprobs_old", "reference", "values", "reward")


def global_masked_mean(p, x: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ_processes Σ x·m / Σ_processes Σ m: the mean of ``x`` over the valid elements of all processes
    (``mask`` 0/1 or bool, broadcastable to ``x``); 0 when no element is valid. A masked element never enters
    the sum, NaN or not."""
    mask = mask.bool().expand_as(x)
    total = p.global_sum(torch.where(mask, x.double(), 0.0).sum())
    count = p.global_sum(mask.sum().double())
    return total / count if count > 0 else 0.0


def global_masked_var(p, x: torch.Tensor, mask: torch.Tensor) -> float:
    """Population variance of the valid elements of all processes: mean((x − μ)²) with μ the pooled mean
    (two passes, so no cancellation of Σx² − nμ²)."""
    mean = global_masked_mean(p, x, mask)
    return global_masked_mean(p, (x.double() - mean) ** 2, mask)


def global_explained_variance(p, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """EV = 1 − Var[R − V] / Var[R] over the valid tokens of all processes; 0 when Var[R] is 0."""
    var_returns = global_masked_var(p, returns, mask)
    if var_returns == 0.0:
        return 0.0
    return 1.0 - global_masked_var(p, returns - values, mask) / var_returns


def objective_metrics(p, scores, scores_raw, rewards, kl, mask, valid, kl_mean: float, beta: float) -> dict:
    """Scores and KL over the kept rows and tokens of all processes (B12); ``kl_mean`` is the pooled per-token
    KL (the controller's input) and ``beta`` the coefficient this step used. ``kl`` None: the KL was not computed
    (no reference pass, tether.ppo.skips): its keys are left out, not written as 0."""
    tokens = mask.bool()
    out = {"objective/scores": global_masked_mean(p, scores, valid),
            "objective/scores_raw": global_masked_mean(p, scores_raw, valid),
            # 0 = every kept row scored alike: the doctor's flat-reward check (diagnostics.headline)
            "objective/scores_std": global_masked_var(p, scores_raw, valid) ** 0.5,
            "objective/rlhf_reward": global_masked_mean(p, rewards.sum(dim=1), valid),
            "objective/kl_coef": beta}
    if kl is None:
        return out
    return {**out,
            "objective/kl": kl_mean,
            "objective/kl_max": p.global_max(kl[tokens].max() if tokens.any() else kl.new_zeros(())),
            # the health band's measure: a quantile is a property of the policy, the max grows with B·T
            # (several processes: the largest of their quantiles)
            "objective/kl_p99": p.global_max(quantile(kl[tokens].float(), 0.99) if tokens.any()
                                             else kl.new_zeros(())),
            "objective/kl_sequence": global_masked_mean(p, kl.sum(dim=1), valid)}


def value_metrics(p, values_old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict:
    return {"value/explained_variance": global_explained_variance(p, values_old, returns, mask),
            "value/mean": global_masked_mean(p, values_old, mask),
            "value/std": global_masked_var(p, values_old, mask) ** 0.5,
            "value/returns_std": global_masked_var(p, returns, mask) ** 0.5}


def group_metrics(p, scores: torch.Tensor, valid: torch.Tensor, k: int) -> dict:
    """With K ≥ 2 samples per prompt (B17, D1), over the groups of all processes that kept ≥ 2 samples: the share
    whose scores are all equal (no spread: every group baseline gives them advantage 0, no signal), the share of
    those at the step's highest score (solved) and at its lowest (unsolved; both when every score is equal), and
    the mean within-group sample std of the scores. ``scores`` (B,): the scores the estimator sees (B4's penalties,
    normalisation and clip applied: :func:`tether.ppo.draw.estimator_scores`; raw scores tie where these do not,
    and the reverse); ``valid`` (B,) kept rows. {} for K = 1."""
    if k < 2:
        return {}
    g = group_spread(scores, k, valid)
    kept = scores[valid.bool()]
    high = p.global_max(kept.max() if len(kept) else scores.new_tensor(-torch.inf))
    low = p.global_min(kept.min() if len(kept) else scores.new_tensor(torch.inf))
    flat = g["no_spread"]
    n = max(p.global_sum(g["counted"].sum()), 1.0)
    return {"group/no_spread_fraction": p.global_sum(flat.sum()) / n,
            "group/solved_fraction": p.global_sum((flat & (g["high"] >= high)).sum()) / n,
            "group/unsolved_fraction": p.global_sum((flat & (g["low"] <= low)).sum()) / n,
            "group/reward_spread": p.global_sum(g["std"].sum()) / n}


def response_metrics(p, rollout: Rollout) -> dict:
    lengths = rollout.lengths.float()
    every_row = torch.ones_like(lengths, dtype=torch.bool)
    repeated, n_grams = repetition_counts(rollout.response, rollout.response_mask, n=3)  # pooled over all rows
    return {"response/length_mean": global_masked_mean(p, lengths, every_row),
            "response/length_min": p.global_min(lengths.min()),
            "response/length_max": p.global_max(lengths.max()),
            "response/truncated_fraction": global_masked_mean(p, (~rollout.ended_with_eos).float(), every_row),
            "response/repetition": p.global_sum(repeated) / max(p.global_sum(n_grams), 1.0)}


def overlong_metrics(p, rollout: Rollout, max_new_tokens: int, buffer: int, factor: float) -> dict:
    """``--overlong-buffer`` (B4-overlong): the mean over every row of all processes of the soft overlong penalty
    added to the score, and the share of rows past max_new_tokens − buffer (in the buffer: penalised). {} when off."""
    if not buffer:
        return {}
    lengths = rollout.lengths
    every_row = torch.ones_like(lengths, dtype=torch.bool)
    penalty = soft_overlong_penalty(lengths, max_new_tokens, buffer, factor)
    return {"reward/overlong_penalty_mean": global_masked_mean(p, penalty, every_row),
            "reward/overlong_fraction": global_masked_mean(p, (lengths > max_new_tokens - buffer).float(), every_row)}


def truncation_mask_metrics(p, valid: torch.Tensor, loss_rows: torch.Tensor | None) -> dict:
    """``--mask-truncated``: the share of the kept rows (``valid``, all processes) the losses skip (``loss_rows``
    False: cut by max_new_tokens). {} when off (``loss_rows`` None)."""
    if loss_rows is None:
        return {}
    return {"ppo/truncated_masked_fraction": global_masked_mean(p, (~loss_rows).float(), valid)}


def sampler_gap_metrics(p, rollout: Rollout, logprobs_old: torch.Tensor, mask: torch.Tensor) -> dict:
    """|log π_sampler(a_t) − log π_old(a_t)| over the response tokens, when the engine reports its own log-probs
    (vLLM): how far the distribution the tokens came from is from the one PPO scores (C3). A few 1e-6 in fp32;
    a large gap means the engine is not sampling the trained weights (a missed sync, a stale prefix cache, a
    leaked sampling option)."""
    if rollout.logprobs_sampler is None:
        return {}
    tokens = mask.bool()
    gap = torch.where(tokens, (rollout.logprobs_sampler - logprobs_old).abs(), 0.0)
    return {"rollout/logprob_gap_mean": global_masked_mean(p, gap, tokens),
            "rollout/logprob_gap_max": p.global_max(gap.max())}


def perf_metrics(timer: PhaseTimer, generated_tokens: float, kept_tokens: float | None = None,
                 sync: SyncSeconds | None = None) -> dict:
    """Seconds per phase (C2), their sum, token rates and the rollout share. ``generated_tokens``: the response
    tokens generation made this step, every round of ``--filter-groups`` included, all processes (its seconds are
    all in ``perf/seconds_generate``); ``kept_tokens``: those of the rows the step trains on (None: all of them).
    Weight sync is 0.0 when the sampler reads the trained weights directly (the transformers engine); ``sync``
    splits it into gather (waiting for a block's full tensors) and transfer (loading or broadcasting them)."""
    kept_tokens = generated_tokens if kept_tokens is None else kept_tokens
    s = {phase: timer.seconds.get(phase, 0.0) for phase in ("generate", "weight_sync", *SCORE_PHASES, "train")}
    seconds_score = sum(s[phase] for phase in SCORE_PHASES)
    seconds_step = s["generate"] + s["weight_sync"] + seconds_score + s["train"]
    sync = sync or SyncSeconds()
    return {**{f"perf/seconds_{phase}": v for phase, v in s.items()},
            "perf/seconds_weight_gather": sync.gather, "perf/seconds_weight_transfer": sync.transfer,
            "perf/seconds_score": seconds_score, "perf/seconds_step": seconds_step,
            "perf/tokens_per_second": generated_tokens / max(seconds_step, 1e-9),
            "perf/kept_tokens_per_second": kept_tokens / max(seconds_step, 1e-9),
            "perf/rollout_share": s["generate"] / max(seconds_step, 1e-9)}


def throughput_metrics(p, perf, timer: PhaseTimer, rollout: Rollout, epochs_run: int, critic_only: bool,
                       packed: bool = False, generated: tuple[torch.Tensor, torch.Tensor] | None = None,
                       forwards: bool = True, skipped: tuple[str, ...] = ()) -> dict:
    """Model FLOPs per second over the device's peak (C6): for the step, generation and training (per device:
    all processes' FLOPs over world size), and the share of the padded layout's positions that are padding (under
    ``packed`` forwards none of it is computed, and a prompt shared by K rows counts once). ``generated``: (R·B,)
    prompt and response tokens of every row generation made (every ``--filter-groups`` round; None: ``rollout``'s
    rows); ``forwards`` False: the scoring forwards did not run (a step with nothing to train on); ``skipped``: the
    scoring phases the run leaves out (``logprobs_old``, ``reference``: tether.ppo.skips), counted as 0 FLOPs."""
    shares = prompt_shares(rollout.query, rollout.query_mask) if packed else None
    flops = step_flops(perf, rollout.query_mask, rollout.lengths, epochs_run, critic_only, shares, generated)
    if not forwards:
        flops.update(logprobs_old=0.0, reference=0.0, values=0.0)
    flops.update({phase: 0.0 for phase in skipped})
    per_device = {phase: p.global_sum(f) / p.world_size for phase, f in flops.items()}
    seconds = {phase: timer.seconds.get(phase, 0.0) for phase in flops}

    def mfu(total: float, secs: float) -> float:
        return total / (max(secs, 1e-9) * perf.peak)

    return {"perf/mfu": mfu(sum(per_device.values()), sum(timer.seconds.values())),  # over the whole step
            "perf/mfu_generate": mfu(per_device["generate"], seconds["generate"]),
            "perf/mfu_train": mfu(per_device["train"], seconds["train"]),
            "perf/tflops_step": sum(per_device.values()) / 1e12,
            "perf/padding_fraction": p.global_mean(padding_fraction(rollout.query_mask, rollout.response_mask))}
