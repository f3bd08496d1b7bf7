"""Critic-free advantages (tether.core.group, SPEC B17) against values computed by hand: RLOO, GRPO, Dr. GRPO,
REINFORCE++, rewards-to-go, the group-keeping shuffle, the group spread and the group metrics. Three groups of
K = 4 throughout: A = [1, 0, 0, 1], B = [3, 3, 3, 3] (no spread) and C = [2, 0, 4, dropped]."""

import math
import statistics

import pytest
import torch

from tether.core.group import (
    critic_free_advantages,
    dr_grpo_scores,
    group_permutation,
    group_spread,
    grpo_scores,
    returns_to_go,
    rloo_scores,
)

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0, 2.0, 0.0, 4.0, float("nan")])
VALID = torch.tensor([True] * 11 + [False])


def close(x, expected):
    torch.testing.assert_close(x, torch.tensor(expected, dtype=x.dtype), rtol=1e-6, atol=1e-7)


def test_rloo_is_the_score_minus_the_mean_of_the_others():
    # A: a 1 sees others (0 + 0 + 1)/3, a 0 sees (1 + 0 + 1)/3. C (3 kept): 2 - (0+4)/2, 0 - (2+4)/2, 4 - (2+0)/2.
    close(rloo_scores(SCORES, 4, VALID), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 0, -3, 3, 0])


def test_grpo_is_the_group_z_score_with_the_sample_std_and_eps():
    eps = 1e-6
    a = 0.5 / (math.sqrt((4 * 0.25) / 3) + eps)  # A: mean 0.5, sample variance (4 × 0.5²) / 3
    c = 2.0 / (math.sqrt((0 + 4 + 4) / 2) + eps)  # C: mean 2, sample variance (0² + 2² + 2²) / 2 = 4
    close(grpo_scores(SCORES, 4, eps, VALID), [a, -a, -a, a, 0, 0, 0, 0, 0, -c, c, 0])


def test_dr_grpo_is_the_score_minus_the_group_mean_with_no_std():
    close(dr_grpo_scores(SCORES, 4, VALID), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0, -2, 2, 0])


def test_a_group_with_one_kept_sample_has_no_baseline():
    scores, valid = torch.tensor([5.0, 7.0]), torch.tensor([True, False])
    for fn in (rloo_scores, lambda s, k, v: grpo_scores(s, k, 1e-6, v), dr_grpo_scores):
        close(fn(scores, 2, valid), [0.0, 0.0])


