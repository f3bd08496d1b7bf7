#!/usr/bin/env python
"""False alarms of the gold bands: how often does a run whose gold accuracy never moves get named?

Simulates flat runs — the same true accuracy at every evaluation, the same problems, per-problem results
correlated between evaluations as the demo's are — and feeds each evaluation to the shipped
:class:`~tether.diagnostics.health.HealthMonitor` as a metrics row (``eval/accuracy``, ``eval/n``,
``eval/correct``, a reward that rises at every evaluation so the reward condition never spares a run, and
``objective/kl_coef`` 0 or 0.2), the last one as the run's final step. A run alarms when either gold band
alerts. Prints the false-alarm rate with its Wilson 95% interval at 5, 10 and 20 evaluations, for the
β = 0 rule (a fall at the final evaluation alarms alone) and the β > 0 rule (only a strong one does), beside
the former unpaired band (z > 3 against the best, two evaluations or the final one).

The correlation model: problem i is right at evaluation t when sqrt(λ)·u_i + sqrt(1 − λ)·e_it > Φ⁻¹(1 − a),
u_i ~ N(0, 1) its difficulty, e_it an AR(1) over evaluations with coefficient φ (the policy drifts: near
evaluations agree more than far ones); latent correlation λ + (1 − λ)·φ^lag. With ``--runs`` it measures the
per-problem correlation (phi coefficient) between evaluations of real runs at each lag from their
``eval/correct`` (or ``samples/step_K.jsonl``) and fits λ and φ to lag 1 and the largest lag.

Usage: python bench/gold_false_alarms.py [--runs RUN_DIR ...] [--trials 4000] [--n 250] [--accuracy 0.5]
       [--evals 5,10,20] [--lam L --phi F] [--alarm 3,2.5] [--fall POINTS]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.core.stats import wilson_interval  # noqa: E402
from tether.diagnostics.doctor import load_metrics, with_problem_results  # noqa: E402
from tether.diagnostics.gold import unpaired_p, z_of  # noqa: E402
from tether.diagnostics.health import GOLD_ALARM, GOLD_WARN, HealthConfig, HealthMonitor  # noqa: E402

# The correlation model fitted (--runs) to the held-out demo seeds 5 and 6, both runs each (tether demo, full
# mode, 2-core AMD EPYC): phi between evaluations 0.60, 0.49, 0.41, 0.30 at lags 1-4 (docs/diagnostics.md).
LAM, PHI = 0.147, 0.772


def simulated_runs(rng: np.random.Generator, trials: int, accuracies: list[float], n: int, lam: float,
                   phi: float) -> np.ndarray:
    """(trials, evaluations, n) bools: per-problem results under the latent model above, with true accuracy
    ``accuracies[t]`` at evaluation t (all equal: a flat run)."""
    evals = len(accuracies)
    u = rng.standard_normal((trials, 1, n))
    e = np.empty((trials, evals, n))
    e[:, 0] = rng.standard_normal((trials, n))
    for t in range(1, evals):
        e[:, t] = phi * e[:, t - 1] + math.sqrt(1 - phi * phi) * rng.standard_normal((trials, n))
    cut = np.array([NormalDist().inv_cdf(1 - a) for a in accuracies])[None, :, None]
    return math.sqrt(lam) * u + math.sqrt(1 - lam) * e > cut


def phi_coefficient(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two 0/1 vectors (0 when either is constant)."""
    a, b = a.astype(float), b.astype(float)
    sa, sb = a.std(), b.std()
    return float(((a - a.mean()) * (b - b.mean())).mean() / (sa * sb)) if sa > 0 and sb > 0 else 0.0


def latent_to_phi(rho: float, accuracy: float, rng: np.random.Generator, size: int = 400_000) -> float:
    z = rng.standard_normal((2, size))
    c = NormalDist().inv_cdf(1 - accuracy)
    x = z[0] > c
    y = rho * z[0] + math.sqrt(max(0.0, 1 - rho * rho)) * z[1] > c
    return phi_coefficient(x, y)


def phi_to_latent(target: float, accuracy: float, rng: np.random.Generator) -> float:
    lo, hi = 0.0, 0.999
    for _ in range(30):  # bisection: phi grows with the latent correlation
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if latent_to_phi(mid, accuracy, rng) < target else (lo, mid)
    return (lo + hi) / 2


def evaluations(run_dir: Path) -> list[np.ndarray]:
    """Per-problem results of a run's evaluations in step order: ``eval/correct`` from metrics.jsonl, else the
    ``correct`` fields of complete samples files (the doctor's own reading)."""
    rows = with_problem_results(load_metrics(run_dir), run_dir)
    return [np.array([c == "1" for c in r["eval/correct"]]) for r in rows if isinstance(r.get("eval/correct"), str)]


def measure(runs: list[Path]) -> dict[int, list[float]]:
    """phi coefficient between every two evaluations of each run, by lag (in evaluations)."""
    by_lag: dict[int, list[float]] = {}
    for run in runs:
        xs = evaluations(run)
        for i in range(len(xs)):
            for j in range(i + 1, len(xs)):
                by_lag.setdefault(j - i, []).append(phi_coefficient(xs[i], xs[j]))
    return by_lag


