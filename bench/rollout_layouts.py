#!/usr/bin/env python
"""Seconds per PPO step and its phases in each rollout layout (issue 28, C2/C4): one process; 2 processes
colocated (each trains and generates); 2 trainers + 1 rollout process (disaggregated, --rollout-processes 1).
The same global batch (64 prompts x 48 tokens, bench/ppo_step.py's settings: 4 epochs x 4 minibatches, separate
critic from the reward model) in every layout: 64 on one process, 32 per trainer otherwise. Each run is a real
``tether ppo`` (``accelerate launch`` for several processes, CPU processes and gloo without a GPU); the first
step is warm-up and dropped, the others averaged; layouts run interleaved (A, B, C, A, B, C, ...) and the median
of the repeats is printed, with the step's phases (generate; weight sync = gather + transfer; score; train).

On CPU processes, threads per process: 2 alone, 1 each with several processes (``--threads`` sets one figure for
all: on a machine shared with other jobs, 2 threads in one process lose far more to waiting at each parallel
region than 2 single-threaded processes do); a 2-core machine runs 3 processes in the disaggregated layout, whose
trainers wait while the rollout process generates and vice versa, as PPO's synchronous step does. On a GPU
machine each process takes one GPU.

``--layouts sync,async`` compares the disaggregated layout synchronous and one step off (``--async-rollout 1``,
C7): there seconds_generate is the part of the generation that the previous step's training did not hide, and
the speed-up is the ratio of the two s/step, each the median of the interleaved repeats. ``--critic head`` uses a
value head instead of the separate critic (less scoring, a larger rollout share).

Usage: python bench/rollout_layouts.py [--size medium|small | --model PRESET] [--engine transformers|vllm]
       [--repeats 3] [--steps 4] [--batch 64] [--new-tokens 48] [--epochs 4] [--mini-batches 4]
       [--layouts all|sync,async] [--critic separate|head] [--json FILE]
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

sys.path.insert(0, str(Path(__file__).parent))

from ppo_step import SIZES, WORDS, build_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"1 process": (1, 1, []), "2 colocated": (2, 2, []),  # (processes, trainers, flags)
           "2 trainers + 1 rollout": (3, 2, ["--rollout-processes", "1"]),
           "2 trainers + 1 rollout, async": (3, 2, ["--rollout-processes", "1", "--async-rollout", "1"])}
DEFAULT_LAYOUTS = ("1 process", "2 colocated", "2 trainers + 1 rollout")
PHASES = ("seconds_step", "seconds_generate", "seconds_weight_sync", "seconds_weight_gather",
          "seconds_weight_transfer", "seconds_score", "seconds_train", "tokens_per_second", "rollout_share")


def ppo_args(root: Path, a, policy: str, reward: list[str], critic: list[str], out: Path, batch: int) -> list[str]:
    return ["-m", "tether", "ppo", "--policy", policy, "--prompts", str(root / "prompts.jsonl"), *reward, *critic,
            "--gold", "none", "--output-dir", str(out), "--steps", str(a.steps), "--batch-size", str(batch),
            "--mini-batches", str(a.mini_batches), "--ppo-epochs", str(a.epochs), "--max-new-tokens",
            str(a.new_tokens), "--generation-min-new-tokens", str(a.new_tokens), "--temperature", "0.7", "--kl-coef", "0.05", "--lr", "3e-6", "--critic-lr", "3e-6",
            "--ppo-vf-coef", "0.1", "--ppo-early-stop", "false", "--progress", "false", "--save-every-minutes", "0",
            "--engine", a.engine]


def run_layout(root: Path, a, name: str, args: list[str], repeat: int) -> dict:
    """One run of a layout; the mean of its steps after the first, per metric."""
    processes, trainers, extra = LAYOUTS[name]
    batch = a.batch // trainers
    out = root / f"{name.replace(' ', '_').replace('+', 'and')}-{repeat}"
    args = [*args[:args.index("--output-dir") + 1], str(out), *args[args.index("--output-dir") + 2:]]
    args[args.index("--batch-size") + 1] = str(batch)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads or (2 if processes == 1 else 1))}
    if processes == 1:
        cmd = [sys.executable, *args, *extra]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes", str(processes),
               "--main_process_port", "0", *args, *extra]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench/rollout_layouts.py: {name} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return {k: statistics.mean(r[f"perf/{k}"] for r in rows) for k in PHASES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--model", default="", help="a preset or model directory instead of --size (rule reward, head)")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="prompts a step, over all trainers")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="threads per process (default: 2 alone, 1 with several)")
    p.add_argument("--layouts", default="all", help="'all' (1 process, 2 colocated, 2 + 1) or 'sync,async' (2 + 1 "
                   "synchronous and one step off)")
    p.add_argument("--critic", choices=("separate", "head"), default="separate")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    layouts = DEFAULT_LAYOUTS if a.layouts == "all" else ("2 trainers + 1 rollout", "2 trainers + 1 rollout, async")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if a.model:
            policy, reward, critic, label = a.model, ["--reward", "tether.rules:char_share:char=e"], [], a.model
        else:
            policy_dir, rm_dir, n_params = build_models(root, a.size)
            policy, reward = str(policy_dir), ["--reward", str(rm_dir)]
            critic = ["--critic", "separate", "--critic-model", str(rm_dir)] if a.critic == "separate" else []
            label = f"{n_params / 1e6:.1f}M GPT-2, {a.critic} critic"
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))).capitalize() for _ in range(256)]
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
        args = ppo_args(root, a, policy, reward, critic, root / "run", a.batch)
        figures = {name: [] for name in layouts}
        for repeat in range(a.repeats):
            for name in layouts:  # interleaved: a drifting machine affects every layout alike
                figures[name].append(run_layout(root, a, name, args, repeat))
                print(f"  repeat {repeat + 1}: {name}: {figures[name][-1]['seconds_step']:.2f} s/step", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in PHASES} for name, runs in figures.items()}
    print(f"rollout layouts: {label}, --engine {a.engine}, {a.batch} prompts x {a.new_tokens} tokens a step, "
          f"{a.epochs} epochs x {a.mini_batches} minibatches, threads per process {a.threads or '2 alone, 1 else'}; "
          f"median of {a.repeats} interleaved runs (mean of steps 2-{a.steps} each)")
    print(f"  {'layout':24s} {'s/step':>7s} {'generate':>9s} {'sync':>7s} {'(gather':>8s} {'transfer)':>9s} "
          f"{'score':>7s} {'train':>7s} {'tokens/s':>9s} {'rollout':>8s}")
    for name, m in median.items():
        print(f"  {name:24s} {m['seconds_step']:7.2f} {m['seconds_generate']:9.2f} {m['seconds_weight_sync']:7.3f} "
              f"{m['seconds_weight_gather']:8.3f} {m['seconds_weight_transfer']:9.3f} {m['seconds_score']:7.2f} "
              f"{m['seconds_train']:7.2f} {m['tokens_per_second']:9.0f} {100 * m['rollout_share']:7.0f}%")
    if "2 trainers + 1 rollout, async" in median:
        sync, one_off = (median[n]["seconds_step"] for n in ("2 trainers + 1 rollout", "2 trainers + 1 rollout, async"))
        ratios = [x["seconds_step"] / y["seconds_step"] for x, y in
                  zip(figures["2 trainers + 1 rollout"], figures["2 trainers + 1 rollout, async"])]
        print(f"  async vs sync: {sync / one_off:.2f}x (ratio of the medians); per repeat "
              + ", ".join(f"{r:.2f}" for r in ratios) + f"; sync rollout share "
              f"{100 * median['2 trainers + 1 rollout']['rollout_share']:.0f}%")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": label, "engine": a.engine, "median": median, "runs": figures},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
