#!/usr/bin/env python
"""tether's PPO step against TRL 1.12's, interleaved in one sitting: the ratio with its spread.

Runs ``bench/ppo_step.py`` (tether) and ``../shared/peers/trl_ppo_bench.py`` (TRL, in its own virtual
environment: ``python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 && trl-venv/bin/pip
install "trl==1.12.0" "torch==2.13.0" peft``) alternately, ``--pairs`` times each, at the same settings (batch
64 × 48 tokens, 4 epochs × 4 minibatches, separate critic, 2 threads), each in a fresh process. Prints each
pair's median seconds per step (first step dropped), the ratio TRL / tether (> 1: tether is faster) as a
median with its min–max over pairs, and the peak RSS of both. Absolute seconds drift by ±20% from day to
day on a shared VM: the ratio from one sitting is the figure to quote.

Usage: python bench/vs_trl.py --trl-python trl-venv/bin/python [--size small|medium] [--pairs 3] [--steps 4]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_SCRIPT = HERE.parent.parent / "shared" / "peers" / "trl_ppo_bench.py"
TRL_SIZES = {"small": ["--n-layer", "4", "--n-embd", "128", "--n-head", "4"],
             "medium": ["--n-layer", "6", "--n-embd", "384", "--n-head", "6"]}


def run_tether(size: str, steps: int, out: Path) -> tuple[float, float]:
    subprocess.run([sys.executable, str(HERE / "ppo_step.py"), "--size", size, "--steps", str(steps),
                    "--json", str(out)], check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    return result["median"]["perf/seconds_step"], result["peak_rss_mib"]


def run_trl(python: str, script: Path, size: str, steps: int, out: Path) -> tuple[float, float]:
    subprocess.run([python, str(script), *TRL_SIZES[size], "--steps", str(steps), "--threads", "2",
                    "--out", str(out)], check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    return result["timing"]["median_step_s_excl_first"], result["memory"]["peak_rss_mib"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", required=True, help="python of a virtual environment with trl==1.12.0")
    p.add_argument("--trl-script", default=str(TRL_SCRIPT), help="the peers' TRL benchmark script")
    p.add_argument("--size", choices=sorted(TRL_SIZES), default="small")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="PPO steps per run (the first is dropped)")
    a = p.parse_args()
    if not Path(a.trl_script).is_file():
        print(f"vs_trl: {a.trl_script} not found (the peers' folder beside the clone)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            tether_s, tether_mib = run_tether(a.size, a.steps, Path(tmp) / f"tether{i}.json")
            trl_s, trl_mib = run_trl(a.trl_python, Path(a.trl_script), a.size, a.steps, Path(tmp) / f"trl{i}.json")
            rows.append((tether_s, trl_s, tether_mib, trl_mib))
            print(f"pair {i + 1}: tether {tether_s:.2f} s/step ({tether_mib:.0f} MiB), "
                  f"TRL {trl_s:.2f} s/step ({trl_mib:.0f} MiB), ratio {trl_s / tether_s:.2f}", flush=True)
    ratios = [trl / ours for ours, trl, _, _ in rows]
    print(f"\n{a.size}: TRL / tether seconds per step = {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} interleaved pairs); "
          f"peak RSS tether {statistics.median(r[2] for r in rows):.0f} MiB, "
          f"TRL {statistics.median(r[3] for r in rows):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
