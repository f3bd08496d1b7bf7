"""Ranking quality of scores: the AUC of a scorer that should put one set above another (the reward model's probe
in ``tether rlhf``: its scores of a problem's right replies against its wrong ones)."""

from __future__ import annotations

import torch


def pairwise_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """The probability that a random positive outscores a random negative, ties counting one half (Mann–Whitney):

        AUC = (1 / (P N)) Σ_i Σ_j [ 1(s⁺_i > s⁻_j) + ½ 1(s⁺_i = s⁻_j) ]

    ``positive``: (P,) scores, ``negative``: (N,) scores, both non-empty. 1 = every positive above every negative,
    0.5 = no better than chance."""
    if positive.numel() == 0 or negative.numel() == 0:
        raise ValueError("pairwise_auc: both sets need at least one score")
    diff = positive.reshape(-1, 1).double() - negative.reshape(1, -1).double()  # (P, N)
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