def fit(by_lag: dict[int, list[float]], accuracy: float, rng: np.random.Generator) -> tuple[float, float]:
    """λ, φ whose latent correlations λ + (1 − λ)φ^lag give the measured mean phi at lag 1 and the largest lag."""
    far = max(by_lag)
    r1 = phi_to_latent(float(np.mean(by_lag[1])), accuracy, rng)
    rf = phi_to_latent(float(np.mean(by_lag[far])), accuracy, rng)
    best = (1e9, 0.0, 0.0)
    for lam in np.linspace(0, min(r1, rf), 200):
        phi = (r1 - lam) / (1 - lam)
        err = abs(lam + (1 - lam) * phi**far - rf)
        best = min(best, (err, float(lam), float(phi)))
    return best[1], best[2]


def alarms(x: np.ndarray, beta: float, config: HealthConfig | None = None) -> bool:
    """Whether the monitor names a gold band on one simulated run, (evals, n) bools."""
    monitor = HealthMonitor(config)
    k = len(x)
    for t, row in enumerate(x):
        metrics = {"eval/accuracy": float(row.mean()), "eval/n": len(row), "eval/reward": float(t),
                   "eval/correct": "".join("1" if c else "0" for c in row), "objective/kl_coef": beta}
        if any(a.band.name.startswith("gold") for a in monitor.update(10 * t, metrics, final=t == k - 1)):
            return True
    return False


def alarms_before(x: np.ndarray) -> bool:
    """The former band (commit c82fbb6): unpaired Agresti–Caffo z > 3 against the best so far at two
    evaluations in a row, or at the final one."""
    acc, n, best, streak = x.mean(axis=1), x.shape[1], -1.0, 0
    for t, a in enumerate(acc):
        if a >= best:
            best, streak = a, 0
            continue
        streak = streak + 1 if z_of(unpaired_p(best, n, a, n)) > 3 else 0
        if streak >= 2 or (streak and t == len(acc) - 1):
            return True
    return False


def rate(hits: int, trials: int) -> str:
    lo, hi = wilson_interval(hits, trials)
    return f"{100 * hits / trials:.2f}% [{100 * lo:.2f}, {100 * hi:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", default=[], help="PPO run directories to measure the correlation from")
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--n", type=int, default=250, help="problems per evaluation [250, the demo's]")
    ap.add_argument("--accuracy", type=float, default=0.5, help="true accuracy of the flat runs [0.5]")
    ap.add_argument("--evals", default="5,10,20")
    ap.add_argument("--lam", type=float, default=None, help=f"latent correlation model: λ (else fitted or {LAM})")
    ap.add_argument("--phi", type=float, default=None, help=f"latent correlation model: φ (else fitted or {PHI})")
    ap.add_argument("--alarm", default=f"{GOLD_ALARM:g}",
                    help=f"alarm levels (σ) of the gold bands to simulate, a comma list [{GOLD_ALARM:g}, the shipped one]")
    ap.add_argument("--fall", type=float, default=0.0,
                    help="points the true accuracy falls at the last two evaluations: the rate of runs named is then "
                         "the bands' power, not false alarms [0: flat runs]")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    lam, phi = LAM, PHI
    if args.runs:
        by_lag = measure([Path(r) for r in args.runs])
        print("measured per-problem correlation (phi) between evaluations of the same run:")
        for lag in sorted(by_lag):
            v = by_lag[lag]
            print(f"  lag {lag}: mean {np.mean(v):.3f}, min {np.min(v):.3f}, max {np.max(v):.3f} ({len(v)} pairs)")
        lam, phi = fit(by_lag, args.accuracy, rng)
    lam = args.lam if args.lam is not None else lam
    phi = args.phi if args.phi is not None else phi
    check = simulated_runs(rng, 200, [args.accuracy] * 5, args.n, lam, phi)
    sim = [np.mean([phi_coefficient(r[0], r[lag]) for r in check]) for lag in range(1, 5)]
    print(f"model: λ = {lam:.3f}, φ = {phi:.3f}; simulated phi at lags 1-4: {', '.join(f'{p:.3f}' for p in sim)}; "
          f"n = {args.n}, accuracy {args.accuracy:g}, {args.trials} runs per cell")
    what = "false alarms" if not args.fall else f"runs named after a true {args.fall:g}-point fall at the last two"
    print(f"\n{what}:\n| evaluations | gold alarm (σ) | β = 0 rule | β > 0 rule | former unpaired band (c82fbb6) |\n"
          "| --- | --- | --- | --- | --- |")
    for k in (int(s) for s in args.evals.split(",")):
        accuracies = [args.accuracy] * (k - 2) + [args.accuracy - args.fall / 100] * 2
        x = simulated_runs(rng, args.trials, accuracies, args.n, lam, phi)
        before = rate(sum(alarms_before(r) for r in x), args.trials)
        for level in (float(s) for s in args.alarm.split(",")):
            config = HealthConfig(bands=[f"{name}=:{min(GOLD_WARN, level):g}::{level:g}"
                                         for name in ("gold_drop", "gold_collapse")])
            zero = sum(alarms(r, 0.0, config) for r in x)
            pos = sum(alarms(r, 0.2, config) for r in x)
            print(f"| {k} | {level:g} | {rate(zero, args.trials)} | {rate(pos, args.trials)} | {before} |", flush=True)


if __name__ == "__main__":
    main()
