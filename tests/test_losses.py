"""PPO and Bradley–Terry losses: the six clip+min regions, ratio = 1, stats, stability."""

import math

import pytest
import torch
import torch.nn.functional as F

from tether import bradley_terry_loss, ppo_policy_loss, ppo_value_loss

EPS = 0.2


def grad_of_policy_loss(ratio: float, advantage: float) -> float:
    """d loss / d log π at one token with log π_old = 0, log π = log ratio."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = ppo_policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), EPS)
    loss.backward()
    return logprobs.grad.item()


# The six regions of reference 000 §3.7: (A sign, ratio) -> gradient present?
REGIONS = [
    (+1.0, 0.5, True),   # A>0, r<1-ε: good action too unlikely, keep pushing
    (+1.0, 1.05, True),  # A>0, r in [1-ε, 1+ε]
    (+1.0, 1.5, False),  # A>0, r>1+ε: brake
    (-1.0, 0.5, False),  # A<0, r<1-ε: brake
    (-1.0, 0.95, True),  # A<0, r in [1-ε, 1+ε]
    (-1.0, 5.0, True),   # A<0, r>1+ε: wrong way, gradient kept by the min
]


@pytest.mark.parametrize("advantage,ratio,has_grad", REGIONS)
def test_gradient_in_each_clip_min_region(advantage, ratio, has_grad):
    g = grad_of_policy_loss(ratio, advantage)
    if has_grad:
        # unclipped branch: loss = -r·A, d/dlogπ = -r·A
        assert g == pytest.approx(-ratio * advantage, rel=1e-6)
    else:
        assert g == 0.0


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 7.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    lp = torch.randn(2, 3)
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv, mask, EPS)
    assert loss.item() == pytest.approx(-(1 - 2 + 3 + 0.5) / 4)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["ratio_std"].item() == pytest.approx(0.0)
    assert stats["approx_kl"].item() == pytest.approx(0.0)


def test_policy_stats_by_hand():
    ratios = torch.tensor([[1.0, 1.5, 0.5, 123.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 123 is padding and must not count
    loss, stats = ppo_policy_loss(ratios.log(), torch.zeros(1, 4), torch.ones(1, 4), mask, EPS)
    valid = torch.tensor([1.0, 1.5, 0.5])
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["ratio_std"].item() == pytest.approx(valid.std(unbiased=False).item())
    k3 = [(r - 1) - math.log(r) for r in (1.0, 1.5, 0.5)]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    # loss = -mean(min(rA, clip(r)A)) with A=1: min(1,1)=1, min(1.5,1.2)=1.2, min(0.5,0.8)=0.5
    assert loss.item() == pytest.approx(-(1.0 + 1.2 + 0.5) / 3, rel=1e-6)


def test_log_ratio_is_clamped_at_plus_minus_20():
    # log ρ = 1000, A = −1: the unclipped term −ρ is the min, so loss = ρ = e^20 exactly when the clamp is ±20
    # (e^1000 would be inf; a clamp at another value gives another number)
    loss, stats = ppo_policy_loss(torch.tensor([[1000.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]),
                                  torch.ones(1, 1), EPS)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    # log ρ = −1000, A = +1: min(ρ·1, 0.8·1) = ρ = e^−20, loss = −e^−20
    loss, _ = ppo_policy_loss(torch.tensor([[-1000.0]]), torch.zeros(1, 1), torch.tensor([[1.0]]),
                              torch.ones(1, 1), EPS)
    assert loss.item() == pytest.approx(-math.exp(-20.0), rel=1e-6)
    # inside the clamp nothing changes: log ρ = 19 gives e^19
    loss, _ = ppo_policy_loss(torch.tensor([[19.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), EPS)
    assert loss.item() == pytest.approx(math.exp(19.0), rel=1e-6)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    values_old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = ppo_value_loss(values, values_old, returns, mask, 0.2)
    # token 0: unclipped (1-0)²=1, clipped (0.2-0)²=0.04 -> max 1 ; token 1: both (0-1)²=1
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert stats["clip_fraction"].item() == 0.0
    # Moving away from a good old value: clipped branch is larger and decides (pessimistic max).
    loss2, stats2 = ppo_value_loss(torch.tensor([[0.5]]), torch.tensor([[1.0]]), torch.tensor([[1.2]]),
                                   torch.ones(1, 1), 0.2)
    # unclipped (0.5-1.2)²=0.49 ; clipped V=0.8 -> (0.8-1.2)²=0.16 ; max=0.49
    assert loss2.item() == pytest.approx(0.5 * 0.49)
    loss3, stats3 = ppo_value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                                   torch.ones(1, 1), 0.2)
    # unclipped 0 ; clipped V=1.2 -> 0.64 ; max = 0.64 and clipping decided it
    assert loss3.item() == pytest.approx(0.5 * 0.64)
    assert stats3["clip_fraction"].item() == 1.0
    loss4, _ = ppo_value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                              torch.ones(1, 1), None)
    assert loss4.item() == 0.0


def test_bradley_terry_by_hand_and_margin():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    expected = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(0.5)) / 2
    assert bradley_terry_loss(c, r).item() == pytest.approx(expected)
    with_margin = -(math.log(1 / (1 + math.exp(-(1.0 - 0.5)))) + math.log(1 / (1 + math.exp(0.5)))) / 2
    assert bradley_terry_loss(c, r, margin=0.5).item() == pytest.approx(with_margin)
    assert bradley_terry_loss(c, r, margin=torch.tensor([0.5, 0.5])).item() == pytest.approx(with_margin)


def test_bradley_terry_shift_invariant_and_finite_at_200():
    c, r = torch.randn(8), torch.randn(8)
    assert bradley_terry_loss(c + 37.0, r + 37.0).item() == pytest.approx(bradley_terry_loss(c, r).item())
    big = bradley_terry_loss(torch.tensor([200.0]), torch.tensor([-200.0]))
    small = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))
    assert big.item() == pytest.approx(0.0, abs=1e-30) and math.isfinite(big.item())
    assert small.item() == pytest.approx(400.0) and math.isfinite(small.item())
    x = torch.tensor([-200.0], requires_grad=True)
    bradley_terry_loss(x, torch.tensor([200.0])).backward()
    assert x.grad.item() == pytest.approx(-1.0)
    assert F.logsigmoid(torch.tensor(-400.0)).item() == pytest.approx(-400.0)
