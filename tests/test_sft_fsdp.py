"""`tether sft` on 2 CPU processes (gloo), launched as a user would (``accelerate launch --config_file
examples/accelerate/fsdp2.yaml -m tether sft ...``): 2 FSDP2 processes × 1 micro-batch a step = 1 process × 2
(the same sequences per step, the loss normalised by the step's tokens over both processes), and DDP likewise; a
2-process FSDP2 run stopped and resumed equals its straight run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher import accelerate_launch
from safetensors.torch import load_file
from test_sft import rows_file
from tiny import make_policy_dir

from tether.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_fsdp")
    return make_policy_dir(root), rows_file(root, n=40)


def args(files, out, grad_accumulation: int, *extra) -> list[str]:
    model, data = files
    return ["sft", "--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "4",
            "--batch-size", "3", "--grad-accumulation", str(grad_accumulation), "--lr", "1e-3", "--eval-fraction", "0",
            "--progress", "false", "--save-every-minutes", "0", *extra]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def max_gap(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2.yaml", "ddp.yaml"])
def test_two_processes_of_one_micro_batch_equal_one_process_of_two(files, tmp_path, config):
    """Tolerance: the two runs differ only in the order of float additions (a reduce-scatter or all-reduce against
    a local sum); an Adam update moves a weight by at most ≈ lr whatever the gradient, so noise in a near-zero
    gradient can move it that far: 4 updates at lr 1e-3 bound it at 4e-3, against a first-step gap of ~lr on
    every weight for a wrong normalisation (a mean over each process's tokens) or unsynchronised weights."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args(files, one, 2)) == 0
    accelerate_launch(["-m", "tether", *args(files, two, 1)], config=config, timeout=900)
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert max_gap(one, two) < 4e-3
    assert not (two / "checkpoints").exists() and (two / "tokenizer.json").is_file()


@pytest.mark.slow
def test_a_two_process_fsdp2_run_stopped_by_the_main_process_resumes_exactly(files, tmp_path):
    worker = str(Path(__file__).with_name("sft_worker.py"))
    model, data = files
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    accelerate_launch([worker, str(model), str(data), str(straight), "0", "0"], config="fsdp2.yaml", timeout=900)
    accelerate_launch([worker, str(model), str(data), str(resumed), "2", "0"], config="fsdp2.yaml", timeout=900)
    assert (resumed / "checkpoints").is_dir() and len(losses(resumed)) == 2
    accelerate_launch([worker, str(model), str(data), str(resumed), "0", "1"], config="fsdp2.yaml", timeout=900)
    assert losses(resumed) == losses(straight) and max_gap(straight, resumed) == 0.0
