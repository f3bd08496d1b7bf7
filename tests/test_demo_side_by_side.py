"""The demo's two PPO runs side by side (one process each) give the same numbers as one after the other."""

import dataclasses
import json

import pytest
import torch

from tether.demo.pipeline import QUICK, run_demo_ppo, train_demo_rm, write_prompts
from tether.demo.side_by_side import log_path, run_side_by_side
from tether.demo.task import build_policy, build_tokenizer, split_problems
from tether.errors import TetherError

TINY = dataclasses.replace(QUICK, ppo_steps=2, ppo_batch=16, ppo_epochs=1, eval_every=2, eval_n=16, rm_epochs=1)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """An SFT folder (a random tiny policy), a reward model trained on gold-labelled pairs, prompt files."""
    out = tmp_path_factory.mktemp("side")
    tokenizer = build_tokenizer(out / "sft")
    build_policy(tokenizer, seed=0, n_layer=1, n_embd=32, n_head=2).save_pretrained(out / "sft")
    build_policy(tokenizer, seed=1, n_layer=1, n_embd=32, n_head=2).save_pretrained(out / "rm_backbone")
    build_tokenizer(out / "rm_backbone", eos_after_text=True)
    train, held_out = split_problems(0, 200, 16, digits=2)
    pairs = [{"prompt": p["prompt"], "chosen": p["answer"], "rejected": p["answer"][::-1] + "1"} for p in train[:80]]
    train_demo_rm(out, pairs, TINY, seed=0)
    return out, write_prompts(out / "train.jsonl", train), write_prompts(out / "held.jsonl", held_out)


def final_state(run_dir):
    from safetensors.torch import load_file

    weights = load_file(run_dir / "policy" / "model.safetensors")
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return weights, rows


@pytest.mark.slow
def test_side_by_side_runs_repeat_the_in_process_runs_bit_for_bit(artifacts, tmp_path):
    out, prompts, held = artifacts
    jobs = [(tmp_path / name, out, prompts, held, beta, TINY, 3) for name, beta in (("ppo_b", 0.2), ("ppo_0", 0.0))]
    side = [(tmp_path / "side" / job[0].name, *job[1:]) for job in jobs]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # what the side-by-side processes run with
    try:
        for job in jobs:
            run_demo_ppo(*job)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (tmp_path / "side").mkdir()
    run_side_by_side(run_demo_ppo, side, TINY.ppo_steps, poll_seconds=0.2)
    for job, other in zip(jobs, side):
        weights, rows = final_state(job[0])
        weights_side, rows_side = final_state(other[0])
        assert rows == rows_side and len(rows) >= TINY.ppo_steps
        assert weights.keys() == weights_side.keys()
        assert all(torch.equal(weights[k], weights_side[k]) for k in weights)
        assert log_path(other[0]).read_text()  # each process's output went to its own log
    # the two runs differ from each other (beta matters), so the comparison above is not of constants
    assert final_state(jobs[0][0])[1] != final_state(jobs[1][0])[1]


@pytest.mark.slow
def test_a_failed_run_is_named_with_its_error_and_the_other_stopped(artifacts, tmp_path):
    out, prompts, held = artifacts
    good = (tmp_path / "ppo_ok", out, prompts, held, 0.2, dataclasses.replace(TINY, ppo_steps=500), 0)
    bad = (tmp_path / "ppo_bad", out, tmp_path / "missing.jsonl", held, 0.0, TINY, 0)
    with pytest.raises(TetherError) as err:
        run_side_by_side(run_demo_ppo, [good, bad], 500, poll_seconds=0.2)
    message = str(err.value)
    assert "ppo_bad" in message and "missing.jsonl" in message and "\n" not in message
    assert str(log_path(bad[0])) in message
    rows = (good[0] / "metrics.jsonl").read_text().splitlines() if (good[0] / "metrics.jsonl").exists() else []
    assert len([r for r in rows if "objective/kl" in r]) < 500  # stopped, not run to the end


def test_the_beta_exhibit_runs_with_a_critic_free_estimator(artifacts, tmp_path):
    """`tether demo --advantage grpo`: both PPO runs (β > 0, β = 0) sample the same rows a step as GAE's, in groups
    of 4, with no critic; the β = 0 run's highest-KL answers (the exhibit) come from its evaluation samples."""
    from tether.demo.pipeline import beta0_exhibits, demo_ppo_config

    out, prompts, held = artifacts
    cfg = demo_ppo_config(tmp_path / "x", out, prompts, held, 0.2, TINY, 3, "grpo")
    assert (cfg.samples_per_prompt, cfg.batch_size, cfg.critic.warmup_steps) == (4, TINY.ppo_batch // 4, 0)
    for name, beta in (("ppo_b", 0.2), ("ppo_0", 0.0)):
        run_dir = run_demo_ppo(tmp_path / name, out, prompts, held, beta, TINY, 3, "grpo")
        _, rows = final_state(run_dir)
        steps = [r for r in rows if "objective/kl" in r]
        assert len(steps) == TINY.ppo_steps and all(r["objective/kl_coef"] == beta for r in steps)
        assert "group/no_spread_fraction" in steps[-1] and not any(k.startswith("value/") for k in steps[-1])
        assert not list((run_dir / "checkpoints").glob("*/critic.safetensors"))
    assert beta0_exhibits(tmp_path / "ppo_0")  # real responses of the β = 0 run, highest KL first
