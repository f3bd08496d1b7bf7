"""Reward-model training checkpoints (issue 30): a `train-rm` run SIGKILLed mid-epoch and resumed with `--resume`
ends with the straight run's weights, metric rows and evaluation, bit for bit (a backbone with dropout on, so the
RNG must come back too); a directory holding an unfinished run is never restarted or resumed with other
settings; callbacks see every step and stop a run, which then finishes with the model it has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reward_model import char_tokenizer
from test_reward_training import script_rows, write_jsonl

import tether
from tether.checkpoint import list_checkpoints
from tether.errors import TetherError

REPO = Path(__file__).resolve().parents[1]
KILLED_AT = 8  # steps 1-5 are epoch 1, 6-10 epoch 2: killed after the step-6 checkpoint, mid-epoch


def gpt2_with_dropout(path: Path) -> Path:
    """A random 2-layer GPT-2 with GPT-2's dropout (0.1 everywhere): a resume must restore the RNG."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = char_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def flags(backbone: Path, data: Path, out: Path) -> list[str]:
    return ["--model", str(backbone), "--data", str(data), "--output-dir", str(out), "--epochs", "3",
            "--batch-size", "8", "--lr", "1e-3", "--save-every", "3", "--eval-fraction", "0.2",
            "--disable-dropout", "false"]  # GPT-2's dropout on (train-rm turns it off by default): the RNG matters


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels in every process
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          **kwargs)


KILL = """
import os, signal, sys
import tether
from tether.config import resolve_config
from tether.rm.cli import add_arguments
import argparse

class Kill(tether.Callback):
    def on_step_end(self, record):
        if record.step == {at}:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up at all, as a crash

parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
tether.RewardTrainer(resolve_config(tether.RewardTrainingConfig, args), callbacks=Kill()).train()
"""


def outputs(out: Path) -> dict:
    return {name: (out / name).read_bytes() for name in ("model.safetensors", "metrics.jsonl", "eval.json")}


@pytest.mark.slow
def test_a_killed_and_resumed_reward_model_run_equals_the_straight_run(tmp_path):
    backbone = gpt2_with_dropout(tmp_path / "backbone")
    data = write_jsonl(tmp_path / "pairs.jsonl", script_rows(50))
    straight = run(["-m", "tether", "train-rm", *flags(backbone, data, tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert not (tmp_path / "straight" / "checkpoints").exists()  # the finished model replaced them

    out = tmp_path / "killed"
    killed = run(["-c", KILL.format(at=KILLED_AT), *flags(backbone, data, out)])
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["step_000006"]  # the newest kept
    assert not (out / "model.safetensors").exists()
    again = run(["-m", "tether", "train-rm", *flags(backbone, data, out)])  # without --resume: refused
    assert again.returncode == 2 and "holds an unfinished training run (step_000006); use --resume" in again.stderr
    other = run(["-m", "tether", "train-rm", *flags(backbone, data, out), "--lr", "2e-3", "--resume"])
    assert other.returncode == 2 and "--resume: optim.lr is 0.002 but the run in" in other.stderr

    resumed = run(["-m", "tether", "train-rm", *flags(backbone, data, out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step_000006: epoch 2, step 6" in resumed.stdout
    assert outputs(out) == outputs(tmp_path / "straight")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 15


def test_callbacks_see_every_step_and_a_stop_finishes_with_the_model_so_far(tmp_path):
    from test_reward_model import save_tiny_gpt2

    backbone = save_tiny_gpt2(tmp_path / "backbone")
    seen = []

    class Watch(tether.Callback):
        def on_step_end(self, record):
            seen.append(record.step)
            if record.metrics["rm/accuracy"] >= 0 and record.step == 3:
                raise tether.StopTraining("three is enough")
            return {"custom/step_squared": record.step ** 2}

        def on_evaluate(self, metrics):
            seen.append(("evaluate", metrics["n_pairs"]))

        def on_save(self, path):
            seen.append(("save", Path(path).name))

    cfg = tether.RewardTrainingConfig(model=str(backbone), output_dir=str(tmp_path / "rm"), save_every=2)
    cfg.optim.batch_size = 8
    result = tether.RewardTrainer(cfg, pairs=script_rows(50), callbacks=Watch()).train()
    assert result.stopped == "three is enough" and result.steps == 3
    assert seen == [1, 2, ("save", "step_000002"), 3, ("evaluate", result.metrics["n_pairs"]), ("save", "rm")]
    rows = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("custom/step_squared") for r in rows] == [1, 4, None]
    assert json.loads((tmp_path / "rm" / "tether_reward.json").read_text())["run"]["stopped"] == "three is enough"
    assert not (tmp_path / "rm" / "checkpoints").exists()
    with pytest.raises(TetherError, match="exists and is not a tether reward model"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("my data")
        tether.RewardTrainer({**vars_of(cfg), "output_dir": str(tmp_path / "mine")}, pairs=script_rows(50)).train()


def vars_of(cfg) -> dict:
    from tether.config import config_to_dict

    return config_to_dict(cfg)


def test_a_process_reward_model_resumes_from_its_checkpoint_to_the_straight_run(tmp_path):
    """train-rm --process, rows given from Python: crashed at step 5 (checkpoint at 4), resumed: the same model."""
    import random

    from tiny import make_policy_dir

    class Crash(Exception):
        pass

    class CrashAt(tether.Callback):
        def on_step_end(self, record):
            if record.step == 5:
                raise Crash

    rng = random.Random(0)
    rows = []
    for i in range(60):
        steps = ["".join(rng.choice("0123456789x") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        rows.append({"prompt": f"{i:03d}=", "completions": steps, "labels": ["x" not in s for s in steps]})
    backbone = make_policy_dir(tmp_path)

    def config(name):
        return {"model": str(backbone), "output_dir": str(tmp_path / name), "process": True, "save_every": 4,
                "data": {"step_separator": " "}, "optim": {"epochs": 2, "batch_size": 8, "lr": 3e-3}}

    straight = tether.RewardTrainer(config("straight"), pairs=rows).train()
    with pytest.raises(Crash):
        tether.RewardTrainer(config("crashed"), pairs=rows, callbacks=CrashAt()).train()
    assert [p.name for p in list_checkpoints(tmp_path / "crashed")] == ["step_000004"]
    resumed = tether.RewardTrainer(config("crashed"), pairs=rows, resume=True).train()
    assert resumed.steps == straight.steps == 12 and json.dumps(resumed.metrics) == json.dumps(straight.metrics)
    assert outputs(tmp_path / "crashed") == outputs(tmp_path / "straight")