@pytest.mark.parametrize("value", [1.3, 1.7, 0.9, 0.3])
@pytest.mark.parametrize("k", [3, 6, 8])
def test_a_group_of_equal_scores_gets_exactly_zero(value, k):
    # k equal float32 scores: their mean (a rounded sum / k) can sit an ulp off the value (8 × 1.3: 1.3000001);
    # GRPO divided that residual by a std of the same size plus eps and credited the tied group ±0.106.
    scores = torch.full((k,), value)
    for name, fn in (("rloo", rloo_scores), ("grpo", lambda s, kk: grpo_scores(s, kk, 1e-6)),
                     ("dr_grpo", dr_grpo_scores)):
        assert torch.equal(fn(scores, k), torch.zeros(k)), name
    # beside a group with signal, that one keeps its baselined scores
    mixed = torch.cat([scores, torch.tensor([1.0, 0.0] * (k // 2) + [1.0] * (k % 2))])
    assert torch.equal(grpo_scores(mixed, k, 1e-6)[:k], torch.zeros(k))
    assert grpo_scores(mixed, k, 1e-6)[k:].abs().min() > 0.3


def test_ties_are_judged_one_way_by_the_estimators_and_the_no_spread_metric():
    """Issue #42: group/no_spread_fraction (and the doctor) called a group flat when max − min ≤ 1e-6·(1 + |max|);
    the estimators zeroed only exact ties. Group 1 [0.5, 0.5, 0.5, 0.5 + 1e-6]: spread 1.01e-6 (float32) ≤ 1.5e-6,
    tied; by hand GRPO gave it (mean 0.50000025, sample std 5.0e-7) −2.5e-7 / (5e-7 + 1e-6) = −0.17 and
    7.6e-7 / 1.5e-6 = +0.5 (the old code, in float32: −0.158 and +0.514; group 3: −0.498, +1.494). Group 2
    [.., 0.5 + 2e-6]: 2.0e-6 > 1.5e-6, signal. At |max| ~ 1000 the tolerance is 1.001e-3: group 3 (spread 4.9e-4)
    tied, group 4 (spread 2.0e-3) not."""
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5 + 1e-6, 0.5, 0.5, 0.5, 0.5 + 2e-6,
                           1000.0, 1000.0, 1000.0, 1000.0005, 1000.0, 1000.0, 1000.0, 1000.002])
    flat = group_spread(scores, 4)["no_spread"].tolist()
    assert flat == [True, False, True, False]
    for name, fn in (("rloo", rloo_scores), ("grpo", lambda s, k: grpo_scores(s, k, 1e-6)),
                     ("dr_grpo", dr_grpo_scores)):
        out = fn(scores, 4).reshape(4, 4)
        assert [bool((row == 0).all()) for row in out] == flat, name  # zero exactly where the metric says flat
    z = grpo_scores(scores, 4, 1e-6).reshape(4, 4)
    assert z[1, 3] > 0.5 and z[3, 3] > 1.0  # the groups with signal keep their z-scores
    from tether.ppo.metrics import group_metrics  # what the doctor's no_spread band reads

    assert group_metrics(OneProcess(), scores, torch.ones(16, dtype=torch.bool), 4)["group/no_spread_fraction"] == 0.5


def test_rows_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        rloo_scores(torch.zeros(6), 4)


def test_returns_to_go_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 9.0]])  # the 9 is padding: masked out
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # γ = 0.5: row 0 G2 = 3, G1 = 2 + 0.5·3, G0 = 1 + 0.5·3.5; row 1 G1 = 1, G0 = 1 + 0.5·1
    close(returns_to_go(rewards, mask, 0.5), [[2.75, 3.5, 3.0], [1.5, 1.0, 0.0]])


KL = torch.tensor([[0.1, 0.2], [0.3, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0]])  # row 1 is one token long


def test_rloo_advantages_with_the_kl_in_the_reward():
    # K = 2, scores [1, 0] -> a = [1, -1]; β = 0.5: row 0 rewards [-0.05, -0.1 + 1], row 1 [-0.15 - 1]
    advantages, returns = critic_free_advantages("rloo", torch.tensor([1.0, 0.0]), KL, 0.5, MASK, k=2)
    close(advantages, [[0.85, 0.9], [-1.15, 0.0]])
    assert torch.equal(advantages, returns)


def test_grpo_with_the_kl_as_a_loss_term_is_one_number_per_row():
    # β = 0 in the reward: every token of a row carries the row's z-score (K = 2: ±1/(sqrt(0.5) + eps))
    advantages, _ = critic_free_advantages("grpo", torch.tensor([1.0, 0.0]), KL, 0.0, MASK, k=2, eps=1e-6)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(advantages, [[z, z], [-z, 0.0]])


def test_reinforce_pp_whitens_the_returns_over_the_batch_tokens():
    advantages, returns = critic_free_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), KL, 0.5, MASK, k=1)
    close(returns, [[0.85, 0.9], [-0.15, 0.0]])  # no baseline on the scores: row 1 keeps its 0
    valid = [0.85, 0.9, -0.15]
    mu, sigma = statistics.fmean(valid), statistics.pstdev(valid)  # population moments of the valid tokens
    expected = [[(0.85 - mu) / sigma, (0.9 - mu) / sigma], [(-0.15 - mu) / sigma, 0.0]]
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_the_group_shuffle_is_the_row_shuffle_at_k_1_and_keeps_groups_together():
    order = group_permutation(10, 1, torch.Generator().manual_seed(5))
    assert torch.equal(order, torch.randperm(10, generator=torch.Generator().manual_seed(5)))  # K = 1: today's
    groups = torch.randperm(4, generator=torch.Generator().manual_seed(5)).tolist()
    order = group_permutation(4, 3, torch.Generator().manual_seed(5)).tolist()
    assert order == [3 * g + i for g in groups for i in range(3)]


