"""Critic-free advantages from K samples per prompt (SPEC B17): a baseline from the other samples of the same
prompt (RLOO, GRPO, Dr. GRPO) or from the whole batch (REINFORCE++). Pure functions on tensors.

Shapes: ``B = G·K`` rows, the K samples of one prompt adjacent (row g·K + k is sample k of group g: the order
``tether.ppo.step`` samples them in); ``T`` response positions; ``mask`` (B, T) is 1 on valid response tokens;
``valid`` (B,) bool is False for a row dropped from the update (B16): it takes no part in its group's statistics
and its baselined score is 0.

The estimators share one structure, OpenRLHF's (``openrlhf/trainer/ppo_utils/experience_maker.py``,
``compute_advantages_and_returns``): the outcome score s_i of each row becomes a baselined score a_i; a_i goes on
the row's last valid token next to the per-token KL rewards −β·KL_t (0 when the KL is a loss term instead); the
advantage of token t is the reward-to-go G_t = Σ_{t' ≥ t} γ^{t'−t} r̃_{t'} (one number per row when β = 0);
REINFORCE++ alone then whitens G over the valid tokens of the batch. No critic, no values, no bootstrap: a row
cut by max_new_tokens is scored as it stands.
"""

from __future__ import annotations

import torch

from tether.core.advantages import shaped_rewards, whiten

ESTIMATORS = ("gae", "rloo", "grpo", "dr_grpo", "reinforce_pp")
GROUP_BASELINES = ("rloo", "grpo", "dr_grpo")  # a baseline from the other samples of the prompt: K ≥ 2
CRITIC_FREE = GROUP_BASELINES + ("reinforce_pp",)


def _grouped(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) → (G, K): the K samples of each prompt on one row."""
    if k < 1 or x.shape[0] % k:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of {k} samples")
    return x.reshape(-1, k)


TIE_RTOL = 1e-6  # a group's kept scores are tied when max − min ≤ TIE_RTOL · (1 + |max|): rounding noise


def tied(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The one tie rule of the estimators, ``group/no_spread_fraction`` and the doctor: a group whose largest and
    smallest kept scores satisfy ``high − low ≤ TIE_RTOL·(1 + |high|)`` has no signal, and every group baseline
    gives it exactly 0. Not exact equality: scores that differ by float rounding (the sum of the same rewards in
    another order, a reward model's batch-dependent kernels) are no signal either, and GRPO divides such a spread by
    a std of the same size plus eps (1e-6), crediting a group the metric calls flat ±0.16 to ±0.48 (issue #42)."""
    return high - low <= TIE_RTOL * (1.0 + high.abs())


def _group_moments(scores: torch.Tensor, k: int, valid: torch.Tensor | None):
    """(s (G, K) with dropped rows 0, keep (G, K) bool, n (G, 1) kept rows, mean (G, 1) over kept rows, 0 if none,
    high, low (G, 1): the largest and smallest kept score, signal (G, 1): not :func:`tied`).

    ``signal`` is also why an exactly tied group's baselined scores are exactly 0: its mean, a rounded sum divided
    by n, can sit an ulp away from the common value (8 × 1.3 in float32), and GRPO would divide that residual by a
    std of the same size plus eps, crediting a group with no signal ±0.1."""
    keep = _grouped(torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool(), k)
    grouped = _grouped(scores, k)
    s = torch.where(keep, grouped, 0.0)
    n = keep.sum(dim=1, keepdim=True).to(scores.dtype)
    high = torch.where(keep, grouped, -torch.inf).amax(dim=1, keepdim=True)
    low = torch.where(keep, grouped, torch.inf).amin(dim=1, keepdim=True)
    return s, keep, n, s.sum(dim=1, keepdim=True) / n.clamp(min=1.0), high, low, ~tied(high, low)


def _group_std(s: torch.Tensor, keep: torch.Tensor, n: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(G, 1) sample std of each group's kept scores, sqrt( Σ_j (s_j − mean)² / (n − 1) ) (0 with n < 2)."""
    return (torch.where(keep, (s - mean) ** 2, 0.0).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1.0)).sqrt()


