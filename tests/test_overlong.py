"""Overlong shaping (#54 item 2): DAPO's soft overlong punishment on the sequence score (B4-overlong) by hand at the
ramp's boundaries, where B4 applies it (the estimator's and the filter's scores), and ``--mask-truncated``: a truncated
row weighs nothing in any loss — one masked row gives exactly the loss and gradients of the batch without it —, a
step with every row truncated skips its update with one alert line, and a tiny CLI run with both flags."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.step as step_module
from tether.cli import main
from tether.core.group import group_spread
from tether.core.length import soft_overlong_penalty
from tether.errors import ConfigError
from tether.ppo.config_rollout import RewardConfig
from tether.ppo.draw import estimator_scores
from tether.ppo.dryrun import launch_checklist
from tether.ppo.setup import setup
from tether.ppo.sources import RewardScores, RunningMoments, postprocess_scores
from tether.ppo.update import loss_normaliser, minibatch_loss


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlong")
    return make_policy_dir(root), make_prompts_file(root)


def slow_soft_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13 as TRL's ``soft_overlong_punishment_reward`` writes it, one reply at a time."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return (l_max - l_cache - length) / l_cache
    return -1.0


def test_soft_overlong_ramp_by_hand_at_its_boundaries():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10 and beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 20])
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert soft_overlong_penalty(lengths, 10, 4).tolist() == expected
    assert soft_overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [x * 0.5 for x in expected]
    assert soft_overlong_penalty(lengths, 10, 0, factor=3.0).tolist() == [0.0] * 9  # off
    # the whole budget as the buffer: -|y| / L_max
    assert soft_overlong_penalty(torch.tensor([0, 5, 10]), 10, 10).tolist() == [0.0, -0.5, -1.0]
    # against the slow transcription, every length and buffer of a small budget
    for l_cache in range(1, 9):
        lengths = torch.arange(0, 12)
        slow = [slow_soft_overlong(n, 8, l_cache) for n in lengths.tolist()]
        torch.testing.assert_close(soft_overlong_penalty(lengths, 8, l_cache), torch.tensor(slow), rtol=0, atol=1e-7)


def test_b4_adds_the_penalty_before_normalisation_and_clip_and_the_filter_sees_it():
    cfg = RewardConfig(overlong_buffer=4, overlong_penalty_factor=2.0, clip=0.0, length_penalty=0.1,
                       missing_eos_penalty=0.5)
    raw = torch.tensor([1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([3, 7, 8, 10])
    eos = torch.tensor([True, True, True, False])
    by_hand = [1 - 0.3, 1 - 0.7 - 2 * 0.25, 1 - 0.8 - 2 * 0.5, 1 - 1.0 - 0.5 - 2 * 1.0]
    got = postprocess_scores(raw, lengths, eos, cfg, max_new_tokens=10)
    torch.testing.assert_close(got, torch.tensor(by_hand), rtol=0, atol=1e-6)
    clipped = postprocess_scores(raw, lengths, eos, replace(cfg, clip=1.0, length_penalty=0.0,
                                                             missing_eos_penalty=0.0), max_new_tokens=10)
    assert clipped.tolist() == [1.0, 0.5, 0.0, -1.0]  # the penalty lands before the clip
    batch = postprocess_scores(raw, lengths, eos, replace(cfg, normalize="batch", length_penalty=0.0,
                                                          missing_eos_penalty=0.0), max_new_tokens=10)
    assert abs(batch.mean().item()) < 1e-6 and batch[0] > batch[1] > batch[2] > batch[3]
    with pytest.raises(ValueError, match="max_new_tokens"):  # L_max forgotten: not silently every row at -1
        postprocess_scores(raw, lengths, eos, cfg)
    # The filter's judge (draw.estimator_scores): one group of K = 4 equal raw scores has spread only through the
    # overlong penalty (lengths 3 and 10 in a budget of 10 with a buffer of 4).
    run = SimpleNamespace(processes=SimpleNamespace(device="cpu", all_gather=lambda x: x),
                          data=SimpleNamespace(running_scores=RunningMoments()))
    rollout = SimpleNamespace(lengths=torch.tensor([3, 3, 10, 10]), ended_with_eos=torch.tensor([True] * 4))
    scores = RewardScores(sequence=torch.ones(4), dense=torch.zeros(4, 10))
    for buffer, spread in ((0, False), (4, True)):
        run_cfg = SimpleNamespace(reward=RewardConfig(overlong_buffer=buffer), generation=SimpleNamespace(
            max_new_tokens=10))
        judged = estimator_scores(run, run_cfg, rollout, scores)
        assert judged.tolist() == ([1.0, 1.0, 0.0, 0.0] if spread else [1.0] * 4)
        assert group_spread(judged, 4)["no_spread"].tolist() == [not spread]  # the tie rule of the filter


def test_overlong_buffer_longer_than_the_budget_is_refused_in_one_line(files, tmp_path):
    with pytest.raises(ConfigError, match=r"^--overlong-buffer: 7 tokens, more than --max-new-tokens 6 \(.*\)$"):
        tiny_config(tmp_path, *files, reward__overlong_buffer=7)
    cfg = tiny_config(tmp_path, *files, reward__overlong_buffer=6)  # the whole budget is allowed: -|y| / L_max
    row = {i.name: i for i in launch_checklist(cfg)}["length penalty"]  # --dry-run's checklist names it
    assert row.ok and row.setting == "soft overlong over the last 6 tokens"
    assert not {i.name: i for i in launch_checklist(tiny_config(tmp_path, *files))}["length penalty"].ok
    # legal settings that do nothing: one warning line each
    assert "--overlong-penalty-factor 0.5: ignored; --overlong-buffer is 0 (off)" in \
        tiny_config(tmp_path, *files, reward__overlong_penalty_factor=0.5).warnings()
    assert "--overlong-buffer 2: no effect with --overlong-penalty-factor 0" in \
        tiny_config(tmp_path, *files, reward__overlong_buffer=2, reward__overlong_penalty_factor=0.0).warnings()
    assert not [w for w in cfg.warnings() if "overlong" in w]


def _experience(files, tmp_path, monkeypatch, **overrides):
    """The step-1 Experience of a tiny run (the epoch loop not run), and the run."""
    cfg = tiny_config(tmp_path, *files, **overrides)
    run = setup(cfg)
    captured = {}

    def capture(run_, cfg_, experience, step):
        captured["e"] = experience
        return {"health/skipped_updates": 0, "ppo/updates": 0}, 0

    monkeypatch.setattr(step_module, "ppo_epochs", capture)
    step_module.ppo_step(run, cfg, 1)
    return run, cfg, captured["e"]


def _loss_and_grads(run, cfg, mb):
    models = [m for m in (run.models.policy_model, run.models.critic) if m is not None]
    for model in models:
        model.zero_grad(set_to_none=True)
    stats = minibatch_loss(run, cfg, mb, critic_only=False, weight=torch.tensor(1.0))
    grads = {f"{i}.{n}": p.grad.clone() for i, model in enumerate(models) for n, p in model.named_parameters()
             if p.grad is not None}
    return stats, grads


@pytest.mark.parametrize("estimator", ["gae", "dr_grpo"])
def test_masked_truncated_rows_give_the_loss_and_gradients_of_the_batch_without_them(files, tmp_path, monkeypatch,
                                                                                     estimator):
    # dr_grpo: the rows x max_new_tokens normaliser, and the KL as a loss term (GRPO's) masked too
    extra = {"advantage__estimator": estimator, "samples_per_prompt": 2, "batch_size": 4,
             "kl__penalty_in": "loss"} if estimator == "dr_grpo" else {}
    run, cfg, e = _experience(files, tmp_path, monkeypatch, generation__max_new_tokens=6, ppo__mask_truncated=True,
                              ppo__entropy_coef=0.01, **extra)
    ended = e.rollout.ended_with_eos
    assert e.loss_rows is not None and torch.equal(e.loss_rows, ended)  # step 7 marks the truncated rows
    assert ended.any() and not ended.all(), "the tiny policy should end some rows with EOS within 6 tokens"
    subset = e.select(ended.nonzero().flatten())
    plain = replace(subset, loss_rows=None)  # the rows that ended, and no masking at all
    assert loss_normaliser(cfg, e) == loss_normaliser(cfg, plain) > 0
    stats_masked, grads_masked = _loss_and_grads(run, cfg, e)
    stats_plain, grads_plain = _loss_and_grads(run, cfg, plain)
    assert stats_masked.keys() == stats_plain.keys() and "policy/loss" in stats_masked
    assert ("value/loss" in stats_masked) == (estimator == "gae")  # the critic's loss skips them too
    assert ("policy/kl_loss" in stats_masked) == (estimator == "dr_grpo")  # and so does the KL loss term
    for key, value in stats_plain.items():
        assert stats_masked[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert grads_masked.keys() == grads_plain.keys() and grads_plain
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_masked[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # unmasked, the truncated rows do weigh: the comparison above can fail
    _, grads_all = _loss_and_grads(run, cfg, replace(e, loss_rows=None))
    assert any(not torch.allclose(grads_all[n], g, rtol=1e-3, atol=1e-6) for n, g in grads_plain.items())


def test_every_row_truncated_skips_the_update_with_one_alert_line(files, tmp_path):
    # EOS is never sampled before 4 tokens and 4 is the budget: every row is cut
    cfg = tiny_config(tmp_path, *files, generation__max_new_tokens=4, generation__min_new_tokens=4,
                      ppo__mask_truncated=True)
    run = setup(cfg)
    before = {n: p.detach().clone() for n, p in run.models.unwrapped_policy.named_parameters()}
    metrics = step_module.ppo_step(run, cfg, 1)
    assert metrics["response/truncated_fraction"] == 1.0 and metrics["ppo/truncated_masked_fraction"] == 1.0
    assert metrics["ppo/updates"] == 0 and metrics["ppo/epochs_run"] == 0
    assert metrics["health/non_finite_stall"] is False  # not B16's stop: nothing was non-finite
    assert [n for n in metrics["health/notes"] if n.startswith("--mask-truncated: every kept row")]
    assert "policy/loss" not in metrics and "objective/scores" in metrics  # the scores still reported
    for n, p in run.models.unwrapped_policy.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    # the same rollout without the flag trains
    cfg_off = tiny_config(tmp_path / "off", *files, generation__max_new_tokens=4, generation__min_new_tokens=4)
    assert step_module.ppo_step(setup(cfg_off), cfg_off, 1)["ppo/updates"] > 0


def test_cli_run_with_both_flags_reports_the_penalty_and_the_masked_fraction(files, tmp_path):
    policy, prompts = files
    out = tmp_path / "run"
    # buffer = the whole budget, so the penalty is -factor * |y| / L_max: its mean is checkable from length_mean
    args = ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--steps", "2", "--batch-size", "8", "--mini-batches", "2",
            "--max-new-tokens", "8", "--progress", "false", "--eval-at-start", "false", "--eval-fraction", "0",
            "--overlong-buffer", "8", "--overlong-penalty-factor", "0.5", "--mask-truncated"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/overlong_penalty_mean"] == pytest.approx(-0.5 * r["response/length_mean"] / 8, abs=1e-6)
        assert r["reward/overlong_fraction"] == 1.0  # every reply has a token, so every reply is in the buffer
        assert r["health/dropped_rows"] == 0
        # every row kept: the scores fed to PPO are the raw ones plus the penalty (char_share is in [0, 1]: no clip)
        assert r["objective/scores"] == pytest.approx(r["objective/scores_raw"] + r["reward/overlong_penalty_mean"],
                                                      abs=1e-5)
        assert r["ppo/truncated_masked_fraction"] == pytest.approx(r["response/truncated_fraction"])
    assert any(0 < r["ppo/truncated_masked_fraction"] < 1 and r["ppo/updates"] > 0 for r in rows)
    config = (out / "config.yaml").read_text()
    assert "overlong_buffer: 8" in config and "mask_truncated: true" in config
