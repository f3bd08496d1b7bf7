"""Process rewards (A9): reasoning steps, where their scores land, step losses and aggregations.

A response is a sequence of steps joined by a separator string (``"\\n"`` by default; the demo's step
task uses a space). Step k *ends* at the last character of the separator that follows it; the last step
of a response that does not end with the separator ends at the response's last token (its EOS when it
has one, the last sampled token when it was cut by ``max_new_tokens``). A separator at the very end of
the text closes the last step and adds no empty step after it; an empty step *between* two separators is
a step (it gets a score like any other).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

AGGREGATIONS = ("per_step", "min", "last")


def split_steps(text: str, separator: str) -> tuple[list[str], list[int | None]]:
    """``(steps, ends)``: the steps of ``text`` and, per step, the character index of the last character of
    its separator (None for a last step with no separator after it). ``"46 102 "`` with ``" "`` →
    ``(["46", "102"], [2, 6])``; ``"46  102"`` → ``(["46", "", "102"], [2, 3, None])``; ``""`` → ``([""], [None])``
    (an empty response is one empty step)."""
    if not separator:
        raise ValueError("the step separator must be a non-empty string")
    steps, ends, start = [], [], 0
    while True:
        at = text.find(separator, start)
        if at < 0:
            break
        steps.append(text[start:at])
        ends.append(at + len(separator) - 1)
        start = at + len(separator)
    if start < len(text) or not steps:
        steps.append(text[start:])
        ends.append(None)
    return steps, ends


def step_token_positions(char_ends: Sequence[int | None], token_char_ends: Sequence[int]) -> list[int]:
    """Token index at which each step ends: the first token whose text reaches past the step's end
    character, ``min{j : token_char_ends[j] > e}``; a step with no end (``None``) or one past the decoded
    text lands on the last token. ``token_char_ends[j]`` = length of the text decoded from tokens 0..j
    (non-decreasing; a special token such as EOS adds 0)."""
    n = len(token_char_ends)
    if n == 0:
        raise ValueError("a response with no tokens has no step positions")
    out = []
    for e in char_ends:
        j = n - 1
        if e is not None:
            lo, hi = 0, n - 1  # binary search for the first j with token_char_ends[j] > e
            if token_char_ends[hi] > e:
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if token_char_ends[mid] > e else (mid + 1, hi)
                j = lo
        out.append(j)
    return out


def place_step_rewards(step_rewards: Sequence[Sequence[float]], positions: Sequence[Sequence[int]],
                       shape: tuple[int, int]) -> torch.Tensor:
    """Dense per-token rewards (B, T): r_{b,t} = Σ_k [pos_{b,k} = t] · s_{b,k}. Two steps ending on one token
    (e.g. a separator merged into one token twice) add up."""
    out = torch.zeros(shape, dtype=torch.float32)
    for b, (scores, pos) in enumerate(zip(step_rewards, positions)):
        if len(scores) != len(pos):
            raise ValueError(f"row {b}: {len(scores)} step scores but {len(pos)} positions")
        for s, t in zip(scores, pos):
            out[b, t] += s
    return out


def clipped_step_reward(p_good: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Dense PPO reward of a step from the PRM's probability that it is right (Gao et al. 2024, "On designing
    effective RL reward at training time for LLM reasoning", the *clip* mechanism):

        r_k = min(p_k − η, 0),   η = ``threshold``.

    A good step earns 0 and a doubtful one a penalty, so writing more steps never earns reward (summed raw
    probabilities do: a policy then pads its reasoning with easy steps)."""
    return (p_good - threshold).clamp(max=0.0)


def aggregate_steps(p_good: torch.Tensor, how: str) -> float:
    """One score for a response from its steps' probabilities (K,): ``min`` = min_k p_k (the response is as
    good as its worst step; Lightman et al. 2023 rank solutions so), ``last`` = p_K (ORM-like)."""
    if p_good.numel() == 0:
        raise ValueError("no steps to aggregate")
    if how == "min":
        return float(p_good.min())
    if how == "last":
        return float(p_good[-1])
    raise ValueError(f"aggregation must be 'min' or 'last', got {how!r}")


def step_bce_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-step binary cross-entropy (A9), averaged over the labelled steps of the batch:

        L = −(1 / Σ m) Σ_{b,k} m_{b,k} [y_{b,k} log σ(z_{b,k}) + (1 − y_{b,k}) log(1 − σ(z_{b,k}))].

    ``logits`` z, ``labels`` y ∈ {0, 1} and ``mask`` m: (B, K), padded steps have m = 0."""
    per_step = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    mask = mask.float()
    return (per_step * mask).sum() / mask.sum().clamp(min=1.0)


def first_error(labels: Sequence[int | bool]) -> int:
    """Index of the first bad step, or −1 when every step is good (PRM800K's "first error")."""
    return next((k for k, y in enumerate(labels) if not y), -1)