def test_group_spread_by_hand():
    g = group_spread(SCORES, 4, VALID)
    close(g["std"], [math.sqrt(1 / 3), 0.0, 2.0])
    assert g["no_spread"].tolist() == [False, True, False]
    assert g["counted"].tolist() == [True, True, True]
    close(g["high"], [1.0, 3.0, 4.0])
    close(g["low"], [0.0, 3.0, 0.0])
    assert group_spread(torch.tensor([1.0, 2.0]), 2, torch.tensor([True, False]))["counted"].tolist() == [False]


class OneProcess:
    """The reductions of tether.ppo.processes.Processes for one process."""

    def global_sum(self, x):
        return float(x)

    global_max = global_min = global_sum


def test_group_metrics_by_hand():
    from tether.ppo.metrics import group_metrics

    # groups: all at the step's top (solved), all at its bottom (unsolved), split [1, 0, 1, 0]
    scores = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0])
    out = group_metrics(OneProcess(), scores, torch.ones(12, dtype=torch.bool), 4)
    assert out["group/no_spread_fraction"] == pytest.approx(2 / 3)
    assert out["group/solved_fraction"] == pytest.approx(1 / 3)
    assert out["group/unsolved_fraction"] == pytest.approx(1 / 3)
    assert out["group/reward_spread"] == pytest.approx(math.sqrt(4 * 0.25 / 3) / 3)
    assert group_metrics(OneProcess(), scores, torch.ones(12, dtype=torch.bool), 1) == {}  # K = 1: no groups
    same = group_metrics(OneProcess(), torch.full((8,), 2.0), torch.ones(8, dtype=torch.bool), 4)
    assert same["group/no_spread_fraction"] == same["group/solved_fraction"] == same["group/unsolved_fraction"] == 1


def group_step(step: int, score: float, flat: float, solved: float, unsolved: float) -> dict:
    return {"step": step, "objective/scores": score, "group/no_spread_fraction": flat,
            "group/solved_fraction": solved, "group/unsolved_fraction": unsolved}


def test_flat_groups_are_read_by_where_they_sit():
    """A 0/1 reward the policy rarely earns (recipe 2's bare SVAMP run): most steps have no right sample at all,
    so every sample of the step is alike (solved = unsolved = no spread = 1); the few steps with one right sample
    score higher. Those all-alike steps sit at the bottom of the run's score range: unsolved, not a constant
    reward. Mirrored (nearly every sample right): solved. A reward that never varies at all: constant."""
    from tether.diagnostics.groups import flat_groups_kind

    rare = [group_step(s, 0.0625, 0.75, 0.0, 0.75) if s % 5 == 0 else group_step(s, 0.0, 1.0, 1.0, 1.0)
            for s in range(1, 41)]
    assert flat_groups_kind(rare) == "unsolved"
    easy = [group_step(s, 0.9375, 0.75, 0.75, 0.0) if s % 5 == 0 else group_step(s, 1.0, 1.0, 1.0, 1.0)
            for s in range(1, 41)]
    assert flat_groups_kind(easy) == "solved"
    constant = [group_step(s, 0.3, 1.0, 1.0, 1.0) for s in range(1, 41)]
    assert flat_groups_kind(constant) == "constant"
    assert flat_groups_kind([{k: v for k, v in r.items() if k != "objective/scores"} for r in rare]) == "constant"
    # steps with spread only: the larger share decides
    assert flat_groups_kind([group_step(s, 0.5, 0.5, 0.1, 0.4) for s in range(1, 5)]) == "unsolved"
    assert flat_groups_kind([group_step(s, 0.5, 0.5, 0.4, 0.1) for s in range(1, 5)]) == "solved"
