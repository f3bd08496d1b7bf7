#!/usr/bin/env python
"""GAE against the critic-free estimators on the demo task (SPEC B17): which one lifts held-out gold accuracy most?

For each seed the demo's stages (a)-(d) run once (`tether.demo.pipeline.prepare_policy_and_rm`: the SFT policy, its
preference pairs and the reward model, the same numbers as `tether demo --seed N`); then one PPO run per estimator
("arm") against that reward model, each in a fresh process (1 torch thread, deterministic kernels, as the demo),
all with the budget and settings of the demo's β = 0.2 run (`tether.demo.pipeline.demo_ppo_config`): 40 steps of
512 sampled responses of at most 8 tokens, 2 epochs × 4 minibatches, lr 5e-5, β = 0.2 per-token KL (k1) in the
reward. The arms differ only in how the 512 rows are drawn and credited:

  gae           512 prompts × 1 sample, a separate critic from the reward model, 3 critic warm-up steps
                (the demo's run itself)
  rloo, grpo,   128 prompts × 4 samples, no critic
  dr_grpo
  reinforce_pp  512 prompts × 1 sample, no critic (REINFORCE++'s own form: a batch baseline)
  grpo_klloss   (not in the default set) grpo with the KL as a loss term, β = 0.2 on the k3 token mean
  gae_async     (not in the default set; issue 41, C7) gae one step off: launched as 1 trainer + 1 rollout process
                (`--rollout-processes 1 --async-rollout 1 --rollout-correction tis`), the same 512 rows a step
  gae_split     (not in the default set) the same launch, synchronous: the layout's own control

Printed per seed and arm: held-out gold accuracy of the final policy (greedy, the seed's 500 held-out problems,
Wilson 95% interval), its lift over SFT and McNemar's exact p against SFT on the same problems, mean seconds per
step (steps 2 on) and their ratio to the seed's GAE run (the arms of a seed run one after the other, so the ratio
is from neighbouring runs on a machine that may be shared), and the PPO process's peak RSS; where the seed's GAE arm
ran, each other arm against it on the same problems (the accuracy difference, the problems only one of the two
solves, McNemar's exact p). The summary gives
each arm's median lift with its min-max over seeds, the seeds with a significant lift, and the median ratio.

Usage: python bench/group_baselines.py [--seeds 0-4] [--arms gae,grpo,rloo,dr_grpo,reinforce_pp]
       [--root runs/group_baselines] [--quick] [--table-only]
Finished pieces (a seed's preparation, an arm's run and evaluation) are kept under --root and skipped: rerun to go on.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {  # arm -> (the demo's --advantage, further config changes)
    "gae": ("gae", {}),
    "rloo": ("rloo", {}),
    "grpo": ("grpo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
    "grpo_klloss": ("grpo", {"kl.penalty_in": "loss"}),
    "gae_async": ("gae", {"generation.rollout_processes": 1, "generation.async_rollout": 1,
                          "correction.mode": "tis"}),
    "gae_split": ("gae", {"generation.rollout_processes": 1}),
}
DEFAULT_ARMS = "gae,grpo,rloo,dr_grpo,reinforce_pp"


def settings_of(quick: bool):
    from tether.demo.pipeline import FULL, QUICK

    return QUICK if quick else FULL


def prepare(seed_dir: Path, seed: int, quick: bool) -> None:
    """Child: the demo's stages (a)-(d) for ``seed`` into ``seed_dir``, and prepared.json."""
    import torch

    from tether.demo.pipeline import Stages, prepare_policy_and_rm
    from tether.demo.side_by_side import fix_kernels

    fix_kernels(1)
    torch.manual_seed(seed)
    seed_dir.mkdir(parents=True, exist_ok=True)
    p = prepare_policy_and_rm(seed_dir, settings_of(quick), seed, Stages())
    sft = {k: p["sft_eval"][k] for k in ("accuracy", "low", "high", "n", "correct")}
    (seed_dir / "prepared.json").write_text(json.dumps({"sft": {**sft, "steps": p["sft"]["steps"]},
                                                        "reward_model": p["rm_eval"]}), encoding="utf-8")


