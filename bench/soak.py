#!/usr/bin/env python
"""Soak test of crash safety (B14): kill -9 a tiny `tether ppo` run at random moments, `--resume` it each
time, and check that it ends bitwise equal to a straight run (metrics rows without perf/ timings, final
policy weights, final critic, the last samples).

Every launch is `tether ppo ... --resume`: the first one (and any launch killed before the first checkpoint)
finds no checkpoint and starts in place. Kill moments are uniform over the straight run's wall time, so
they land in start-up, rollouts, updates, checkpoint writes and the final export alike. A kill "made" is
one that found the process still running.

Usage: python bench/soak.py [--kills 20] [--steps 6] [--seed 0] [--workdir DIR]
Prints one line: kills survived / made, and whether the result is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny random GPT-2 policy and 32 addition prompts (the demo task), nothing downloaded."""
    from tether.demo.task import build_policy, build_tokenizer, make_problems

    policy = root / "policy"
    tokenizer = build_tokenizer(policy)
    build_policy(tokenizer, seed=0, n_layer=2, n_embd=32, n_head=2).save_pretrained(policy)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in make_problems(32, seed=1)), encoding="utf-8")
    return policy, prompts


def command(policy: Path, prompts: Path, out: Path, steps: int) -> list[str]:
    # save_every 1: a checkpoint every step, so most kills have one to resume from; eval and samples on.
    return [sys.executable, "-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts),
            "--reward", "tether.rules:char_share:char=7", "--gold", "none", "--output-dir", str(out),
            "--steps", str(steps), "--batch-size", "8", "--mini-batches", "2", "--max-new-tokens", "6",
            "--lr", "1e-3", "--critic-lr", "1e-3", "--save-every", "1", "--eval-every", "2", "--eval-n", "8",
            "--reward-normalize", "running", "--data-eval-fraction", "0.25", "--progress", "false", "--resume"]


def launch(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def outputs(run: Path) -> dict:
    """What must be equal: metric rows (timings dropped), final weights, the last samples."""
    from safetensors.torch import load_file

    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = sorted((run / "checkpoints").iterdir())[-1]
    weights = {**load_file(str(run / "policy" / "model.safetensors")),
               **{f"critic.{k}": v for k, v in load_file(str(last / "critic.safetensors")).items()}}
    samples = sorted((run / "samples").glob("*.jsonl"))
    return {"rows": rows, "weights": {k: v.numpy().tobytes() for k, v in weights.items()},
            "samples": {p.name: p.read_text() for p in samples}}


def soak_step(run: Path) -> int:
    """The step of the newest complete checkpoint (0 when none)."""
    from tether.checkpoint import list_checkpoints

    found = list_checkpoints(run)
    return int(found[-1].name.split("_")[1]) if found else 0


def kill_after(proc: subprocess.Popen, metrics: Path, rows: int, delay: float) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after ``metrics`` holds more than ``rows`` lines; False when it
    exited first."""
    while proc.poll() is None:
        if metrics.is_file() and metrics.read_bytes().count(b"\n") > rows:
            time.sleep(delay)
            if proc.poll() is not None:
                return False
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.02)
    return False


def soak(kills: int, steps: int, seed: int, workdir: Path) -> dict:
    """Straight run, then a run killed ``kills`` times and resumed; returns the figures."""
    rng = random.Random(seed)
    policy, prompts = make_inputs(workdir)
    start = time.monotonic()
    proc = launch(command(policy, prompts, workdir / "straight", steps))
    first_row = None
    while proc.poll() is None:  # when the first metrics row appears: the start-up time
        if first_row is None and (workdir / "straight" / "metrics.jsonl").exists():
            first_row = time.monotonic() - start
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"straight run failed: {proc.stderr.read()[-2000:]}")
    wall = time.monotonic() - start
    first_row = first_row or wall
    per_step = (wall - first_row) / steps
    killed = workdir / "killed"
    made = 0
    for k in range(kills):
        # The kill moment is set by progress, not by the clock (robust to a busy machine): a random
        # number of new metric rows (about 2/(kills left) of the remaining steps), then a random fraction
        # of a step, so kills land in rollouts, updates, checkpoint writes and the export alike.
        done = soak_step(killed)
        extra_rows = rng.randrange(max(1, 2 * (steps - done) // (kills - k)))
        proc = launch(command(policy, prompts, killed, steps))
        rows = min(done + extra_rows, steps - 1)  # at the latest: after the last row (final save, export)
        if kill_after(proc, killed / "metrics.jsonl", rows, rng.uniform(0, per_step)):
            made += 1
            continue
        if proc.returncode != 0:
            raise RuntimeError(f"a resumed launch failed: {proc.stderr.read()[-2000:]}")
        break  # the run finished: further launches would have nothing left to do
    proc = launch(command(policy, prompts, killed, steps))
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the final resume failed: {err[-2000:]}")
    exact = outputs(workdir / "straight") == outputs(killed)
    return {"kills_made": made, "kills_survived": made if exact else 0, "exact": exact,
            "straight_seconds": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = soak(args.kills, args.steps, args.seed, workdir)
    print(f"soak: {result['kills_survived']}/{result['kills_made']} kills survived, "
          f"{'exact' if result['exact'] else 'NOT exact'} ({args.steps} steps, straight run "
          f"{result['straight_seconds']} s); {json.dumps(result)}")


if __name__ == "__main__":
    main()
