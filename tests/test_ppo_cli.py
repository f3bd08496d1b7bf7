"""`tether ppo` end to end: the CLI, bad input (one line, exit code 2), two processes with DDP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.cli import main

from tiny import make_policy_dir, make_prompts_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_cli")
    return make_policy_dir(root), make_prompts_file(root)


def base_args(files, out):
    policy, prompts = files
    return ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--steps", "2", "--batch-size", "4", "--mini-batches", "2",
            "--max-new-tokens", "5", "--progress", "false"]


def test_cli_end_to_end_and_yaml(files, tmp_path, capsys):
    config = tmp_path / "ppo.yaml"
    config.write_text("kl:\n  coef: 0.1\n  controller: adaptive\nppo:\n  epochs: 2\neval:\n  every: 1\n  n: 4\n"
                      "data:\n  eval_fraction: 0.25\nreward:\n  gold: tether.demo.task:gold_reward\n")
    out = tmp_path / "run"
    assert main(base_args(files, out) + ["--config", str(config)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    required = ["objective/scores", "objective/rlhf_reward", "objective/kl", "objective/kl_max", "objective/kl_p99",
                "objective/kl_coef",
                "policy/loss", "policy/clip_fraction", "policy/approx_kl", "policy/ratio_mean", "policy/ratio_std",
                "policy/ratio_max", "policy/entropy", "value/loss", "value/clip_fraction",
                "value/explained_variance", "value/mean", "response/length_mean", "response/truncated_fraction",
                "response/repetition", "perf/seconds_generate", "perf/seconds_score", "perf/seconds_train",
                "perf/tokens_per_second", "perf/rollout_share", "ppo/epochs_run", "eval/reward", "eval/accuracy"]
    for key in required:
        assert key in rows[-1], key
    assert rows[0]["objective/kl_coef"] == 0.1 and rows[-1]["ppo/epochs_run"] <= 2
    assert all(r["objective/kl_p99"] <= r["objective/kl_max"] for r in rows)  # a percentile, not above the max
    saved = (out / "config.yaml").read_text()
    assert "controller: adaptive" in saved
    samples = [json.loads(line) for line in (out / "samples" / "step_2.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "score", "kl", "length", "truncated", "correct"} <= samples[0].keys()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "policy")  # the final policy is a plain HF directory
    # Running again into the same directory without --resume leaves the run intact.
    before = (out / "metrics.jsonl").read_text()
    assert main(base_args(files, out)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


def run_cli(args):
    proc = subprocess.run([sys.executable, "-m", "tether", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize("change,expected", [
    ({"--prompts": "missing.jsonl"}, "missing.jsonl"),
    ({"--prompts": "EMPTY"}, "no prompts"),
    ({"--reward": "tether.rules:no_such_rule"}, "has no function 'no_such_rule'"),
    ({"--reward": "no_such_module_xyz:f"}, "cannot import module 'no_such_module_xyz'"),
    ({"--reward": "NOT_A_RM"}, "tether_reward.json"),
    ({"--mini-batches": "3"}, "--mini-batches: 3 does not divide --batch-size 4"),
    ({"--kl-controller": "pid"}, "'pid' is not one of fixed, adaptive, proportional"),
    ({"--kl-coef": "abc"}, "--kl-coef: expected a number, got 'abc'"),
    ({"--steps": "0"}, "--steps: must be >= 1"),
    ({"--no-such-flag": "1"}, "unrecognized arguments: --no-such-flag"),
])
def test_bad_input_one_line_exit_2(files, tmp_path, change, expected):
    (tmp_path / "empty.jsonl").write_text("")
    not_rm = tmp_path / "not_rm"
    not_rm.mkdir()
    (not_rm / "config.json").write_text("{}")
    args = base_args(files, tmp_path / "run")
    for flag, value in change.items():
        value = {"EMPTY": str(tmp_path / "empty.jsonl"), "NOT_A_RM": str(not_rm)}.get(value, value)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, err = run_cli(args)
    assert code == 2, err
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_yaml_key(files, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("kl:\n  coeff: 0.1\n")
    code, err = run_cli(base_args(files, tmp_path / "run") + ["--config", str(config)])
    assert code == 2 and len(err) == 1 and "unknown key 'kl.coeff'" in err[0], err


@pytest.mark.slow
def test_two_processes_ddp_ranks_hold_equal_weights(files, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tether",
           *base_args(files, out)[0:], "--grad-accumulation", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["world_size"] == 2 and ranks["in_sync"] is True
    assert ranks["digests"][0] == ranks["digests"][1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # one row per step, written once