def run_arm(seed_dir: Path, seed: int, arm: str, quick: bool) -> None:
    """Child: the demo's β = 0.2 PPO run with ``arm``'s changes; writes ARM.json with the process's peak RSS."""
    from tether.config import config_to_dict
    from tether.demo.pipeline import BETA, demo_ppo_config
    from tether.demo.side_by_side import fix_kernels
    from tether.ppo.train import train

    fix_kernels(1)
    settings = settings_of(quick)
    advantage, changes = ARMS[arm]
    cfg = demo_ppo_config(seed_dir / f"ppo_{arm}", seed_dir, seed_dir / "prompts_train.jsonl",
                          seed_dir / "prompts_heldout.jsonl", BETA, settings, seed, advantage)
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    cfg.validate()
    start = time.perf_counter()
    if cfg.generation.rollout_processes:  # a launch: the trainer and its rollout process, one thread each
        launch_arm(seed_dir, arm, cfg)
    else:
        train(cfg)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    (seed_dir / f"{arm}.json").write_text(json.dumps({"peak_rss_mb": peak_mb, "seconds": time.perf_counter() - start,
                                                      "config": config_to_dict(cfg)}), encoding="utf-8")


def launch_arm(seed_dir: Path, arm: str, cfg) -> None:
    """``accelerate launch`` of ``cfg`` with 1 + its rollout processes (CPU processes, gloo); the peak RSS then is
    the launcher's own, not the run's."""
    import os

    import yaml

    from tether.config import config_to_dict

    path = seed_dir / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)), encoding="utf-8")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes",
           str(1 + cfg.generation.rollout_processes), "--main_process_port", "0", "-m", "tether", "ppo", "--config",
           str(path)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def discordant(correct_a: list, correct_b: list) -> tuple[int, int]:
    """The problems only ``a`` solves and those only ``b`` solves (the pairs McNemar's test counts)."""
    return (sum(a and not b for a, b in zip(correct_a, correct_b)),
            sum(b and not a for a, b in zip(correct_a, correct_b)))


