#!/usr/bin/env python
"""`tether demo` over several seeds: does the story hold, or was one run lucky?

Runs the demo once per seed, each in a fresh process (as a user would: `tether demo --seed N`), one at a
time or `--parallel K` at once (one torch thread each: on a 2-core machine `--parallel 2` halves the wall
time and each run's own seconds grow by the memory-bandwidth contention), then prints one row per seed:
SFT, reward model (held-out pairwise accuracy), PPO with β > 0 and
with β = 0 (held-out gold accuracy, greedy, Wilson 95% intervals; paired McNemar p against SFT), whether
β = 0 shows the proxy-up/gold-down split, the doctor's verdict on both PPO runs beside each run's paired
last-vs-best p (two-sided exact McNemar of the last evaluation against the best earlier one, on the same
held-out problems), and wall seconds. The last lines count the seeds where the story held:

  lift   β > 0 beats SFT by >= 10 points with McNemar p < 0.05
  split  β = 0 raised the reward model's score on held-out prompts (last evaluation above the step-0 one)
         while its gold accuracy fell below SFT's with McNemar p < 0.05
  named  the doctor names reward hacking on a β = 0 run whose last evaluation is below its best with paired
         p < 0.01 while the reward held (kept half its gain, the gold band's condition); and on no β > 0 run
         that ends within noise of its best (paired p >= 0.01, or not below it)

Usage: python bench/demo_seeds.py [--seeds 0-4 | --seeds 0,3] [--quick] [--parallel 2] [--root runs/demo_seeds]
       [--table-only]   (re-read finished runs under --root without running anything)
Seconds are wall time and grow with whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def run_seed(root: Path, seed: int, quick: bool, threads: int) -> float:
    out = root / f"seed_{seed}"
    cmd = [sys.executable, "-m", "tether", "demo", "--seed", str(seed), "--output-dir", str(out),
           "--threads", str(threads)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    with open(root / f"seed_{seed}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def pct(r: dict) -> str:
    return f"{100 * r['accuracy']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"


def verdict(run_dir: Path) -> str:
    from tether.diagnostics.doctor import diagnose_run

    d = diagnose_run(run_dir)
    text = "healthy" if d.healthy else f"{d.failure_mode} ({d.cause_metric} @{d.alarm_step})"
    text += " (warning)" if d.healthy and d.notes else ""
    return text + (f"; not checked: {', '.join(d.unchecked)}" if d.unchecked else "")


def last_vs_best(run_dir: Path) -> dict:
    """The run's last evaluation against its best earlier one on the same problems: accuracies, steps, the
    two-sided exact McNemar p (tether.core.stats), and whether the reward held (the gold band's condition)."""
    from tether.core.stats import mcnemar_exact
    from tether.diagnostics.doctor import load_metrics
    from tether.diagnostics.gold import with_problem_results

    evals = [r for r in with_problem_results(load_metrics(run_dir), run_dir) if "eval/correct" in r]
    *earlier, last = evals
    best = max(reversed(earlier), key=lambda r: r["eval/accuracy"])  # ties: the later one
    pairs = list(zip(best["eval/correct"], last["eval/correct"]))
    worse, better = pairs.count(("1", "0")), pairs.count(("0", "1"))
    gain = max(0.0, best["eval/reward"] - evals[0]["eval/reward"])
    return {"last": last["eval/accuracy"], "best": best["eval/accuracy"], "best_step": best["step"],
            "p": mcnemar_exact(worse, better) if last["eval/accuracy"] < best["eval/accuracy"] else 1.0,
            "reward_held": last["eval/reward"] > best["eval/reward"] - gain / 2}


def fmt_lvb(x: dict) -> str:
    if x["last"] >= x["best"]:
        return f"{100 * x['last']:.1f}, at or above its best ({100 * x['best']:.1f} @{x['best_step']})"
    return (f"{100 * x['last']:.1f} vs {100 * x['best']:.1f} @{x['best_step']}, p = {x['p']:.2g}"
            + ("" if x["reward_held"] else ", reward fell"))


def row(root: Path, seed: int) -> dict:
    out = root / f"seed_{seed}"
    res = json.loads((out / "results.json").read_text())
    beta_name = f"beta_{res['beta']:g}"
    sft, rm = res["sft"], res["reward_model"]
    pos, zero = res["runs"][beta_name], res["runs"]["beta_0"]
    curves0 = zero["curves"]
    proxy_up = curves0["eval_rm_reward"][-1] > curves0["eval_rm_reward"][0]
    gold_down = zero["final"]["accuracy"] < sft["accuracy"] and zero["final"]["mcnemar_p_vs_sft"] < 0.05
    lift = pos["final"]["accuracy"] - sft["accuracy"]
    return {
        "seed": seed, "sft": pct(sft), "sft_steps": sft["steps"],
        "rm": f"{100 * rm['accuracy']:.1f} [{100 * rm['wilson_low']:.1f}, {100 * rm['wilson_high']:.1f}]",
        "pos": pct(pos["final"]), "pos_p": pos["final"]["mcnemar_p_vs_sft"], "lift": lift,
        "zero": pct(zero["final"]), "zero_p": zero["final"]["mcnemar_p_vs_sft"],
        "rm_zero": (curves0["eval_rm_reward"][0], curves0["eval_rm_reward"][-1]),
        "lift_ok": lift >= 0.10 and pos["final"]["mcnemar_p_vs_sft"] < 0.05, "split_ok": proxy_up and gold_down,
        "doctor_pos": verdict(out / f"ppo_{beta_name}"), "doctor_zero": verdict(out / "ppo_beta_0"),
        "lvb_pos": last_vs_best(out / f"ppo_{beta_name}"), "lvb_zero": last_vs_best(out / "ppo_beta_0"),
        "seconds": res["total_seconds"], "beta": res["beta"],
    }


def print_table(rows: list[dict]) -> None:
    beta = rows[0]["beta"]
    print(f"| seed | SFT gold % (steps) | RM held-out pairs % | β = {beta:g} gold % | p vs SFT | β = 0 gold % | "
          f"p vs SFT | β = 0 RM score (eval, start → end) | β = {beta:g} last vs best eval % (paired p) | "
          f"doctor β = {beta:g} | β = 0 last vs best eval % (paired p) | doctor β = 0 | seconds |")
    print("| --- " * 13 + "|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft']} ({r['sft_steps']}) | {r['rm']} | {r['pos']} ({100 * r['lift']:+.1f}) | "
              f"{r['pos_p']:.2g} | {r['zero']} | {r['zero_p']:.2g} | {r['rm_zero'][0]:+.2f} → {r['rm_zero'][1]:+.2f} | "
              f"{fmt_lvb(r['lvb_pos'])} | {r['doctor_pos']} | {fmt_lvb(r['lvb_zero'])} | {r['doctor_zero']} | "
              f"{r['seconds']:.0f} |")
    n = len(rows)
    print(f"\nlift (β > 0 ≥ SFT + 10 points, p < 0.05): {sum(r['lift_ok'] for r in rows)}/{n} seeds; "
          f"split (β = 0: RM score up, gold down, p < 0.05): {sum(r['split_ok'] for r in rows)}/{n}; "
          f"doctor healthy on β > 0 (every band checked): {sum(r['doctor_pos'] in ('healthy', 'healthy (warning)') for r in rows)}/{n}, "
          f"reward hacking named on β = 0: {sum(r['doctor_zero'].startswith('reward hacking') for r in rows)}/{n}")
    due = [r for r in rows if r["lvb_zero"]["p"] < 0.01 and r["lvb_zero"]["reward_held"]]
    calm = [r for r in rows if r["lvb_pos"]["p"] >= 0.01]
    print(f"named: reward hacking on {sum(r['doctor_zero'].startswith('reward hacking') for r in due)}/{len(due)} "
          f"β = 0 runs whose last evaluation is below its best with paired p < 0.01 while the reward held; on "
          f"{sum(r['doctor_pos'].startswith('reward hacking') for r in calm)}/{len(calm)} β > 0 runs that end "
          f"within noise of their best (paired p >= 0.01)")
    secs = sorted(r["seconds"] for r in rows)
    print(f"seconds per run: median {secs[len(secs) // 2]:.0f}, min {secs[0]:.0f}, max {secs[-1]:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="a range 0-4 or a list 0,3 [0-4]")
    ap.add_argument("--quick", action="store_true", help="tether demo --quick")
    ap.add_argument("--root", default="runs/demo_seeds", help="one folder per seed under it [runs/demo_seeds]")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run [1]")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once [1]")
    ap.add_argument("--table-only", action="store_true", help="only tabulate finished runs under --root")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    seeds = parse_seeds(args.seeds)
    if not args.table_only:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, args.parallel)) as pool:  # threads only wait on the subprocesses
            runs = {seed: pool.submit(run_seed, root, seed, args.quick, args.threads) for seed in seeds}
            for seed, seconds in runs.items():
                print(f"seed {seed}: {seconds.result():.0f} s", flush=True)
    print_table([row(root, s) for s in seeds if (root / f"seed_{s}" / "results.json").is_file()])


if __name__ == "__main__":
    main()
