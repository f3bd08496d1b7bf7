"""Stage B: PPO against a reward, tethered to a frozen reference by a per-token KL penalty.

:func:`ppo_step` is the algorithm, top to bottom in data-flow order (reference 000 §B.3):

  1. rollout: sample responses (B1)                 6. GAE with the truncation bootstrap (B7)
  2. old log-probs, training-side forward (B2)      7. whiten advantages (B8); freeze everything
  3. reference log-probs (B3)                       8. ppo_epochs × shuffled minibatches (B9, B6)
  4. values V_old(s_t) and V_old(s_T)               9. early stop on approx KL to π_old (B10)
  5. scores (B4) → per-token rewards (B5)          10. KL controller (B11)

:func:`train` sets up the components, runs the steps, evaluates (B13), checkpoints (B14), watches the
health bands (D3) and writes ``metrics.jsonl`` (B12; keys defined in docs/metrics.md).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tether.advantages import gae, masked_mean, masked_var, shaped_rewards, whiten
from tether.kl import kl_penalty
from tether.losses import ppo_policy_loss, ppo_value_loss
from tether.prompts import collate_fields
from tether.rewards import postprocess_scores, score_responses
from tether.rollout import Rollout, critic_values, encode_prompts, forward_response, generate
from tether.stats import explained_variance, repetition_rate


@dataclass
class PhaseTimer:
    """Wall seconds per phase of one step (C2)."""

    seconds: dict = field(default_factory=dict)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def rollout_batch(c, cfg, rows: list[dict], greedy: bool = False) -> tuple[Rollout, list[str]]:
    """Encode prompts, sample responses with the (unwrapped) policy, decode the valid response tokens."""
    query, query_mask = encode_prompts(c.tokenizer, [r["prompt"] for r in rows], cfg.data.max_prompt_length,
                                       c.use_chat_template, cfg.data.system_prompt, cfg.data.prompt_template)
    g = cfg.generation
    batch = generate(c.unwrapped_policy, c.tokenizer, query.to(c.device), query_mask.to(c.device),
                     g.max_new_tokens, g.temperature, g.top_p, g.top_k, greedy=greedy,
                     min_new_tokens=0 if greedy else g.min_new_tokens)
    texts = c.tokenizer.batch_decode([row[m.bool()] for row, m in zip(batch.response, batch.response_mask)],
                                     skip_special_tokens=True)
    return batch, texts


@torch.no_grad()
def ppo_step(c, cfg, step: int) -> dict:
    """One PPO step; ``c`` holds the components (see :func:`tether.ppo_setup.setup`). Returns the metrics."""
    timer = PhaseTimer()
    rows = c.prompts.next_batch()
    prompts, fields = [r["prompt"] for r in rows], collate_fields(rows)

    # 1. Rollout (B1): sample with the KV cache, stop when every row has ended; EOS vs truncated recorded.
    with timer("generate"):
        batch, responses = rollout_batch(c, cfg, rows)
    mask = batch.response_mask.float()  # (B, T)
    lengths = batch.response_mask.sum(dim=1)  # (B,)

    with timer("score"):
        # 2. Old log-probs from the training-side forward (B2): ratio = 1 exactly on the first minibatch.
        logprobs_old, entropy, hidden = forward_response(c.policy_model, batch, cfg.generation.temperature,
                                                         need_hidden=c.critic_is_head)
        # 3. Reference log-probs (B3): the adapter disabled (LoRA) or the frozen copy.
        with c.policy.reference_model(c.policy_model) as reference:
            logprobs_ref, _, _ = forward_response(reference, batch, cfg.generation.temperature)
        # 4. Values of s_0 … s_T; V(s_T) bootstraps rows cut by max_new_tokens, 0 after EOS (B7).
        values_all = critic_values(c.critic, batch, hidden)  # (B, T+1)
        values_old = values_all[:, :-1] * mask
        rows_index = torch.arange(len(batch), device=c.device)
        last_values = values_all[rows_index, lengths] * (~batch.ended_with_eos).float()
        # 5. Sequence scores from the reward sources (B4), then per-token rewards r̃_t (B5).
        scores_raw = score_responses(c.sources, prompts, responses, fields).to(c.device)
        scores = postprocess_scores(scores_raw, lengths, batch.ended_with_eos, cfg.reward, c.running_scores)
        kl = kl_penalty(logprobs_old, logprobs_ref, cfg.kl.estimator) * mask  # (B, T)
        rewards = shaped_rewards(scores, kl, c.kl_controller.value, mask)
        # 6. GAE (B7). Returns use the un-whitened advantages.
        advantages, returns = gae(rewards, values_old, mask, cfg.gae.gamma, cfg.gae.lam, last_values)
        # 7. Whitening (B8) over the valid tokens of all ranks; then everything is frozen.
        if cfg.ppo.whiten_advantages:
            advantages = whiten(advantages, mask, distributed=c.world_size > 1)
    batch = replace(batch, logprobs_old=logprobs_old, logprobs_ref=logprobs_ref, values_old=values_old,
                    last_values=last_values, scores=scores, kl=kl, rewards=rewards,
                    advantages=advantages, returns=returns)

    # 8.–9. Epochs of shuffled minibatch updates, with the KL early stop (B9, B10).
    with timer("train"), torch.enable_grad():
        train_stats, epochs_run = ppo_epochs(c, cfg, batch, step)

    # 10. KL controller (B11) on this step's mean per-token KL to the reference.
    kl_mean = c.global_mean(masked_mean(kl, mask))
    beta_used = c.kl_controller.value
    c.kl_controller.update(kl_mean, n_steps=len(batch) * c.world_size)

    seconds_step = sum(timer.seconds.values())
    n_tokens = c.global_sum(lengths.sum().float())
    return {
        "objective/scores": c.global_mean(scores.mean()),
        "objective/scores_raw": c.global_mean(scores_raw.mean()),
        "objective/rlhf_reward": c.global_mean(rewards.sum(dim=1).mean()),
        "objective/kl": kl_mean,
        "objective/kl_max": c.global_max(kl[mask.bool()].max() if mask.any() else kl.new_zeros(())),
        # the health band's measure: a quantile is a property of the policy, the max grows with B·T
        "objective/kl_p99": c.global_max(kl[mask.bool()].float().quantile(0.99) if mask.any() else kl.new_zeros(())),
        "objective/kl_sequence": c.global_mean(kl.sum(dim=1).mean()),
        "objective/kl_coef": beta_used,
        **train_stats,
        "policy/entropy": c.global_mean(masked_mean(entropy, mask)),
        "value/explained_variance": c.global_mean(explained_variance(values_old, returns, mask)),
        "value/mean": c.global_mean(masked_mean(values_old, mask)),
        "value/std": c.global_mean(masked_var(values_old, mask).sqrt()),
        "value/returns_std": c.global_mean(masked_var(returns, mask).sqrt()),
        "response/length_mean": c.global_mean(lengths.float().mean()),
        "response/length_min": c.global_min(lengths.min().float()),
        "response/length_max": c.global_max(lengths.max().float()),
        "response/truncated_fraction": c.global_mean((~batch.ended_with_eos).float().mean()),
        "response/repetition": repetition_rate(batch.response, batch.response_mask, n=3),
        "perf/seconds_generate": timer.seconds["generate"],
        "perf/seconds_score": timer.seconds["score"],
        "perf/seconds_train": timer.seconds["train"],
        "perf/seconds_step": seconds_step,
        "perf/tokens_per_second": n_tokens / max(seconds_step, 1e-9),
        "perf/rollout_share": timer.seconds["generate"] / max(seconds_step, 1e-9),
        "ppo/epochs_run": epochs_run,
        "ppo/early_stopped": float(epochs_run < cfg.ppo.epochs),
    }


def ppo_epochs(c, cfg, batch: Rollout, step: int) -> tuple[dict, int]:
    """ppo.epochs × shuffled minibatches of clipped policy and value updates (B9, B6), with gradient
    accumulation, per-model grad-norm clipping, critic warm-up and the KL early stop (B10)."""
    critic_only = step <= cfg.critic.warmup_steps
    sums: dict[str, float] = {}
    counts = 0
    ratio_max = 0.0
    epochs_run = 0
    # A per-step generator makes the minibatch order independent of everything else (exact resume).
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    micro = cfg.minibatch_size // cfg.ppo.grad_accumulation
    for epoch in range(cfg.ppo.epochs):
        order = torch.randperm(len(batch), generator=g).to(c.device)
        epoch_kl = []
        for start in range(0, len(batch), cfg.minibatch_size):
            minibatch = batch.select(order[start:start + cfg.minibatch_size])
            n_tokens = minibatch.response_mask.sum().clamp(min=1)
            c.policy_optimizer.zero_grad(set_to_none=True)
            c.critic_optimizer.zero_grad(set_to_none=True)
            stats_mb: dict[str, float] = {}
            for m0 in range(0, len(minibatch), micro):
                mb = minibatch.select(torch.arange(m0, m0 + micro, device=c.device))
                # Losses are token means over the whole minibatch: weight each micro-batch by its tokens.
                weight = mb.response_mask.sum() / n_tokens
                with c.no_sync(last=m0 + micro >= len(minibatch)):
                    stats = minibatch_loss(c, cfg, mb, critic_only, weight)
                ratio_max = max(ratio_max, stats.pop("ratio_max", 0.0))
                for k, v in stats.items():
                    stats_mb[k] = stats_mb.get(k, 0.0) + v * weight.item()
            stats_mb.update(clip_and_step(c, cfg, critic_only))
            for k, v in stats_mb.items():
                sums[k] = sums.get(k, 0.0) + v
            counts += 1
            epoch_kl.append(stats_mb.get("policy/approx_kl", 0.0))
        epochs_run += 1
        approx_kl = c.global_mean(torch.tensor(sum(epoch_kl) / len(epoch_kl)))
        if cfg.ppo.early_stop and not critic_only and approx_kl > cfg.ppo.early_stop_factor * cfg.kl.target:
            break
    out = {k: c.global_mean(torch.tensor(v / counts)) for k, v in sums.items()}
    if not critic_only:
        out["policy/ratio_max"] = c.global_max(torch.tensor(ratio_max))
    return out, epochs_run


def minibatch_loss(c, cfg, mb: Rollout, critic_only: bool, weight: torch.Tensor) -> dict:
    """Forward one micro-batch, backward ``weight ×`` (−L_CLIP + c1·L_VF − c2·H); returns its stats."""
    mask = mb.response_mask.float()
    with (torch.no_grad() if critic_only else torch.enable_grad()):
        logprobs, entropy, hidden = forward_response(c.policy_model, mb, cfg.generation.temperature,
                                                     need_hidden=c.critic_is_head)
    values = critic_values(c.critic, mb, hidden)[:, :-1]  # (B, T)
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
    c.backward(loss * weight)
    return stats


def clip_and_step(c, cfg, critic_only: bool) -> dict:
    """Clip each model's gradient norm, step optimisers and schedulers; returns norms and LRs."""
    max_norm = cfg.optim.max_grad_norm or float("inf")
    out = {}
    if not critic_only:
        out["policy/grad_norm"] = float(c.clip_grad_norm(c.policy_params, max_norm))
        c.policy_optimizer.step()
        c.policy_scheduler.step()
        out["policy/lr"] = c.policy_scheduler.get_last_lr()[0]
    out["value/grad_norm"] = float(c.clip_grad_norm(c.critic_params, max_norm))
    c.critic_optimizer.step()
    c.critic_scheduler.step()
    out["value/lr"] = c.critic_scheduler.get_last_lr()[0]
    return out


def write_jsonl(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
