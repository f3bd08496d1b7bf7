"""Losses: Bradley–Terry (A2), the policy losses — PPO's clipped surrogate (B9) with DAPO's clip-higher, GSPO,
GSPO-token and CISPO (docs/losses.md) — the clipped value loss (B6) and SFT's next-token NLL (S1).

Each PPO loss returns ``(loss, stats)`` with stats detached. Shapes: (B, T) with ``mask`` 1 on valid
response tokens; every mean is a masked token mean over the whole minibatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether.core.advantages import masked_mean

LOG_RATIO_CLAMP = 20.0  # |log π − log π_old| above this is a numerical accident, not a policy update
# ppo.policy_loss's choices (tether.ppo.update.policy_loss_term picks the function)
POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")


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
                    mask: torch.Tensor, clip_range: float, weights: torch.Tensor | None = None,
                    clip_range_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (B9; Schulman et al. 2017, eq. 7), as a loss to minimise, with DAPO's clip-higher
    (Yu et al. 2025, eq. 10: ε_high > ε_low leaves a low-probability token more room to rise):

        ρ_t = exp(log π(a_t|s_t) − log π_old(a_t|s_t))
        L = masked_mean( −w_t · min(ρ_t·Â_t, clip(ρ_t, 1−ε_low, 1+ε_high)·Â_t) )

    ε_low = ``clip_range``, ε_high = ``clip_range_high`` (None: ε_low, the symmetric clip). ``weights`` w_t (B, T):
    the off-policy correction's (B19, :mod:`tether.core.correction`), constant; None: no weights (w_t = 1). The
    log-ratio is clamped to ±20 for safety (C5). Stats (:func:`policy_stats`): ``clip_fraction`` (share of valid
    tokens with ρ outside [1−ε_low, 1+ε_high]; ``clip_fraction_low``/``_high`` below/above), ``ratio_mean``/
    ``ratio_std``/``ratio_max`` and ``approx_kl``, the k3 estimate of KL(π_old‖π) = mean((ρ−1) − log ρ).
    """
    high = clip_range if clip_range_high is None else clip_range_high
    log_ratio = (logprobs - logprobs_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1.0 - clip_range, 1.0 + high) * advantages)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    return loss, policy_stats(log_ratio, ratio, mask, clip_range, high)