def rloo_scores(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free"; Ahmadian et al. 2024):
    each sample's baseline is the mean of the other samples of its prompt,

        a_i = s_i − 1/(n−1) · Σ_{j ≠ i} s_j   ( = n/(n−1) · (s_i − s̄) ),

    over the n kept samples of the group (n = K when none was dropped). ``scores`` (B,) → (B,); a group with
    fewer than 2 kept samples has no baseline and gets 0, and so does a group whose kept scores are :func:`tied`."""
    s, keep, n, _, _, _, signal = _group_moments(scores, k, valid)
    others = (s.sum(dim=1, keepdim=True) - s) / (n - 1).clamp(min=1.0)
    return torch.where(keep & (n >= 2) & signal, s - others, 0.0).flatten()


def grpo_scores(scores: torch.Tensor, k: int, eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's outcome supervision (Shao et al. 2024, DeepSeekMath §4.1.2): the group z-score,

        a_i = (s_i − mean_g) / (std_g + eps),   std_g = sqrt( Σ_j (s_j − mean_g)² / (n − 1) ),

    the *sample* standard deviation of the group's n kept scores (``torch.std``'s default, as veRL's
    ``compute_grpo_outcome_advantage`` and OpenRLHF's ``group_norm`` use) and veRL's ``eps`` = 1e-6 (OpenRLHF adds
    1e-9). A group whose kept scores are :func:`tied` gets exactly 0 (not the rounding residual of its mean over
    eps: see ``_group_moments``). ``scores`` (B,) → (B,); fewer than 2 kept: 0."""
    s, keep, n, mean, _, _, signal = _group_moments(scores, k, valid)
    std = _group_std(s, keep, n, mean)
    return torch.where(keep & (n >= 2) & signal, (s - mean) / (std + eps), 0.0).flatten()


def dr_grpo_scores(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): GRPO without the division by the
    group's std, which weights prompts by how (in)consistent their samples are,

        a_i = s_i − mean_g   over the group's kept samples.

    (The other half of Dr. GRPO, a loss normalised by a constant length instead of each response's own, is the
    update's: ``tether.ppo.update``.) ``scores`` (B,) → (B,); a group whose kept scores are :func:`tied`: 0."""
    s, keep, _, mean, _, _, signal = _group_moments(scores, k, valid)
    return torch.where(keep & signal, s - mean, 0.0).flatten()


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} over each row's valid tokens (0 after them): the REINFORCE return of token t.
    ``rewards``, ``mask`` (B, T) → (B, T), zero on invalid positions."""
    mask = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def baselined_scores(estimator: str, scores: torch.Tensor, k: int, eps: float = 1e-6,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """The outcome each row's tokens are credited with: the group baseline of ``estimator`` applied to
    ``scores`` (B,), or the scores themselves for REINFORCE++ (its baseline is the batch whitening)."""
    if estimator == "rloo":
        return rloo_scores(scores, k, valid)
    if estimator == "grpo":
        return grpo_scores(scores, k, eps, valid)
    if estimator == "dr_grpo":
        return dr_grpo_scores(scores, k, valid)
    if estimator == "reinforce_pp":
        return scores if valid is None else torch.where(valid, scores, 0.0)
    raise ValueError(f"unknown critic-free estimator {estimator!r}; choose one of {', '.join(CRITIC_FREE)}")


def critic_free_advantages(estimator: str, scores: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                           mask: torch.Tensor, k: int, gamma: float = 1.0, eps: float = 1e-6,
                           valid: torch.Tensor | None = None, distributed: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages without a critic (B17), (B, T) each:

        a_i = baselined_scores(s)_i                          (RLOO, GRPO, Dr. GRPO; s_i itself for REINFORCE++)
        r̃_t = −β·KL_t + [t = last valid token]·a_i           (β = ``kl_coef``; 0 when the KL is a loss term)
        G_t = Σ_{t' ≥ t} γ^{t'−t} r̃_{t'}                      (:func:`returns_to_go`)
        Â_t = G_t, or for REINFORCE++ (Hu 2025) (G_t − μ)/σ with μ, σ over the valid tokens of the batch
              (all processes' when ``distributed``: :func:`~tether.core.advantages.whiten`)

    ``scores`` (B,) outcome per row, ``kl`` (B, T) per-token KL estimates, ``k`` samples per prompt.
    Returns ``(advantages, returns)``: returns are G_t, before REINFORCE++'s whitening."""
    outcome = baselined_scores(estimator, scores, k, eps, valid)
    returns = returns_to_go(shaped_rewards(outcome, kl, kl_coef, mask), mask, gamma)
    if estimator == "reinforce_pp":
        return whiten(returns, mask, distributed=distributed), returns
    return returns, returns


def group_permutation(n_groups: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A shuffled order of ``n_groups·k`` rows that keeps each group's k rows together and in order: groups are
    permuted, rows follow their group. For k = 1 it is ``torch.randperm(n_groups, generator=generator)`` itself
    (the same draws, the same order)."""
    groups = torch.randperm(n_groups, generator=generator)
    return (groups[:, None] * k + torch.arange(k)).flatten()


def group_spread(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per group (G,): ``std``, the sample std of its kept scores (0 with fewer than 2); ``no_spread``, True when
    its kept scores are :func:`tied` (the estimators' rule): such a group gives every group baseline a_i = 0, no
    signal; ``counted``, True for groups with at least 2 kept samples (the others say nothing); ``high``/``low``,
    its largest and smallest kept score."""
    s, keep, n, mean, high, low, signal = _group_moments(scores, k, valid)
    std = _group_std(s, keep, n, mean).squeeze(1)
    high, low = high.squeeze(1), low.squeeze(1)
    counted = n.squeeze(1) >= 2
    no_spread = counted & ~signal.squeeze(1)
    return {"std": torch.where(counted, std, 0.0), "no_spread": no_spread, "counted": counted,
            "high": high, "low": low}
