"""Losses: Bradley–Terry (A2), PPO clipped surrogate (B9) and clipped value loss (B6), SFT's next-token NLL (S1).

Each PPO loss returns ``(loss, stats)`` with stats detached. Shapes: (B, T) with ``mask`` 1 on valid
response tokens; every mean is a masked token mean over the whole minibatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether.core.advantages import masked_mean

LOG_RATIO_CLAMP = 20.0  # |log π − log π_old| above this is a numerical accident, not a policy update


def bradley_terry_loss(scores_chosen: torch.Tensor, scores_rejected: torch.Tensor,
                       margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Bradley–Terry pairwise loss (A2): L = −mean log σ(r_w − r_l − m).

    ``scores_chosen``, ``scores_rejected``: (B,) scores r(x, y_w), r(x, y_l); ``margin`` m: (B,),
    a float, or ``None`` (0). Uses ``logsigmoid`` so it stays finite at any score difference.
    """
    diff = scores_chosen - scores_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def token_nll(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """SFT's loss on one batch (S1): the mean next-token negative log-likelihood of the labelled tokens,

        L = −(1 / n) Σ_{b,t} m_{b,t+1} · log π(x_{b,t+1} | x_{b,≤t}),   n = Σ_{b,t} m_{b,t+1},

    with ``logits`` (B, T, V) at position t predicting ``labels`` (B, T) at t + 1, and m = 1 where the label is not
    ``ignore_index`` (prompt, template and padding positions are). Computed in fp32 whatever the logits' dtype.
    Returns ``(L, n)``; a step over several batches weights each batch's L by its share n / N of the step's N
    labelled tokens, so that the step's loss is the mean over all of them however they are cut into batches."""
    pred = logits[:, :-1].reshape(-1, logits.shape[-1])  # (B·(T−1), V): position t predicts token t + 1
    target = labels[:, 1:].reshape(-1)  # (B·(T−1),)
    return F.cross_entropy(pred.float(), target, ignore_index=ignore_index), int((target != ignore_index).sum())


def ppo_policy_loss(logprobs: torch.Tensor, logprobs_old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_range: float, weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (B9; Schulman et al. 2017, eq. 7), as a loss to minimise:

        ρ_t = exp(log π(a_t|s_t) − log π_old(a_t|s_t))
        L = masked_mean( −w_t · min(ρ_t·Â_t, clip(ρ_t, 1−ε, 1+ε)·Â_t) )

    ``weights`` w_t (B, T): the off-policy correction's (B19, :mod:`tether.core.correction`), constant; None: no
    weights (w_t = 1). The log-ratio is clamped to ±20 for safety (C5). Stats: ``clip_fraction`` (share of valid
    tokens with |ρ−1| > ε), ``ratio_mean``/``ratio_std``/``ratio_max`` and ``approx_kl``, the k3 estimate
    of KL(π_old‖π) = mean((ρ−1) − log ρ) over valid tokens.
    """
    log_ratio = (logprobs - logprobs_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range) * advantages
    per_token = -torch.min(surrogate, surrogate_clipped)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    with torch.no_grad():
        valid = mask.bool()
        ratio_valid = ratio[valid]
        stats = {
            "clip_fraction": masked_mean(((ratio - 1.0).abs() > clip_range).to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_std": ratio_valid.std(unbiased=False) if ratio_valid.numel() else ratio.new_zeros(()),
            "ratio_max": ratio_valid.max() if ratio_valid.numel() else ratio.new_zeros(()),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def ppo_value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor, clip_range_value: float | None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (B6):

        L_VF = masked_mean( ½·max((V − R)², (clip(V, V_old − ε_v, V_old + ε_v) − R)²) )

    ``clip_range_value=None`` gives the plain ½(V − R)². Stats: ``clip_fraction`` (share of valid
    tokens where the clipped term is the larger one, i.e. clipping decided the loss) and ``error``
    (masked mean of (V − R)²).
    """
    loss_unclipped = (values - returns) ** 2
    if clip_range_value is None:
        loss_max = loss_unclipped
        clipped = torch.zeros_like(values)
    else:
        values_clipped = values_old + torch.clamp(values - values_old, -clip_range_value, clip_range_value)
        loss_clipped = (values_clipped - returns) ** 2
        loss_max = torch.max(loss_unclipped, loss_clipped)
        clipped = (loss_clipped > loss_unclipped).to(values.dtype)
    loss = 0.5 * masked_mean(loss_max, mask)
    stats = {"clip_fraction": masked_mean(clipped, mask), "error": masked_mean(loss_unclipped, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}
