"""The off-policy correction of the sampler–trainer mismatch (SPEC B19): the weights and the mismatch KL against values
worked out by hand and by exact enumeration; the weighted policy loss against a slow loop; and the PPO step: with
identical distributions the weights are exactly 1 and the step is today's to the bit (losses, metrics, weights);
with a planted mismatch the step trains on the hand-computed weights and reports them."""

import math

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.core.correction import correction_weights, importance_ratio, mismatch_kl, sequence_mismatch
from tether.core.losses import ppo_policy_loss

LN2 = math.log(2.0)


def planted():
    """Row 0: π_old = 0.5, 0.2, 0.9 where the engine had 0.25, 0.4, 0.9 (ρ = 2, 0.5, 1), then padding; row 1: the
    same distributions (ρ = 1)."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.5, 0.2, 0.9, 0.3]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.9, 0.01], [0.5, 0.2, 0.9, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    return old, engine, mask


def test_weights_and_mismatch_by_hand():
    old, engine, mask = planted()
    ratio = importance_ratio(old, engine)
    assert torch.allclose(ratio[0, :3], torch.tensor([2.0, 0.5, 1.0]), atol=1e-6)
    # k3 = (ρ − 1) − log ρ: 1 − ln 2, −0.5 + ln 2, 0; row 0's mean over its 3 tokens = 1/6
    k3 = mismatch_kl(old, engine)
    assert torch.allclose(k3[0, :3], torch.tensor([1 - LN2, -0.5 + LN2, 0.0]), atol=1e-6)
    assert torch.allclose(sequence_mismatch(old, engine, mask), torch.tensor([1 / 6, 0.0]), atol=1e-6)
    tis = correction_weights(old, engine, mask, "tis", cap=1.5, bound=0.1)
    assert torch.allclose(tis[0], torch.tensor([1.5, 0.5, 1.0, 1.0]), atol=1e-6)  # capped, kept, exact; padding 1
    assert torch.equal(tis[1], torch.ones(4))  # identical distributions: exactly 1
    masked = correction_weights(old, engine, mask, "mis", cap=1.5, bound=0.1)  # row 0: 1/6 > 0.1, masked
    assert torch.equal(masked[0], torch.tensor([0.0, 0.0, 0.0, 1.0])) and torch.equal(masked[1], torch.ones(4))
    kept = correction_weights(old, engine, mask, "mis", cap=1.5, bound=0.2)
    assert torch.equal(kept, tis)


def test_mismatch_kl_is_unbiased_for_kl_engine_to_old_by_enumeration():
    """E_{a ~ π_engine}[k3] = Σ_a π_e(a)·((π_o/π_e − 1) − log(π_o/π_e)) = KL(π_engine ‖ π_old), exactly (5 tokens)."""
    p_old = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    p_engine = torch.tensor([0.12, 0.18, 0.33, 0.1, 0.27], dtype=torch.float64)
    expected = float((p_engine * (p_engine / p_old).log()).sum())
    got = float((p_engine * mismatch_kl(p_old.log(), p_engine.log())).sum())
    assert got == pytest.approx(expected, rel=1e-12) and expected > 0


def test_weighted_policy_loss_equals_a_slow_loop_and_ones_change_nothing():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 5, requires_grad=True)
    old, adv = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    weights = torch.rand(3, 5) * 2
    loss, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, weights=weights)
    terms = []
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                rho = math.exp(float(logprobs[b, t].detach() - old[b, t]))
                a = float(adv[b, t])
                terms.append(-float(weights[b, t]) * min(rho * a, min(max(rho, 0.8), 1.2) * a))
    assert float(loss.detach()) == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    plain, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    ones, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, weights=torch.ones(3, 5))
    (grad_plain,) = torch.autograd.grad(plain, logprobs)
    (grad_ones,) = torch.autograd.grad(ones, logprobs)
    assert torch.equal(plain, ones) and torch.equal(grad_plain, grad_ones)


def run_steps(tmp_path, name, monkeypatch=None, engine_logprobs=None, steps=2, **overrides):
    """``steps`` PPO steps of the tiny run; ``engine_logprobs(old) -> (B, T)``: the engine's log-probs of each batch,
    made from the trainer's own (computed as the step computes them, so bit for bit its log π_old; the transformers
    engine's are 1e-7 off). Returns the metrics, the experiences the epoch loop got, and the policy's weights."""
    from dataclasses import replace

    import tether.ppo.step as step_module
    from tether.ppo.forward import forward_response
    from tether.ppo.setup import setup

    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    cfg = tiny_config(tmp_path / name, policy, prompts, steps=steps, **overrides)
    seen = []
    if monkeypatch is not None:
        original_sample, original_epochs = step_module.sample_batch, step_module.ppo_epochs

        def sample(run, cfg, step, timer, n=None):
            batch = original_sample(run, cfg, step, timer, n)
            with torch.inference_mode():
                old, _, _ = forward_response(run.models.policy_model, batch.rollout, cfg.generation.temperature)
            planted = engine_logprobs(old.clone()) * batch.rollout.response_mask
            return replace(batch, rollout=replace(batch.rollout, logprobs_sampler=planted))

        def epochs(run, cfg, experience, step):
            seen.append(experience)
            return original_epochs(run, cfg, experience, step)

        monkeypatch.setattr(step_module, "sample_batch", sample)
        monkeypatch.setattr(step_module, "ppo_epochs", epochs)
    run = setup(cfg)
    rows = [step_module.ppo_step(run, cfg, step) for step in range(1, steps + 1)]
    return rows, seen, {k: v.detach().clone() for k, v in run.models.unwrapped_policy.state_dict().items()}


def test_identical_distributions_give_todays_step_to_the_bit(tmp_path, monkeypatch):
    """--rollout-correction tis with the engine's log-probs equal to the trainer's: every weight is exactly 1, and
    two steps give the same metrics (every key today's run has) and the same weights as --rollout-correction none."""
    today, _, weights_today = run_steps(tmp_path, "none")
    rows, seen, weights = run_steps(tmp_path, "tis", monkeypatch, lambda old: old,
                                    correction__mode="tis", correction__cap=1.5)
    assert all(torch.equal(e.is_weights, torch.ones_like(e.is_weights)) for e in seen) and len(seen) == 2
    for a, b in zip(today, rows):
        assert {k: a[k] for k in a if not k.startswith("perf/")} == {k: b[k] for k in a if not k.startswith("perf/")}
        assert b["rollout/mismatch_kl"] == 0.0 and b["rollout/is_weight_max"] == 1.0
    assert all(torch.equal(weights_today[k], weights[k]) for k in weights_today)
    assert "rollout/mismatch_kl" not in today[0]  # the transformers engine reports nothing unless asked


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_planted_mismatch_trains_on_the_hand_computed_weights(tmp_path, monkeypatch, mode):
    """The engine's log-probs planted at the trainer's − ln 2 on every other token (ρ = 2 there, 1 elsewhere): tis
    with C = 1.5 gives those tokens 1.5 and the others exactly 1; mis with a bound below each row's mismatch
    (half its tokens at k3 = 1 − ln 2) masks every row. The metrics say the same."""
    def engine(old):
        shifted = old.clone()
        shifted[:, ::2] -= LN2
        return shifted

    bound = 0.05
    rows, seen, _ = run_steps(tmp_path, mode, monkeypatch, engine, steps=1, correction__mode=mode,
                              correction__cap=1.5, correction__bound=bound)
    e, row = seen[0], rows[0]
    mask = e.response_mask.bool()
    planted_tokens = torch.zeros_like(mask)
    planted_tokens[:, ::2] = True
    expected = torch.where(planted_tokens, 1.5, 1.0)
    rows_mismatch = ((planted_tokens & mask).sum(1) * (1 - LN2)) / mask.sum(1).clamp(min=1)
    if mode == "mis":
        assert (rows_mismatch[mask.any(1)] > bound).all()
        expected = torch.where(mask.any(1, keepdim=True), 0.0, expected)
    assert torch.allclose(e.is_weights[mask], expected[mask], atol=1e-5)
    assert row["rollout/is_weight_max"] == pytest.approx(2.0, rel=1e-5)
    share = float((planted_tokens & mask).sum() / mask.sum())
    assert row["rollout/is_truncated_fraction"] == pytest.approx(share, rel=1e-6)
    assert row["rollout/mismatch_kl"] == pytest.approx(share * (1 - LN2), rel=1e-4)
    assert row["rollout/is_masked_fraction"] == 1.0


def test_the_transformers_engine_reports_its_log_probs_when_the_correction_asks(tmp_path):
    """--rollout-correction tis on the default engine: generate's own log-probs are kept, 1e-6 from the trainer's in
    fp32 (the same weights, a KV-cached computation): weights ≈ 1 and nothing truncated."""
    rows, _, _ = run_steps(tmp_path, "own", steps=1, correction__mode="tis")
    assert 0.0 <= rows[0]["rollout/mismatch_kl"] < 1e-8
    assert rows[0]["rollout/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[0]["rollout/is_truncated_fraction"] == 0.0
