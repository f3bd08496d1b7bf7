#!/usr/bin/env python
"""Seconds per PPO step under DDP and FSDP2 (2 processes), and the per-process bytes FSDP2 holds.

Builds bench/ppo_step.py's models (GPT-2 policy, reward model, separate critic from the RM), then launches
itself once per accelerate config (examples/accelerate/ddp.yaml, fsdp2.yaml) with 2 processes; each run
does ``--steps`` PPO steps (the first is warm-up, dropped) and process 0 prints the median seconds per
phase. Under FSDP2 every process also reports the bytes of the trainable models' weights, gradients and
Adam state it holds (its shards), and of the frozen models (whole), to set against
``tether plan --zero 3 --gpus 2``. CPU (gloo) unless CUDA is visible. Figures go in notes, not in tests.

Usage: python bench/sharded_step.py [--size small|medium] [--steps 4] [--batch-size 16]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("perf/seconds_generate", "perf/seconds_score", "perf/seconds_train", "perf/seconds_step")


def local_bytes(tensors) -> int:
    """Bytes this process holds: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def held_bytes(run) -> dict:
    m, o = run.models, run.optim
    params = o.policy_params + o.critic_params
    state = [v for opt in (o.policy_optimizer, o.critic_optimizer) for s in opt.state.values()
             for v in s.values() if hasattr(v, "numel") and v.dim() > 0]
    frozen = [p for p in m.policy.reference.parameters()] if m.policy.reference is not None else []
    return {"weights": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "adam": local_bytes(state), "reference": local_bytes(frozen)}


def worker(args) -> None:
    from tether.ppo.config import RunConfig
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    root = Path(args.root)
    cfg = RunConfig()
    cfg.output_dir = str(root / f"run-{args.label}")
    cfg.model.policy, cfg.data.prompts = str(root / "policy"), str(root / "prompts.jsonl")
    cfg.reward.sources, cfg.reward.gold = [str(root / "rm")], "none"
    cfg.critic.kind, cfg.critic.model = "separate", str(root / "rm")
    cfg.batch_size, cfg.ppo.mini_batches, cfg.ppo.epochs = args.batch_size, 2, 2
    cfg.generation.max_new_tokens = cfg.generation.min_new_tokens = 32
    cfg.ppo.early_stop, cfg.steps = False, args.steps
    cfg.validate()
    run = setup(cfg)
    rows = [ppo_step(run, cfg, step) for step in range(1, args.steps + 1)]
    held = run.processes.gather_objects(held_bytes(run))
    if run.processes.is_main:
        med = {k: statistics.median(r[k] for r in rows[1:]) for k in PHASES}
        print("RESULT " + json.dumps({"label": args.label, "median": med, "held_bytes": held,
                                      "device": str(run.processes.device)}))
    run.processes.close()  # every process waits for the others, then leaves the process group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    sys.path.insert(0, str(REPO / "bench"))
    from ppo_step import WORDS, build_models

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_models(root, a.size)
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) for _ in range(256)]
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for label in ("ddp", "fsdp2"):
            # --main_process_port 0: a free port (accelerate binds port 0), not the 29500 every launch shares
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "examples" / "accelerate" / f"{label}.yaml"), "--num_processes", "2",
                   "--main_process_port", "0", __file__,
                   "--worker", "--root", str(root), "--label", label, "--steps", str(a.steps),
                   "--batch-size", str(a.batch_size)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stderr, file=sys.stderr)  # whole: each process's own lines, not a tail
                return 1
            result = json.loads(lines[0][len("RESULT "):])
            print(f"{label}: {a.size} GPT-2, 2 processes on {result['device']}, batch {a.batch_size}/process x 32 "
                  f"tokens, median of {a.steps - 1} steps: " +
                  ", ".join(f"{k.split('_')[-1]} {v:.2f}s" for k, v in result["median"].items()))
            for rank, held in enumerate(result["held_bytes"]):
                print(f"  process {rank} holds (MB): " + ", ".join(f"{k} {v / 1e6:.3f}" for k, v in held.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
