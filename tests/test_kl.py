"""KL estimators and KL controllers."""

import math

import pytest
import torch

from tether import AdaptiveKLController, FixedKLController, ProportionalKLController, kl_penalty


def test_estimators_by_hand():
    lp, lp_ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    log_r = math.log(0.25 / 0.5)  # log(π_ref/π)
    assert kl_penalty(lp, lp_ref, "k1").item() == pytest.approx(-log_r)  # log π − log π_ref = log 2
    assert kl_penalty(lp, lp_ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(lp, lp_ref, "k3").item() == pytest.approx((0.5 - 1) - log_r)


def test_k1_sign_positive_when_policy_more_confident_than_reference():
    # The policy put more mass on its sampled token than the reference: KL contribution > 0.
    assert kl_penalty(torch.tensor([-0.1]), torch.tensor([-2.0]), "k1").item() > 0


def test_k3_never_negative_and_zero_at_equality():
    g = torch.Generator().manual_seed(1)
    lp, lp_ref = torch.randn(64, 32, generator=g) * 3, torch.randn(64, 32, generator=g) * 3
    assert (kl_penalty(lp, lp_ref, "k3") >= 0).all()
    assert (kl_penalty(lp, lp_ref, "k2") >= 0).all()
    assert kl_penalty(lp, lp.clone(), "k3").abs().max().item() == 0.0


def test_estimators_unbiased_in_expectation():
    # Sample from π over 3 actions: E[k1] = E[k3] = KL(π‖π_ref) exactly (in expectation).
    pi = torch.tensor([0.6, 0.3, 0.1])
    ref = torch.tensor([0.2, 0.5, 0.3])
    true_kl = (pi * (pi / ref).log()).sum().item()
    lp, lp_ref = pi.log(), ref.log()
    for est in ("k1", "k3"):
        expectation = (pi * kl_penalty(lp, lp_ref, est)).sum().item()
        assert expectation == pytest.approx(true_kl, rel=1e-6)


def test_unknown_estimator():
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(10.0, 64)
    assert c.value == 0.05


def test_adaptive_controller_doubling_halving():
    c = AdaptiveKLController(0.1, target=0.01)
    c.update(0.016, 1)  # > 1.5·target
    assert c.value == pytest.approx(0.2)
    c.update(0.006, 1)  # < target/1.5 = 0.00667
    assert c.value == pytest.approx(0.1)
    c.update(0.012, 1)  # between: unchanged
    assert c.value == pytest.approx(0.1)
    c.update(0.015, 1)  # exactly 1.5·target is not above it
    assert c.value == pytest.approx(0.1)


def test_proportional_controller_ziegler():
    c = ProportionalKLController(0.2, target=6.0, horizon=10000)
    c.update(7.5, 256)  # error = clip(7.5/6 - 1) = 0.25 -> 0.2 ; β *= 1 + 0.2*256/10000
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    c = ProportionalKLController(0.2, target=6.0, horizon=10000)
    c.update(5.4, 100)  # error = -0.1
    assert c.value == pytest.approx(0.2 * (1 - 0.1 * 100 / 10000))


def test_controller_state_roundtrip():
    c = AdaptiveKLController(0.1, 0.01)
    c.update(1.0, 1)
    d = AdaptiveKLController(0.1, 0.01)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value == pytest.approx(0.2)


def test_controllers_at_zero_kl_by_hand():
    # KL = 0 (a rollout of the reference itself) is what the step keeps from the controllers (B11): were it given,
    # the adaptive rule would halve β and the proportional one take its lower clip, e = −0.2.
    adaptive, proportional = AdaptiveKLController(0.05, target=0.01), ProportionalKLController(0.05, 0.01, 10000)
    adaptive.update(0.0, 8)
    proportional.update(0.0, 8)
    assert adaptive.value == 0.025
    assert proportional.value == pytest.approx(0.05 * (1 - 0.2 * 8 / 10000))
    boundary = AdaptiveKLController(0.05, target=0.015)
    boundary.update(0.01, 1)  # exactly target/1.5 is not below it: unchanged
    assert boundary.value == 0.05


def test_k3_is_clipped_at_10_by_default_as_verl_and_openrlhf_and_0_turns_it_off():
    """Issue #42: at log(π_ref/π) = 11.9 an unclipped k3 is 1.47e5. Hand values of (r − 1) − log r:
    log r = 11.9 → e^11.9 − 12.9 = 147253.7; 2 → e^2 − 3 = 4.389056; 2.7 → e^2.7 − 3.7 = 11.179733;
    −12 → e^−12 + 11 = 11.0000061. The clip (10) binds for log r > 2.61 or < −11.0."""
    lp = torch.zeros(4)
    log_r = torch.tensor([11.9, 2.0, 2.7, -12.0])
    assert kl_penalty(lp, lp + log_r, "k3").tolist() == pytest.approx([10.0, 4.389056, 10.0, 10.0], rel=1e-6)
    assert kl_penalty(lp, lp + log_r, "k3", k3_clip=0).tolist() == pytest.approx(
        [147253.7252, 4.389056, 11.179733, 11.0000061], rel=1e-6)
    assert kl_penalty(lp, lp + log_r, "k3", k3_clip=5.0).tolist() == pytest.approx([5.0, 4.389056, 5.0, 5.0])
    assert kl_penalty(lp, lp + log_r, "k1").tolist() == pytest.approx([-11.9, -2.0, -2.7, 12.0])  # k1, k2 unclipped
    assert kl_penalty(lp, lp + log_r, "k2")[0].item() == pytest.approx(0.5 * 11.9**2)


def test_a_clipped_k3_token_adds_no_gradient():
    """d k3 / d log π = 1 − r below the clip (log r = 2: 1 − e² = −6.389056), 0 where the clip binds."""
    lp = torch.zeros(2, requires_grad=True)
    kl_penalty(lp, torch.tensor([2.0, 11.9]), "k3").sum().backward()
    assert lp.grad.tolist() == pytest.approx([1 - math.exp(2.0), 0.0], rel=1e-6)
