"""One table of several `tether rlhf` runs (seeds, or tasks): per arm, each run's held-out gold from step 0 to each
evaluation with its paired test, the doctor, and each run's stage times.

    python bench/rlhf_seeds.py runs/rlhf-s0 runs/rlhf-s1 runs/rlhf-s2

Reads each run's results.json (written by the command); computes nothing new: the paired counts and McNemar p are
the command's own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def point(e: dict) -> str:
    vs = f", +{e['gained']}/−{e['lost']}, p {e['p_vs_step0']:.2g}" if "gained" in e else ""
    return f"{100 * e['accuracy']:.0f}% [{100 * e['low']:.0f}, {100 * e['high']:.0f}]{vs}"


def arm_rows(name: str, results: dict) -> list[str]:
    rows = []
    for arm, rounds in results["arms"].items():
        evals = [e for r in sorted(rounds, key=int) for e in rounds[r]["evals"]]
        last = rounds[max(rounds, key=int)]
        # a refresh round's step 0 is the round before's last policy (the same greedy answers): its gold shown once,
        # its reward (the refreshed reward model's) kept
        later = [e for i, e in enumerate(evals)
                 if (e["step"] > 0 or arm == "dpo") and not any(d["step"] == e["step"] for d in evals[:i])]
        rewards = [f"{e['reward']:.2f}" for e in evals if isinstance(e.get("reward"), float)]
        doctor = last["doctor"].get("level", "-")
        mode = last["doctor"].get("failure_mode") or ""
        rows.append(f"| {name} | {arm} | " + " → ".join(f"step {e['step']}: {point(e)}" for e in later)
                    + f" | {' → '.join(rewards)} | {doctor}{' (' + mode + ')' if mode else ''} |")
    return rows


def table(header: list[str], rows: list[list]) -> None:
    """A markdown table: ``header`` and one row per list of cells."""
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for cells in rows:
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main(paths: list[str]) -> None:
    runs = [(Path(p).name, json.loads((Path(p) / "results.json").read_text(encoding="utf-8"))) for p in paths]
    print("| run | arm | held-out gold at each evaluation [Wilson 95%], against step 0 | held-out RM reward | "
          "doctor |")
    print("| --- | --- | --- | --- | --- |")
    for name, results in runs:
        s0 = results.get("step0")
        if s0:
            print(f"| {name} | step 0 | {point(s0)} of {s0['n']} | | |")
        for row in arm_rows(name, results):
            print(row)
    print()
    table(["run", "DPO against", "only DPO right", "only PPO right", "p"],
          [[name, f"{c['arm']} round {c['round']} step {c['step']}", c["only_dpo"], c["only_ppo"], f"{c['p']:.2g}"]
           for name, results in runs for c in results.get("dpo_vs_ppo", [])])
    print()
    table(["run", "arm, step", "against the control at step", "only the arm right", "only the control right", "p"],
          [[name, f"{c['arm']} round {c['round']}, step {c['step']}", c["control_step"], c["only_arm"],
            c["only_control"], f"{c['p']:.2g}"] for name, results in runs for c in results.get("vs_control", [])])
    print()
    table(["run", "twins in training", "step 0 without twins", "arm, round, step: gold without twins, against step 0"],
          [[name, f"{tf['twins']} of {tf['n']}", point(tf["step0"]),
            "; ".join(f"{e['arm']} r{e['round']} step {e['step']}: {point(e)}" for e in tf["evals"])]
           for name, results in runs if (tf := results.get("twin_free"))])
    print()
    stage_rows = []
    for name, results in runs:
        seconds = {k: v for k, v in results.get("stage_seconds", {}).items() if v is not None}
        stage_rows.append([name, ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()),
                           f"{sum(seconds.values()) / 60:.1f} min"])
    table(["run", "stage seconds (this invocation; skipped stages: their first run's)", "total"], stage_rows)


if __name__ == "__main__":
    main(sys.argv[1:])
