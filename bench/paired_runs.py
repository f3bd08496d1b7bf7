#!/usr/bin/env python
"""Two or more PPO runs on the same held-out problems, evaluation by evaluation: which one gained gold accuracy?

Reads each run's metrics.jsonl (``eval/correct``: the per-problem 0/1 gold results of every evaluation, in the
order of the held-out split, which a run's seed fixes) and prints, per run and evaluation step:

- held-out accuracy with its Wilson 95% interval;
- McNemar's exact two-sided p against the same run's first evaluation (step 0: the untrained policy), and the
  discordant counts (problems gained / lost);
- for every run after the first, McNemar's p against the first run at the same step (the same problems, so the
  pairing is exact);

and per run the training figures over its steps: mean training score, per-token KL at the end, the share of
groups whose K scores are all equal (``group/no_spread_fraction``, K ≥ 2 only), and the median seconds per step
(``perf/seconds_step``) with its phases. Runs whose held-out splits differ (another seed, another
``eval_fraction``) are refused: their problems do not pair.

Usage: python bench/paired_runs.py LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tether.core.stats import mcnemar_exact, wilson_interval  # noqa: E402


def load(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl (is {run} a tether ppo run directory?)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluations(rows: list[dict]) -> dict[int, str]:
    """step -> the ``eval/correct`` bit string of that step's evaluation."""
    return {int(r["step"]): r["eval/correct"] for r in rows if isinstance(r.get("eval/correct"), str)}


def eval_extras(rows: list[dict]) -> dict[int, str]:
    """step -> the evaluation's mean reward and KL to the reference (nats per response)."""
    return {int(r["step"]): f"{r.get('eval/reward', float('nan')):.3f} / {r.get('eval/kl_sequence', float('nan')):.2f}"
            for r in rows if isinstance(r.get("eval/correct"), str)}


def discordant(first: str, second: str) -> tuple[int, int]:
    """(right only in ``first``, right only in ``second``) over the paired problems."""
    if len(first) != len(second):
        raise SystemExit(f"the evaluations hold {len(first)} and {len(second)} problems: they do not pair")
    only_first = sum(a == "1" and b == "0" for a, b in zip(first, second))
    only_second = sum(a == "0" and b == "1" for a, b in zip(first, second))
    return only_first, only_second


def accuracy(bits: str) -> str:
    k, n = bits.count("1"), len(bits)
    low, high = wilson_interval(k, n)
    return f"{100 * k / n:.0f}% ({k}/{n}) [{100 * low:.1f}, {100 * high:.1f}]"


def training_figures(rows: list[dict]) -> dict:
    steps = [r for r in rows if "objective/scores" in r]
    def med(key):
        values = [r[key] for r in steps[1:] if isinstance(r.get(key), (int, float))]  # step 1 warms caches
        return statistics.median(values) if values else float("nan")
    spread = [r["group/no_spread_fraction"] for r in steps if "group/no_spread_fraction" in r]
    half = len(steps) // 2
    return {
        "steps": len(steps),
        "score_first_half": statistics.fmean(r["objective/scores"] for r in steps[:half]) if half else float("nan"),
        "score_second_half": statistics.fmean(r["objective/scores"] for r in steps[half:]) if steps else float("nan"),
        "kl_last": steps[-1].get("objective/kl", float("nan")) if steps else float("nan"),
        "no_spread": statistics.fmean(spread) if spread else None,
        "s_step": med("perf/seconds_step"), "s_generate": med("perf/seconds_generate"),
        "s_score": med("perf/seconds_score"), "s_train": med("perf/seconds_train"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, _, path = item.rpartition("=")
        runs[label or Path(path).name] = Path(path)
    evals = {label: evaluations(load(run)) for label, run in runs.items()}
    first_label = next(iter(runs))
    base = evals[first_label]
    for label, by_step in evals.items():
        if not by_step:
            raise SystemExit(f"{runs[label]}: no evaluation with per-problem results (eval/correct)")
        start = by_step[min(by_step)]
        if start != base[min(base)]:
            print(f"note: {label}'s first evaluation differs from {first_label}'s (another policy or split?)")

    print("| run | step | held-out accuracy [Wilson 95%] | vs its step 0: gained / lost, McNemar p | "
          f"vs {first_label} at this step: p | eval reward / KL to the reference (nats per response) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, by_step in evals.items():
        extras = eval_extras(load(runs[label]))
        start = by_step[min(by_step)]
        for step, bits in sorted(by_step.items()):
            lost, gained = discordant(start, bits)
            vs_start = "–" if step == min(by_step) else f"+{gained} / −{lost}, p = {mcnemar_exact(lost, gained):.2g}"
            vs_first = "–"
            if label != first_label and step in base:
                a, b = discordant(base[step], bits)
                vs_first = f"{b} vs {a} problems only one got right, p = {mcnemar_exact(a, b):.2g}"
            print(f"| {label} | {step} | {accuracy(bits)} | {vs_start} | {vs_first} | {extras[step]} |")

    print()
    print("| run | steps | training score, first half → second half | per-token KL at the end | no-spread groups | "
          "s/step (generate / score / train), median |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, run in runs.items():
        f = training_figures(load(run))
        spread = "–" if f["no_spread"] is None else f"{100 * f['no_spread']:.0f}%"
        print(f"| {label} | {f['steps']} | {f['score_first_half']:.3f} → {f['score_second_half']:.3f} | "
              f"{f['kl_last']:.3f} | {spread} | {f['s_step']:.1f} ({f['s_generate']:.1f} / {f['s_score']:.1f} / "
              f"{f['s_train']:.1f}) |")


if __name__ == "__main__":
    main()
