"""Length control: for reward models (the "longer wins" trap, reference 000 §D), a correlation penalty and a
one-parameter length expert in a product of experts (Shen et al. 2023); for PPO's sequence scores (B4), DAPO's soft
overlong punishment. Pure functions on tensors.
"""

from __future__ import annotations

import torch


def length_penalty(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """corr(s, ℓ)² over the batch's replies: scores (N,), reply lengths in tokens (N,). Zero when no
    length varies; pushes the scores to carry no linear trace of length."""
    s, l = scores - scores.mean(), lengths.float() - lengths.float().mean()
    denom = torch.sqrt((s * s).sum() * (l * l).sum()) + 1e-8
    return ((s * l).sum() / denom) ** 2


def fit_length_expert(log_ratio: torch.Tensor, ridge: float = 1e-3, iterations: int = 50) -> float:
    """The length-only Bradley-Terry model: w = argmax_w sum_i log sigmoid(w * d_i) - ridge/2 * w^2, with
    d_i = log l_chosen - log l_rejected of train pair i (Newton's method; the problem is 1-D and concave;
    the ridge keeps w finite when length separates the pairs)."""
    d = log_ratio.double()
    w = torch.zeros((), dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(-w * d)  # d/dw log sigmoid(w d) = d * sigmoid(-w d)
        grad = (d * p).sum() - ridge * w
        hess = -(d * d * p * (1 - p)).sum() - ridge
        w = w - grad / hess
    return float(w)


def log_length_ratio(reply_tokens_chosen: torch.Tensor, reply_tokens_rejected: torch.Tensor) -> torch.Tensor:
    """log l_c - log l_r per pair, reply lengths in tokens clamped to >= 1 (an empty reply counts as one)."""
    return reply_tokens_chosen.clamp(min=1).float().log() - reply_tokens_rejected.clamp(min=1).float().log()


def length_expert_logit(weight: float, reply_tokens_chosen: torch.Tensor,
                        reply_tokens_rejected: torch.Tensor) -> torch.Tensor:
    """The length expert's share of the pair's logit, w * (log l_c - log l_r). Added to r_c - r_r in
    training only (a product of experts, Shen et al. 2023, with a
    one-parameter expert fitted beforehand by :func:`fit_length_expert`): the length-explained part of a
    preference is carried by w, so the reward model learns the residual, and scoring with r alone is the
    length-controlled preference."""
    return weight * log_length_ratio(reply_tokens_chosen, reply_tokens_rejected)


def soft_overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0
                          ) -> torch.Tensor:
    """B4-overlong, DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``factor`` (veRL's
    ``overlong_buffer.penalty_factor``): with L_max = ``max_new_tokens``, L_cache = ``buffer`` and |y| = ``lengths``
    (B,) response tokens (EOS included),

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = (L_max - L_cache - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    = -1                                 L_max < |y|

    returns factor * R_length (B,) float32, in [-factor, 0], added to the sequence score. A linear ramp from 0 to -1
    over the last L_cache tokens of the budget, so a reply is told it is getting long before it is cut (a cut reply
    gets -1 at |y| = L_max; it can be no longer). TRL's ``get_soft_overlong_punishment`` and veRL's DAPO reward manager
    give the same values (veRL's ramp is not capped at -1 beyond L_max: no sampled reply is longer than L_max).
    ``buffer`` = 0: all zeros (off)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_new_tokens - buffer
    ramp = (start - lengths.float()) / buffer  # > 0 before the buffer, -1 at L_max
    return factor * torch.where(lengths > max_new_tokens, -1.0, ramp.clamp(max=0.0))
