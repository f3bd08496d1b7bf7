"""The gold bands on recorded histories of real demo runs: `tether demo --seed k` (full mode, this repo's
2-core machine) for seeds 5 and 6 — held out: the README's table reports seeds 0–4 — trimmed to the rows and
fields the gold bands read (``tests/data/gold_histories/README.md``). Each history is also judged on its first
100 problems, what the run would have recorded with ``eval.n = 100``: there the former unpaired band (commit
c82fbb6) missed the β = 0 fall of seed 5 that the paired evidence sees.

The expected verdicts come from a slow, obvious re-implementation of the documented rule (docs/diagnostics.md)
written here with the standard library: per-problem strings compared character by character, the exact
McNemar tail by math.comb, the trend by statistics.stdev over per-problem slopes — only the warning and alarm
levels are read from the band table."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from statistics import NormalDist

import pytest

from tether.diagnostics.doctor import diagnose, diagnose_run
from tether.diagnostics.health import BANDS, HealthMonitor

HISTORIES = Path(__file__).parent / "data" / "gold_histories"
STEPS = 40  # the demo's PPO steps: the last row is the run's final step
RUNS = ["seed5_beta0", "seed5_beta0.2", "seed6_beta0", "seed6_beta0.2"]


def load(name: str, problems: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (HISTORIES / f"{name}.jsonl").read_text().splitlines()]
    if problems is not None:  # the first `problems` of each evaluation: the same prompts, eval.n = problems
        for r in rows:
            r["eval/correct"] = r["eval/correct"][:problems]
            r["eval/n"], r["eval/accuracy"] = problems, r["eval/correct"].count("1") / problems
    return rows


def one_sided(worse: int, better: int) -> float:
    d = worse + better
    return sum(math.comb(d, i) for i in range(worse, d + 1)) / 2**d if worse else 1.0


def expected(rows: list[dict]) -> tuple[str | None, int | None, dict]:
    """(failure mode or None, alarm step, the last evaluation against its best) by the documented rule."""
    band = next(b for b in BANDS if b.name == "gold_drop")
    warn, alarm = band.healthy[1], band.alarm_high
    states, last = [], {}
    for t, row in enumerate(rows):
        if t == 0:
            states.append(("ok", None))
            continue
        b = max(range(t), key=lambda i: (rows[i]["eval/accuracy"], i))  # the best so far, ties to the later
        pairs = list(zip(rows[b]["eval/correct"], row["eval/correct"]))
        worse, better = pairs.count(("1", "0")), pairs.count(("0", "1"))
        p, p_trend = one_sided(worse, better), 1.0
        if t - b >= 2:
            span = rows[b:t + 1]
            mid = statistics.mean(r["step"] for r in span)
            slopes = [sum((r["step"] - mid) * int(r["eval/correct"][i]) for r in span) for i in range(row["eval/n"])]
            sd = statistics.stdev(slopes)
            if sd > 0:
                p_trend = NormalDist().cdf(statistics.mean(slopes) / (sd / math.sqrt(len(slopes))))
        p_sel = min(1.0, t * min(p, p_trend))
        z = -NormalDist().inv_cdf(p_sel) if p_sel < 0.5 else 0.0
        first, best_reward = rows[0]["eval/reward"], rows[b]["eval/reward"]
        held = row["eval/reward"] > best_reward - max(0.0, best_reward - first) / 2
        state = "alarm" if z > alarm else "warn" if z > warn else "ok"
        states.append((state, "reward hacking" if held else "collapse"))
        last = {"worse": worse, "better": better, "two_sided": min(1.0, 2 * one_sided(max(worse, better),
                                                                                     min(worse, better))),
                "held": held, "below": row["eval/accuracy"] < rows[b]["eval/accuracy"]}
    tether_off = rows[-1].get("objective/kl_coef", 0.0) == 0
    for t, (state, mode) in enumerate(states):
        final = t == len(states) - 1
        if state == "alarm" and t + 1 < len(states) and states[t + 1] == ("alarm", mode):
            return mode, rows[t]["step"], last
        if final and (state == "alarm" or (state == "warn" and tether_off)):
            return mode, rows[t]["step"], last
    return None, None, last


@pytest.mark.parametrize("problems", [None, 100])
@pytest.mark.parametrize("name", RUNS)
def test_doctor_and_live_monitor_on_recorded_histories(name, problems):
    rows = load(name, problems)
    mode, alarm_step, last = expected(rows)
    d = diagnose(rows, run_config={"steps": STEPS})
    assert (d.failure_mode, d.alarm_step) == (mode, alarm_step)
    # What the issue asks of it: a β = 0 run whose last evaluation is below its best with paired p < 0.01
    # while the reward held is named reward hacking; a β > 0 run that ends within noise of its best is not.
    if "beta0." not in name and last["below"] and last["two_sided"] < 0.01 and last["held"]:
        assert d.failure_mode == "reward hacking"
    if "beta0." in name and (not last["below"] or last["two_sided"] >= 0.01):
        assert d.failure_mode != "reward hacking"
    # The trainer's live monitor on the same rows (its final step flagged) raises the same alarm.
    monitor = HealthMonitor()
    live = [a for i, r in enumerate(rows) for a in monitor.update(r["step"], r, final=i == len(rows) - 1)]
    assert [(a.failure_mode, a.alarm_step) for a in live] == ([(mode, alarm_step)] if mode else [])


def test_the_first_100_problems_of_seed_5_beta_0_need_the_paired_evidence():
    """The fall the former unpaired band missed: 59.0% at step 10 to 39.0% and 42.0% at steps 30 and 40 on
    100 problems (26 and 24 right -> wrong, 6 and 7 back) while the reward-model score held."""
    rows = load("seed5_beta0", problems=100)
    assert [r["eval/accuracy"] for r in rows] == [0.56, 0.59, 0.51, 0.39, 0.42]
    d = diagnose(rows, run_config={"steps": STEPS})
    assert d.failure_mode == "reward hacking" and expected(rows)[0] == "reward hacking"


def test_the_doctor_reads_the_results_from_the_samples_of_an_older_run(tmp_path):
    """A run made before eval/correct went into the metrics: the same verdict from samples/step_K.jsonl."""
    rows = load("seed5_beta0")
    (tmp_path / "samples").mkdir()
    for r in rows:
        (tmp_path / "samples" / f"step_{r['step']}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"p{i}", "correct": c == "1"}) + "\n" for i, c in enumerate(r.pop("eval/correct"))))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(f"steps: {STEPS}\n")
    d = diagnose_run(tmp_path)
    assert (d.failure_mode, d.alarm_step) == expected(load("seed5_beta0"))[:2] and d.gold[-1]["paired"]