def policy_stats(log_ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> dict:
    """The stats every policy loss reports, detached, each a masked token mean unless said: ``clip_fraction_low``
    / ``clip_fraction_high``, the share of valid tokens whose ``clipped`` ratio (B, T) — the one the loss clips: ρ_t,
    or GSPO's s_i on each token of row i — is below 1 − ``low`` / above 1 + ``high``, and ``clip_fraction`` their
    sum; ``ratio_mean``, ``ratio_std`` (population), ``ratio_max`` (over valid tokens) of the per-token ρ_t =
    exp(``log_ratio``), and ``approx_kl`` = mean((ρ−1) − log ρ), the k3 estimate of KL(π_old‖π) the early stop
    reads (B10) — per token whatever the loss, so those keep one meaning across ``ppo.policy_loss``."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        valid = mask.bool()
        ratio_valid = ratio[valid]
        below = masked_mean((clipped < 1.0 - low).to(ratio.dtype), mask)
        above = masked_mean((clipped > 1.0 + high).to(ratio.dtype), mask)
        stats = {
            "clip_fraction": below + above, "clip_fraction_low": below, "clip_fraction_high": above,
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_std": ratio_valid.std(unbiased=False) if ratio_valid.numel() else ratio.new_zeros(()),
            "ratio_max": ratio_valid.max() if ratio_valid.numel() else ratio.new_zeros(()),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return {k: v.detach() for k, v in stats.items()}


def sequence_log_ratio(logprobs: torch.Tensor, logprobs_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence log-ratio (Zheng et al. 2025, eq. 7), (B,): log s_i = (1/|y_i|) Σ_t log(π(y_i,t)/π_old(y_i,t))
    over row i's valid tokens (|y_i| of them; 0 for a row with none), each token's log-ratio clamped to ±20 first.
    s_i is the geometric mean of the token ratios: a length-normalised likelihood ratio of the whole response."""
    log_ratio = (logprobs - logprobs_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def gspo_policy_loss(logprobs: torch.Tensor, logprobs_old: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_range: float, weights: torch.Tensor | None = None,
                     clip_range_high: float | None = None, token_level: bool = False) -> tuple[torch.Tensor, dict]:
    """GSPO, group sequence policy optimisation (Zheng et al. 2025, eqs. 5–7 and 13–14), as a loss to minimise:

        s_i = exp( (1/|y_i|) Σ_t log(π(y_i,t)/π_old(y_i,t)) )                     (:func:`sequence_log_ratio`)
        A_i = (1/|y_i|) Σ_t Â_i,t     (the row's advantage; a critic-free estimator gives every token of a row it)
        GSPO:        ℓ_i,t = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)        the same on every token of row i
        GSPO-token:  s_i,t = sg[s_i] · π(y_i,t) / sg[π(y_i,t)]                       (sg: stop-gradient)
                     ℓ_i,t = −min(s_i,t·Â_i,t, clip(s_i,t, 1−ε_low, 1+ε_high)·Â_i,t)
        L = masked_mean( w_t · ℓ_i,t )

    ``token_level`` picks GSPO-token. s_i,t has the value s_i, so with Â_i,t = A_i both give the same loss and the
    same gradient (the paper's remark after eq. 14); they part when the advantage varies along the row (GAE):
    GSPO's gradient on token t is −s_i·A_i/N·∇log π(y_i,t), GSPO-token's −s_i·Â_i,t/N·∇log π(y_i,t) (unclipped;
    N = the valid tokens of the minibatch). ε_low = ``clip_range``, ε_high = ``clip_range_high`` (None: ε_low): a
    sequence ratio sits far closer to 1 than a token's, so its range is small (the paper: 3e-4 and 4e-4).
    Deviation from the paper, which averages ℓ_i over sequences (1/G Σ_i): the token mean L weighs row i by its
    length |y_i|, tether's convention for every policy loss (DAPO's token-level mean; veRL's GSPO takes the
    sequence mean of token means, TRL's ``loss_type`` decides it; docs/losses.md). Stats: :func:`policy_stats`
    with the clip fractions of s_i (a token counts when its row's ratio is clipped).
    """
    high = clip_range if clip_range_high is None else clip_range_high
    log_ratio = (logprobs - logprobs_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    log_s = sequence_log_ratio(logprobs, logprobs_old, mask)[:, None]  # (B, 1)
    if token_level:
        ratio = torch.exp(log_s.detach() + logprobs - logprobs.detach())  # (B, T): value s_i, gradient per token
        adv = advantages
    else:
        ratio = torch.exp(log_s).expand_as(logprobs)  # (B, T): s_i on each token of row i
        adv = ((advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))[:, None]  # (B, 1): A_i
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_range, 1.0 + high) * adv)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    return loss, policy_stats(log_ratio, ratio, mask, clip_range, high)


def cispo_policy_loss(logprobs: torch.Tensor, logprobs_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_range: float, weights: torch.Tensor | None = None,
                      clip_range_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """CISPO, clipped importance-sampling policy optimisation (MiniMax-M1, 2025, eq. 4), as a loss to minimise:

        ρ_t = exp(log π(a_t|s_t) − log π_old(a_t|s_t))
        L = masked_mean( −w_t · sg[clip(ρ_t, 1−ε_low, 1+ε_high)] · Â_t · log π(a_t|s_t) )

    The importance weight is clipped and held constant (sg: stop-gradient), so every token keeps a gradient
    sg[·]·Â_t·∇log π — PPO's clip would zero a clipped token's — and the update is REINFORCE weighted by a bounded
    ratio. ε_low = ``clip_range``, ε_high = ``clip_range_high`` (None: ε_low). MiniMax-M1 tunes ε_high and leaves
    no lower bound (ε_low ≥ 1); TRL's ``loss_type='cispo'`` clips at ``epsilon_high`` itself (min(ρ, ε_max), no
    lower bound), veRL's as here (docs/losses.md). Stats: :func:`policy_stats` on ρ_t."""
    high = clip_range if clip_range_high is None else clip_range_high
    log_ratio = (logprobs - logprobs_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    is_weight = torch.clamp(ratio, 1.0 - clip_range, 1.0 + high).detach()
    per_token = -is_weight * advantages * logprobs
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    return loss, policy_stats(log_ratio, ratio, mask, clip_range, high)


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
