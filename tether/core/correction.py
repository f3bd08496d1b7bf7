"""Off-policy correction for the sampler–trainer mismatch (SPEC B19).

The rollout engine draws the tokens from π_engine (vLLM's kernels, a lower precision, or — one step off, C7 — the
weights of one update ago); PPO scores them with the trainer's π_old (B2). The clipped surrogate is an expectation
under π_old, so each token's term is reweighted by the importance ratio

    ρ_t = π_old(a_t|s_t) / π_engine(a_t|s_t) = exp(log π_old − log π_engine)          (B, T)

kept bounded (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training": truncated
importance sampling, TIS; Liu et al. 2025, "When speed kills stability": masked IS, MIS):

- ``tis``: w_t = min(ρ_t, C);
- ``mis``: the same, and every token of a sequence whose mismatch d_i passes ``bound`` gets w_t = 0, with
  d_i = the token mean over the sequence of k3(π_engine, π_old) = (ρ_t − 1) − log ρ_t, an estimate of
  KL(π_engine ‖ π_old) per token (≥ 0: mismatches of either sign add up, none cancel).

The weights are computed once per step, from the frozen π_old, and multiply the surrogate's per-token terms; the
token mean is still over the minibatch's tokens (a masked sequence weighs what a token with no advantage does).
With identical distributions log ρ_t = 0 exactly, so w_t = 1 exactly and the loss is today's to the bit.
"""

from __future__ import annotations

import torch

from tether.core.losses import LOG_RATIO_CLAMP

MODES = ("none", "tis", "mis")


def importance_ratio(logprobs_old: torch.Tensor, logprobs_engine: torch.Tensor) -> torch.Tensor:
    """ρ_t = exp(log π_old − log π_engine), (B, T), the log-ratio clamped to ±20 as the PPO ratio's is."""
    return torch.exp((logprobs_old - logprobs_engine).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def mismatch_kl(logprobs_old: torch.Tensor, logprobs_engine: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_engine ‖ π_old) from tokens the engine sampled, (B, T): (ρ − 1) − log ρ with
    ρ = π_old/π_engine (B5's k3 with the engine in the sampler's place; ≥ 0, 0 where the log-probs agree)."""
    log_ratio = (logprobs_old - logprobs_engine).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(log_ratio) - log_ratio


def sequence_mismatch(logprobs_old: torch.Tensor, logprobs_engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """d_i, (B,): each row's token mean of :func:`mismatch_kl` over its ``mask`` tokens (0 for a row without any)."""
    kl = mismatch_kl(logprobs_old, logprobs_engine) * mask
    return kl.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def correction_weights(logprobs_old: torch.Tensor, logprobs_engine: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float, bound: float) -> torch.Tensor:
    """The per-token weights w_t of the policy loss, (B, T): ``tis`` min(ρ_t, C), ``mis`` the same times
    1[d_i ≤ bound] (see the module docstring); 1 outside ``mask`` (padding, which every loss masks anyway)."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"correction_weights: mode {mode!r}; one of tis, mis")
    weights = importance_ratio(logprobs_old, logprobs_engine).clamp(max=cap)
    if mode == "mis":
        kept = sequence_mismatch(logprobs_old, logprobs_engine, mask) <= bound  # (B,)
        weights = torch.where(kept[:, None], weights, 0.0)
    return torch.where(mask.bool(), weights, 1.0)

