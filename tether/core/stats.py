"""Statistics on tensors and counts: log-probs and entropy from logits, explained variance,
Wilson interval (A4), n-gram repetition, the change of the weights over a step and the share of non-zero
advantages (the doctor's no-op checks). Pure functions; import only torch and math."""

from __future__ import annotations

import math

import torch

from tether.core.advantages import masked_mean, masked_var


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token]: (B, T, V), (B, T) → (B, T), computed in float32 or wider."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    # logsumexp is stable and avoids materialising the full (B, T, V) log-softmax
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: H = logsumexp(z) − Σ softmax(z)·z. (..., V) → (...)."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EV = 1 − Var[R − V] / Var[R] over valid tokens (population variances). 1 is perfect, ≤ 0 means the
    critic explains nothing; NaN-free: returns 0 when Var[R] is 0."""
    var_returns = masked_var(returns, mask)
    if var_returns.item() == 0.0:
        return torch.zeros((), dtype=values.dtype)
    return 1.0 - masked_var(returns - values, mask) / var_returns


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927):

        centre = (p̂ + z²/2n) / (1 + z²/n),  half = z·sqrt(p̂(1−p̂)/n + z²/4n²) / (1 + z²/n).

    ``n = 0`` gives the uninformative (0, 1).
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar test for paired 0/1 outcomes: ``only_a`` pairs where only A is correct,
    ``only_b`` where only B is. Under H0 the discordant pairs split Binomial(n, ½):
    p = min(1, 2·P[X ≤ min(a, b)]), X ~ Bin(a + b, ½). No discordant pairs gives 1."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def repetition_counts(tokens: torch.Tensor, mask: torch.Tensor, n: int = 3) -> tuple[int, int]:
    """(repeated, total) n-grams within responses, pooled over rows: ``repeated`` = Σ_rows (total − distinct).

    ``tokens``, ``mask``: (B, T). Rows shorter than ``n`` contribute nothing."""
    total = repeated = 0
    for row, m in zip(tokens.tolist(), mask.tolist()):
        seq = [t for t, v in zip(row, m) if v]
        grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated, total


def repetition_rate(tokens: torch.Tensor, mask: torch.Tensor, n: int = 3) -> float:
    """Share of repeated n-grams within responses: 1 − distinct/total n-grams, pooled over rows
    (:func:`repetition_counts`); 0 when there are none."""
    repeated, total = repetition_counts(tokens, mask, n)
    return repeated / total if total else 0.0


def squared_change(before: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """Σ_i ‖θ_i^after − θ_i^before‖² over the tensors of ``before`` and ``after`` (paired, same shapes), in float64:
    the square of ``ppo/param_update_norm`` = ‖θ_after − θ_before‖₂ over the trainable parameters. Returned squared
    so that shards (FSDP2: each process holds a slice of every tensor) add before the square root."""
    if len(before) != len(after):
        raise ValueError(f"squared_change: {len(before)} tensors before, {len(after)} after")
    total = torch.zeros((), dtype=torch.float64, device=after[0].device if after else "cpu")
    for b, a in zip(before, after):  # one tensor's difference at a time: no second copy of the whole model
        total += (a.detach().double() - b.detach().to(a.device).double()).pow(2).sum().to(total.device)
    return total


def nonzero_counts(x: torch.Tensor, mask: torch.Tensor, tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ 1[|x| > tol]·m, Σ m) over the valid elements of ``x`` (``mask`` 0/1, broadcastable): their ratio is
    ``advantages/nonzero_fraction``. ``tol`` absorbs the rounding of a score minus its group's mean when every score
    of the group is the same number (0.3 − mean(0.3, 0.3, 0.3) is 5.6e-17, not 0); advantages are in reward units or
    whitened, so a real one is orders of magnitude above it. A NaN counts as non-zero (it is not "no signal")."""
    m = mask.bool().expand_as(x)
    nonzero = ~(x.abs() <= tol)  # NaN: the comparison is False, so it counts
    return (nonzero & m).sum(), m.sum()


__all__ = ["squared_change", "nonzero_counts", "logprobs_from_logits", "entropy_from_logits", "explained_variance", "wilson_interval",
           "mcnemar_exact", "repetition_counts", "repetition_rate", "masked_mean"]


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of the elements of ``x`` (flattened), torch.quantile's default ("linear") definition:
    with the n values sorted, v_(0) ≤ … ≤ v_(n−1), position h = q·(n − 1) and the order statistics around it,

        Q(q) = v_(⌊h⌋) + (h − ⌊h⌋)·(v_(⌈h⌉) − v_(⌊h⌋)).

    Found with two ``torch.kthvalue`` selections (O(n), no sort) instead of torch.quantile, which refuses inputs
    of more than 2^24 elements: one process's step of 1,024 rows × 16k response tokens has that many. The position h
    is computed in float64 (torch.quantile computes it in the input's dtype: in float32 past 2^24 elements it
    cannot even name every rank)."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        raise ValueError("quantile of an empty tensor")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    h = q * (n - 1)
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    v_lo = flat.kthvalue(lo + 1).values
    v_hi = flat.kthvalue(hi + 1).values if hi != lo else v_lo
    return torch.lerp(v_lo, v_hi, torch.tensor(h - lo, dtype=v_lo.dtype, device=v_lo.device))
