#!/usr/bin/env python
"""GPU check of FSDP2 PPO on a real model (NOT run yet: written on a machine without CUDA).

Runs a few PPO steps of the ``smollm2-135m-instruct`` preset in bf16, once with LoRA and once as a full
fine-tune, with FSDP2 over every visible GPU (``accelerate launch --config_file examples/accelerate/fsdp2.yaml``),
and prints per variant: seconds per phase, tokens/s, and peak ``torch.cuda.max_memory_allocated`` against the
planner's peak for the same run (``tether plan --zero 3 --gpus N``). Needs the real-models extra (the preset's
wheel: see tether/presets.py) and CUDA; without CUDA it stops at once.

Usage: python bench/gpu_check.py [--steps 4] [--batch-size 8]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 12 plus 30?", "Name a colour of the sky.", "Write one short sentence about cats.",
           "What is 7 times 6?", "Say hello in French.", "Give a word that rhymes with blue."]


def worker(a) -> None:
    import torch

    from tether.diagnostics.plan import PlanConfig, plan
    from tether.diagnostics.shapes import config_shape
    from tether.ppo.config import RunConfig
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step
    from tether.presets import resolve_model_path

    cfg = RunConfig()
    cfg.output_dir, cfg.data.prompts = str(Path(a.root) / f"run-{a.variant}"), str(Path(a.root) / "prompts.jsonl")
    cfg.model.policy, cfg.model.dtype = "smollm2-135m-instruct", "bf16"
    cfg.model.lora_r = 16 if a.variant == "lora" else 0
    cfg.reward.sources, cfg.reward.gold = ["tether.rules:char_share"], "none"
    cfg.batch_size, cfg.generation.max_new_tokens, cfg.steps = a.batch_size, 64, a.steps
    cfg.validate()
    run = setup(cfg)
    torch.cuda.reset_peak_memory_stats()
    rows = [ppo_step(run, cfg, step) for step in range(1, a.steps + 1)]
    peak = torch.cuda.max_memory_allocated()
    gpus = run.processes.world_size
    planned = plan(config_shape(str(resolve_model_path(cfg.model.policy))), PlanConfig(
        model=str(resolve_model_path(cfg.model.policy)), dtype="bf16", batch_size=cfg.batch_size,
        prompt_length=cfg.data.max_prompt_length, response_length=64, lora_r=cfg.model.lora_r, critic_lora_r=0,
        zero=3, gpus=gpus, critic="head"))["peak"]
    peaks = run.processes.gather_objects(peak)
    if run.processes.is_main:
        last = rows[1:] or rows
        mean = {k: sum(r[k] for r in last) / len(last) for k in rows[0] if k.startswith("perf/")}
        print(f"{a.variant}: {gpus} GPU(s), mean of {len(last)} steps: " +
              ", ".join(f"{k[5:]} {v:.3f}" for k, v in mean.items()))
        print(f"{a.variant}: peak allocated per GPU (GB): {[round(p / 1e9, 3) for p in peaks]}; "
              f"plan (--zero 3 --gpus {gpus}, critic head): {planned / 1e9:.3f}")
    run.processes.close()  # every process waits for the others, then leaves the process group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_check.py: needs CUDA (no GPU visible); nothing was run", file=sys.stderr)
        return 2
    n = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in PROMPTS * 8))
        for variant in ("lora", "full"):
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",  # port 0: a free one
                   str(REPO / "examples" / "accelerate" / "fsdp2.yaml"), "--num_processes", str(n),
                   "--main_process_port", "0", __file__,
                   "--worker", "--variant", variant, "--root", root, "--steps", str(a.steps),
                   "--batch-size", str(a.batch_size)]
            if subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "4"}).returncode:
                print(f"bench/gpu_check.py: the {variant} run failed (output above)", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
