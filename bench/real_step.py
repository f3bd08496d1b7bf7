"""Seconds per PPO step and per held-out evaluation on SmolLM2-135M-Instruct at recipe-2 shapes (issue #39), one
tree against another, interleaved in fresh processes, median of the repeats.

    python bench/real_step.py --trees OLD_CHECKOUT . --repeats 3 [--steps 3] [--eval-n 180] [--engine vllm]
                              [--option KEY=VALUE ...] [--new-option ppo.packing=true] [--profile]
                              [--json out.json]

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
    config = {"output_dir": out_dir, "steps": args.steps + bool(args.profile), "batch_size": 8,
              "samples_per_prompt": 4, "seed": 0, "progress": False, "save_every_minutes": 0,
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
    profile = {}
    if args.profile:  # one more step and one more evaluation, under the profiler (slower: shares, not seconds)
        profile["step"] = profiled(trainer.step, trainer.run.models.engine)
        profile["eval"] = timed_parts(trainer.evaluate)
    steps = rows[1:] or rows
    result = {phase: statistics.median(r.get(f"perf/seconds_{phase}", 0.0) for r in steps) for phase in PHASES}
    result.update({"eval": eval_seconds, "eval_accuracy": metrics.get("eval/accuracy"),
                   "tokens": statistics.median(r["response/length_mean"] for r in steps),
                   "tether": str(Path(tether.__file__).parent.parent), "profile": profile})
    print("RESULT " + json.dumps(result), flush=True)


VOCAB = 49152  # SmolLM2's: a matmul with this dimension is the output embedding (lm-head)
LORA_R = 16


def category(name: str, shapes) -> str:
    """Which part of the model an op of the profile belongs to, by its name and input shapes."""
    dims = {d for shape in shapes or [] for d in (shape or [])}
    if "scaled_dot_product" in name or "flash_attention" in name or ("softmax" in name and VOCAB not in dims):
        return "attention"
    if VOCAB in dims or "logsumexp" in name or "log_softmax" in name:
        return "lm-head + log-softmax"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
        return "LoRA matmuls" if LORA_R in dims else "other matmuls (base linears)"
    if name in ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_", "aten::copy_",
                "aten::clone", "aten::contiguous", "aten::cat", "aten::resize_"):
        return "allocation and copies"
    return "elementwise and other"


def profiled(fn, engine) -> dict:
    """``fn()`` under torch.profiler: self CPU seconds per :func:`category` of the trainer's ops, and the wall
    seconds. The engine's generation is left out of the record (vLLM runs in this process: its decode loop would
    add millions of events, 24 GB and a 10x slowdown); its seconds are the step's perf/seconds_generate."""
    from torch.profiler import ProfilerActivity, profile

    generate = engine.generate

    def unrecorded(*args, **kwargs):
        prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])
        try:
            return generate(*args, **kwargs)
        finally:
            prof.toggle_collection_dynamic(True, [ProfilerActivity.CPU])

    engine.generate = unrecorded
    started = time.perf_counter()
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
    finally:
        engine.generate = generate
    out = {"wall": time.perf_counter() - started}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith("aten::") or "flash_attention" in event.key:
            key = category(event.key, event.input_shapes)
            out[key] = out.get(key, 0.0) + event.self_cpu_time_total / 1e6
    return out


def timed_parts(evaluate) -> dict:
    """``evaluate()`` with its parts timed by the wall clock: the generation (vLLM runs in this process, and under
    torch.profiler its decode loop slows ~10x, so it is not profiled), the KL forwards, and the rest."""
    import tether.ppo.evaluate as ev

    seconds = {"generation": 0.0, "KL forwards (policy + reference)": 0.0}
    originals = ev.rollout_batch, ev.sequence_kl

    def timed(part, fn):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - started
        return call

    ev.rollout_batch, ev.sequence_kl = timed("generation", originals[0]), timed(
        "KL forwards (policy + reference)", originals[1])
    started = time.perf_counter()
    try:
        evaluate()
    finally:
        ev.rollout_batch, ev.sequence_kl = originals
    wall = time.perf_counter() - started
    return {"wall": wall, **seconds, "the rest (weight sync, rules, metrics)": wall - sum(seconds.values())}


def measure(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps), "--eval-n",
           str(args.eval_n), "--engine", args.engine, "--dtype", args.dtype, "--threads", str(args.threads)]
    cmd += ["--profile"] if args.profile else []
    for option in args.option + (args.new_option if tree != args.trees[0].resolve() else []):
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
    parser.add_argument("--new-option", action="append", default=[], help="KEY=VALUE for every tree but the "
                        "first (the baseline), e.g. ppo.packing=true, which the tree before #39 does not know")
    parser.add_argument("--profile", action="store_true", help="after the timed steps and evaluation, one more step "
                        "under torch.profiler (self CPU seconds by part: lm-head + log-softmax, attention, LoRA, base "
                        "matmuls, allocation and copies, the rest) and one more evaluation timed in parts")
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
            last = runs[str(tree)][-1]
            print(f"repeat {r + 1} {tree}: step {last['step']:.1f} s, eval {last['eval']:.1f} s", flush=True)
            for what, parts in last.get("profile", {}).items():
                parts = dict(parts)  # the runs keep their wall seconds for --json
                wall = parts.pop("wall")
                total = sum(parts.values())  # the step: self CPU seconds of ops; the evaluation: its wall clock
                shares = ", ".join(f"{k} {v:.1f} s ({v / total:.0%})" for k, v in sorted(parts.items(),
                                                                                       key=lambda kv: -kv[1]))
                print(f"  {what}: {wall:.1f} s wall, {total:.1f} s {'of ops' if what == 'step' else 'in parts'}: "
                      + shares)
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