def evaluate_arm(seed_dir: Path, arm: str) -> dict:
    """Held-out gold accuracy of the arm's final policy, McNemar against SFT, seconds per step, peak RSS."""
    from transformers import AutoModelForCausalLM

    from tether.core.stats import mcnemar_exact
    from tether.demo.sft import gold_accuracy
    from tether.demo.task import build_tokenizer

    out = seed_dir / f"{arm}.eval.json"
    if out.is_file() and "correct" in (done := json.loads(out.read_text())):  # older files lack "correct": redone
        return done
    sft = json.loads((seed_dir / "prepared.json").read_text())["sft"]
    held_out = [json.loads(line) for line in (seed_dir / "prompts_heldout.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(seed_dir / f"ppo_{arm}" / "policy").eval()
    final = gold_accuracy(model, build_tokenizer(), held_out)
    only_ppo, only_sft = discordant(final["correct"], sft["correct"])
    rows = [json.loads(line) for line in (seed_dir / f"ppo_{arm}" / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["perf/seconds_step"] for r in rows if r.get("step", 0) >= 2 and "perf/seconds_step" in r]
    flat = [r["group/no_spread_fraction"] for r in rows if "group/no_spread_fraction" in r]
    run = json.loads((seed_dir / f"{arm}.json").read_text())
    result = {"accuracy": final["accuracy"], "low": final["low"], "high": final["high"], "n": final["n"],
              "lift": final["accuracy"] - sft["accuracy"], "p": mcnemar_exact(only_ppo, only_sft),
              "seconds_per_step": statistics.fmean(seconds), "peak_rss_mb": run["peak_rss_mb"],
              "no_spread_mean": statistics.fmean(flat) if flat else None,
              "kl_end": [r["objective/kl"] for r in rows if "objective/kl" in r][-1], "correct": final["correct"]}
    out.write_text(json.dumps(result), encoding="utf-8")
    return result


def child(args: list[str]) -> None:
    """Run this script's child mode (``--prepare`` or ``--arm``) in a fresh interpreter."""
    subprocess.run([sys.executable, __file__, *args], check=True)


def pct(r: dict) -> str:
    return f"{100 * r['accuracy']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"


def print_tables(root: Path, seeds: list[int], arms: list[str]) -> None:
    results = {}
    print("| seed | SFT gold % | " + " | ".join(f"{a} gold % (lift, p)" for a in arms) + " |")
    print("| --- " * (2 + len(arms)) + "|")
    for seed in seeds:
        seed_dir = root / f"seed_{seed}"
        if not (seed_dir / "prepared.json").is_file():
            continue
        sft = json.loads((seed_dir / "prepared.json").read_text())["sft"]
        cells = []
        for arm in arms:
            if (seed_dir / f"{arm}.eval.json").is_file():
                r = results.setdefault(arm, {})[seed] = json.loads((seed_dir / f"{arm}.eval.json").read_text())
                cells.append(f"{pct(r)} ({100 * r['lift']:+.1f}, {r['p']:.2g})")
            else:
                cells.append("not run")
        print(f"| {seed} | {pct(sft)} | " + " | ".join(cells) + " |")
    paired = [a for a in arms if a != "gae" and "gae" in results]
    if paired:  # each arm against the seed's GAE run on the same problems (McNemar, exact)
        from tether.core.stats import mcnemar_exact

        columns = " | ".join(f"{a} − gae (points; problems only {a} / only gae; p)" for a in paired)
        print(f"\n| seed | {columns} |")
        print("| --- " * (1 + len(paired)) + "|")
        for seed in sorted(results["gae"]):
            cells, gae = [], results["gae"][seed]
            for arm in paired:
                r = results.get(arm, {}).get(seed)
                if r is None or "correct" not in r or "correct" not in gae:
                    cells.append("–")
                    continue
                only_arm, only_gae = discordant(r["correct"], gae["correct"])
                cells.append(f"{100 * (r['accuracy'] - gae['accuracy']):+.1f} ({only_arm} / {only_gae}; "
                             f"{mcnemar_exact(only_arm, only_gae):.2g})")
            print(f"| {seed} | " + " | ".join(cells) + " |")
    print("\n| arm | seeds | lift over SFT, median [min, max] (points) | lift > 0 with p < 0.05 | "
          "s/step (median) | s/step ÷ GAE's (median over seeds) | peak RSS MB (median) | no-spread groups |")
    print("| --- " * 8 + "|")
    for arm in arms:
        rs = results.get(arm, {})
        if not rs:
            continue
        lifts = sorted(100 * r["lift"] for r in rs.values())
        ratios = [r["seconds_per_step"] / results["gae"][s]["seconds_per_step"] for s, r in rs.items()
                  if s in results.get("gae", {})]
        flat = [r["no_spread_mean"] for r in rs.values() if r["no_spread_mean"] is not None]
        print(f"| {arm} | {len(rs)} | {statistics.median(lifts):+.1f} [{lifts[0]:+.1f}, {lifts[-1]:+.1f}] | "
              f"{sum(r['lift'] > 0 and r['p'] < 0.05 for r in rs.values())}/{len(rs)} | "
              f"{statistics.median(r['seconds_per_step'] for r in rs.values()):.2f} | "
              f"{statistics.median(ratios) if ratios else float('nan'):.2f} | "
              f"{statistics.median(r['peak_rss_mb'] for r in rs.values()):.0f} | "
              + (f"{100 * statistics.fmean(flat):.1f}% |" if flat else "– |"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="a range 0-4 or a list 0,3 [0-4]")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list of {', '.join(ARMS)} [{DEFAULT_ARMS}]")
    ap.add_argument("--root", default="runs/group_baselines", help="one folder per seed under it")
    ap.add_argument("--quick", action="store_true", help="the demo's --quick budget (a smoke test, not a result)")
    ap.add_argument("--table-only", action="store_true", help="only tabulate what is finished under --root")
    ap.add_argument("--prepare", type=int, default=None, help=argparse.SUPPRESS)  # child modes
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.root)
    quick = ["--quick"] if args.quick else []
    if args.prepare is not None:
        return prepare(root / f"seed_{args.prepare}", args.prepare, args.quick)
    if args.arm is not None:
        return run_arm(root / f"seed_{args.seed}", args.seed, args.arm, args.quick)
    seeds = list(range(int(args.seeds.split("-")[0]), int(args.seeds.split("-")[1]) + 1)) if "-" in args.seeds \
        else [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    if not args.table_only:
        for seed in seeds:
            seed_dir = root / f"seed_{seed}"
            if not (seed_dir / "prepared.json").is_file():
                print(f"seed {seed}: SFT, pairs, reward model", flush=True)
                child(["--root", str(root), "--prepare", str(seed), *quick])
            for arm in arms:
                if not (seed_dir / f"{arm}.json").is_file():
                    print(f"seed {seed}: PPO {arm}", flush=True)
                    child(["--root", str(root), "--arm", arm, "--seed", str(seed), *quick])
                r = evaluate_arm(seed_dir, arm)
                print(f"seed {seed} {arm}: gold {pct(r)} lift {100 * r['lift']:+.1f} p {r['p']:.2g}, "
                      f"{r['seconds_per_step']:.2f} s/step, peak {r['peak_rss_mb']:.0f} MB", flush=True)
    print_tables(root, seeds, arms)


if __name__ == "__main__":
    main()
