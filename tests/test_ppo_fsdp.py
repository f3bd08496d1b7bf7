"""`tether ppo` under FSDP2 with 2 CPU processes (gloo), launched as a user would:
``accelerate launch --config_file examples/accelerate/fsdp2.yaml -m tether ppo ...``.

The gradient-level invariance (2 FSDP2 processes × 4 rows = 1 process × 8) is in tests/test_ppo.py."""

import json
from pathlib import Path

import pytest
import torch
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_fsdp")
    return make_policy_dir(root), make_prompts_file(root)


def args(files, out, steps, *extra):
    policy, prompts = files
    return ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--steps", str(steps), "--batch-size", "4", "--mini-batches", "2",
            "--max-new-tokens", "5", "--progress", "false", "--grad-accumulation", "2", "--lr", "1e-3",
            "--critic-lr", "1e-3", "--eval-every", "0", *extra]


def launch(config: str, cli_args: list[str], timeout: int = 600):
    """tests/launcher.py: a free port; a failure raises with each process's own stderr."""
    accelerate_launch(["-m", "tether", *cli_args], config=config, timeout=timeout)


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "policy" / "model.safetensors"))


@pytest.mark.slow
def test_fsdp2_and_ddp_from_one_seed_agree_after_3_steps(files, tmp_path):
    """Same seed, same rows per process: the FSDP2 run samples the same responses and ends with the DDP run's
    weights. Tolerance: an Adam update moves a weight by at most ≈ lr whatever the gradient's size, so float
    noise in a near-zero gradient can move it that far; 3 steps × 4 epochs × 2 minibatches = 24 updates at
    lr 1e-3 bound the noise at 0.024 per weight, far below the gap of a real error (e.g. unsynchronised
    initial weights or a wrong gradient average), which the gradient test in test_ppo.py pins down exactly."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    launch("ddp.yaml", args(files, ddp, 3))
    launch("fsdp2.yaml", args(files, fsdp, 3))
    a, b = metrics(ddp), metrics(fsdp)
    assert [r["step"] for r in b] == [1, 2, 3]
    for row_a, row_b in zip(a, b):
        for key in ("response/length_mean", "response/length_min", "response/length_max", "ppo/epochs_run"):
            assert row_a[key] == row_b[key], key  # the same responses were sampled
        for key in ("objective/scores", "objective/kl", "policy/loss", "value/loss", "policy/grad_norm"):
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-3, abs=1e-6), key
    wa, wb = weights(ddp), weights(fsdp)
    assert wa.keys() == wb.keys()
    updates, lr = 3 * 4 * 2, 1e-3
    moved = max((wa[k] - weights_initial(files)[k]).abs().max().item() for k in wa)
    assert moved > 10 * 1e-6  # the runs trained
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=updates * lr)
    median_gap = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa]).median().item()
    assert median_gap < 1e-5  # most weights agree to float noise, not merely within the bound


def weights_initial(files) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(files[0] / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_resume_equals_the_straight_run_and_exports_a_plain_model(files, tmp_path, lora):
    """A sharded run with a separate (sharded) critic, stopped at step 2 and resumed to 4, equals the
    straight 4-step run: weights and optimiser states go through full state dicts written by process 0 and
    re-sharded on load (LoRA: a bf16 base and fp32 adapters in the same FSDP units). Held-out evaluation
    runs (every process evaluates: a sharded forward is collective). Its final policy (LoRA: merged) loads
    with plain transformers and generates."""
    from transformers import AutoModelForCausalLM

    # LoRA: a bf16 base and fp32 adapters in the same FSDP units.
    extra = ["--save-every", "2", "--reward-normalize", "running", "--critic", "separate",
             "--critic-model", str(files[0]), "--eval-every", "2", "--eval-n", "4", "--data-eval-fraction", "0.25",
             *(["--lora-r", "4", "--model-dtype", "bf16"] if lora else [])]
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch("fsdp2.yaml", args(files, straight, 4, *extra))
    launch("fsdp2.yaml", args(files, split, 2, *extra))
    launch("fsdp2.yaml", args(files, split, 4, *extra, "--resume"))
    # the step-0 evaluation once (not again on resume), then the steps
    assert [r["step"] for r in metrics(split)] == [0, 1, 2, 3, 4] and metrics(split) == metrics(straight)
    assert [r["eval/n"] for r in metrics(split) if "eval/n" in r] == [4, 4, 4]  # steps 0, 2 and 4
    a, b = weights(straight), weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (split / "ranks.json").exists()  # one sharded copy: no per-rank digests to compare
    config = json.loads((straight / "policy" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    model = AutoModelForCausalLM.from_pretrained(straight / "policy")
    trained = {k: v for k, v in model.state_dict().items() if k in a}
    assert all(torch.equal(trained[k], a[k]) for k in trained)
    assert any(not torch.equal(a[k], weights_initial(files)[k]) for k in a)
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_fsdp_settings_read_from_the_launch_environment(monkeypatch):
    """What accelerate launch --config_file fsdp2.yaml exports, read as tether reads it; FSDP1 and parameter
    offload are refused with a one-line error; without the variables there is no FSDP."""
    from tether.errors import TetherError
    from tether.sharding import fsdp_settings

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_settings() is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert fsdp_settings().reshard_after_forward is False
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(TetherError, match="fsdp_version 1"):
        fsdp_settings()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(TetherError, match="fsdp_offload_params"):
        fsdp_settings()


def test_dry_run_plans_zero3_under_fsdp2(files, tmp_path, monkeypatch):
    from tiny import tiny_config

    from tether.ppo.dryrun import run_plan_config

    cfg = tiny_config(tmp_path, files[0], files[1])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert run_plan_config(cfg, 80.0).zero == 0
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    plan_cfg = run_plan_config(cfg, 80.0)
    assert plan_cfg.zero == 3 and plan_cfg.gpus == 2
