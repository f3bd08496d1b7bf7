"""Seconds per PPO step and per held-out evaluation on SmolLM2-135M-Instruct at recipe-2 shapes (issue #39), one
tree against another, interleaved in fresh processes, median of the repeats.

    python bench/real_step.py --trees OLD_CHECKOUT . --repeats 3 [--steps 3] [--eval-n 180] [--engine vllm]
                              [--option ppo.packing=true ...] [--json out.json]

Shape (the issue's): GRPO, K = 4 samples × 8 SVAMP prompts a step, 96 new tokens at T = 1, LoRA r 16 on all linear
layers, 2 epochs × 2 minibatches, k1 KL in the reward, the recipe's system prompt, fp32 unless --dtype; a greedy
evaluation of --eval-n held-out problems after the steps. Each tree runs in its own process with that tree on
PYTHONPATH (so an older checkout is measured with its own code), through tether's Python API: PPOTrainer, steps
2…N timed from their perf/ metrics (step 1 includes start-up work), then one PPOTrainer.evaluate() timed by the
wall clock. Per phase and in all, the median over repeats, and the ratio first tree / each other tree.
Needs the SmolLM2 preset (docs/real-models.md) and ../shared/data/svamp; --engine vllm needs a vLLM environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SVAMP = HERE.parent.parent / "shared" / "data" / "svamp" / "SVAMP.json"
SYSTEM = "You are a math tutor. Solve the word problem in at most three short sentences, then end with 'The answer is N.'"
PHASES = ("generate", "weight_sync", "logprobs_old", "reference", "reward", "train", "step")


def child(args) -> None:
    """One measurement in this process (the tree is whatever `tether` imports)."""
    import torch

    import tether
    from tether.ppo.train import PPOTrainer

    torch.set_num_threads(args.threads)
    out_dir = tempfile.mkdtemp(prefix="tether-realstep-")
    config = {"output_dir": out_dir, "steps": args.steps, "batch_size": 8, "samples_per_prompt": 4, "seed": 0,
              "progress": False, "save_every_minutes": 0,
              "model": {"policy": "smollm2-135m-instruct", "lora_r": 16, "lora_alpha": 32, "dtype": args.dtype},
              "data": {"prompts": str(SVAMP), "eval_fraction": 0.2, "system_prompt": SYSTEM},
              "generation": {"engine": args.engine, "max_new_tokens": 96, "temperature": 1.0},
              "reward": {"sources": ["tether.rules:math_answer"]},
              "advantage": {"estimator": "grpo"}, "kl": {"coef": 0.05},
              "ppo": {"epochs": 2, "mini_batches": 2}, "optim": {"lr": 2e-4},
              "eval": {"n": args.eval_n, "every": 0}}
    for option in args.option:
        key, _, value = option.partition("=")
        config[key] = json.loads(value) if value not in ("", None) and value[0] in "0123456789-[{tfn\"" else value
    trainer = PPOTrainer(config)
    rows = [trainer.step().metrics for _ in range(args.steps)]
    started = time.perf_counter()
    metrics = trainer.evaluate()
    eval_seconds = time.perf_counter() - started
    steps = rows[1:] or rows
    result = {phase: statistics.median(r.get(f"perf/seconds_{phase}", 0.0) for r in steps) for phase in PHASES}
    result.update({"eval": eval_seconds, "eval_accuracy": metrics.get("eval/accuracy"),
                   "tokens": statistics.median(r["response/length_mean"] for r in steps),
                   "tether": str(Path(tether.__file__).parent.parent)})
    print("RESULT " + json.dumps(result), flush=True)


def measure(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps), "--eval-n",
           str(args.eval_n), "--engine", args.engine, "--dtype", args.dtype, "--threads", str(args.threads)]
    for option in args.option:
        cmd += ["--option", option]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: no result (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eval-n", type=int, default=180)
    parser.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the newer trees' config "
                        "(dotted keys; applied to every tree, so only keys all of them know)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    runs: dict[str, list[dict]] = {str(t): [] for t in args.trees}
    for r in range(args.repeats):  # interleaved: each repeat runs every tree once
        for tree in args.trees:
            runs[str(tree)].append(measure(tree.resolve(), args))
            print(f"repeat {r + 1} {tree}: step {runs[str(tree)][-1]['step']:.1f} s, "
                  f"eval {runs[str(tree)][-1]['eval']:.1f} s", flush=True)
    medians = {t: {k: statistics.median(x[k] for x in rs) for k in (*PHASES, "eval", "tokens")}
               for t, rs in runs.items()}
    base = str(args.trees[0])
    print(f"\nmedian of {args.repeats}, {args.engine}, {args.dtype}, {args.threads} threads; ratio = {base} / tree")
    print("| tree | " + " | ".join(PHASES) + " | eval | tokens | step ratio | eval ratio |")
    print("|" + " --- |" * (len(PHASES) + 5))
    for t, m in medians.items():
        print(f"| {t} | " + " | ".join(f"{m[p]:.1f}" for p in PHASES) + f" | {m['eval']:.1f} | {m['tokens']:.0f} | "
              f"{medians[base]['step'] / m['step']:.2f}× | {medians[base]['eval'] / m['eval']:.2f}× |")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
