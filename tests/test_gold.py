"""The gold bands' paired statistics (tether.diagnostics.gold) against hand-computed values and slow,
obvious implementations: brute-force enumeration of the exact McNemar tail, per-problem slopes for the trend
test, and the size of that test on simulated drifting runs."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from statistics import NormalDist

import pytest

from tether.diagnostics.gold import (
    GoldHistory,
    bits,
    describe,
    mcnemar_one_sided,
    paired_interval,
    trend_z,
    unpaired_p,
    with_problem_results,
    z_of,
)


def test_mcnemar_one_sided_by_hand():
    assert mcnemar_one_sided(0, 7) == 1.0  # nothing fell
    assert mcnemar_one_sided(5, 0) == pytest.approx(1 / 32)
    assert mcnemar_one_sided(10, 2) == pytest.approx((66 + 12 + 1) / 4096)  # P[X >= 10], X ~ Bin(12, 1/2)
    assert mcnemar_one_sided(3, 3) == pytest.approx((20 + 15 + 6 + 1) / 64)
    with pytest.raises(ValueError):
        mcnemar_one_sided(-1, 3)


@pytest.mark.parametrize("worse, better", [(1, 0), (4, 2), (7, 5), (9, 1), (2, 10), (6, 6)])
def test_mcnemar_one_sided_is_the_share_of_sign_patterns_at_least_as_bad(worse, better):
    """Brute force: every way the d discordant problems could have gone, each equally likely under H0."""
    d = worse + better
    at_least = sum(sum(signs) >= worse for signs in itertools.product((0, 1), repeat=d))
    assert mcnemar_one_sided(worse, better) == pytest.approx(at_least / 2**d, rel=1e-12)


def test_mcnemar_one_sided_many_discordant_problems():
    """Integers all the way: d = 1,100 overflows a float 2^d; checked against a log-space sum."""
    worse, better = 600, 500
    d = worse + better
    logs = [math.lgamma(d + 1) - math.lgamma(i + 1) - math.lgamma(d - i + 1) - d * math.log(2)
            for i in range(worse, d + 1)]
    top = max(logs)
    assert mcnemar_one_sided(worse, better) == pytest.approx(math.exp(top) * sum(math.exp(x - top) for x in logs),
                                                             rel=1e-9)
    assert mcnemar_one_sided(2000, 0) == 0.0 or mcnemar_one_sided(2000, 0) < 1e-300  # underflows, no error


def test_z_of_by_hand():
    assert z_of(0.5) == 0.0 and z_of(0.9) == 0.0
    assert z_of(0.0227501319) == pytest.approx(2.0, abs=1e-6)  # 1 − Φ(2)
    assert z_of(0.0013498980) == pytest.approx(3.0, abs=1e-6)
    assert z_of(0.0) == pytest.approx(37.0)


def test_unpaired_p_by_hand():
    # 50% of 200 -> 40% of 200: ã = 101/202 = 0.5, 81/202 = 0.40099; se² = (0.25 + 0.24020)/202
    a, b = 101 / 202, 81 / 202
    z = (a - b) / math.sqrt((a * (1 - a) + b * (1 - b)) / 202)
    assert z == pytest.approx(0.0990099 / 0.0492617, abs=1e-5)  # 2.0099
    assert unpaired_p(0.5, 200, 0.4, 200) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))


def test_paired_interval_by_hand():
    # 10 right -> wrong, 4 wrong -> right of 100: diff −0.06, se = sqrt(14 − 36/100)/100 = 0.036932
    diff, low, high = paired_interval(10, 4, 100)
    assert diff == pytest.approx(-0.06)
    assert (low, high) == pytest.approx((-0.06 - 1.96 * 0.0369324, -0.06 + 1.96 * 0.0369324), abs=1e-6)


def test_bits_reads_problem_0_first():
    assert bits("1000") == 1 and bits("0001") == 8 and bits("1101") == 0b1011 and bits("") == 0


def test_trend_of_two_evaluations_is_the_paired_z_of_the_mean_difference():
    # right -> wrong at problems 0, 1, 10; wrong -> right at 5, 6, 12: no trend
    assert trend_z([bits("11111000001100"), bits("00111110000110")], [0, 10], 14) == pytest.approx(0.0)
    # 4 of 6 right -> wrong, none back: differences d = (1, 1, 1, 1, 0, 0), mean 2/3, sample variance
    # (4 − 6 · 4/9) / 5 = 4/15, z = (2/3) / sqrt(4/15 / 6) = sqrt(10) = 3.162
    assert trend_z([bits("111111"), bits("000011")], [10, 20], 6) == pytest.approx(math.sqrt(10))


def test_trend_is_the_mean_per_problem_slope_over_its_standard_error_across_problems():
    """Slow and obvious: each problem's slope numerator Σ_t (c_t − c̄) x_it, then a one-sample z with the
    sample standard deviation over problems (statistics.stdev)."""
    results = ["1110010111", "1011010011", "0101100001", "0100100000"]  # 4 evaluations x 10 problems
    steps = [0, 10, 30, 40]
    mid = sum(steps) / 4
    slopes = [sum((c - mid) * int(r[i]) for c, r in zip(steps, results)) for i in range(10)]
    by_hand = -statistics.mean(slopes) / (statistics.stdev(slopes) / math.sqrt(10))
    assert by_hand > 1.5  # a decline
    assert trend_z([bits(r) for r in results], steps, 10) == pytest.approx(by_hand, rel=1e-12)
    assert trend_z([bits("11"), bits("11"), bits("11")], [0, 1, 2], 2) == 0.0  # nothing changed
    with pytest.raises(ValueError):
        trend_z([bits("1")], [0], 1)


def test_trend_holds_its_size_when_evaluations_drift():
    """Why the trend's variance is taken across problems: a policy that drifts (each problem's state an AR(1)
    over evaluations, the same accuracy throughout) makes near evaluations agree more than far ones. A test
    that permutes each problem's results over the evaluations (as if exchangeable) then rejects far too
    often; this one keeps its one-sided 5% near 5%. 400 simulated flat runs of 6 evaluations x 250 problems."""
    rng = random.Random(0)
    steps = [0, 10, 20, 30, 40, 50]
    rejected = permuted = 0
    for _ in range(400):
        state = [rng.gauss(0, 1) for _ in range(250)]
        runs = []
        for _ in range(6):
            state = [0.9 * s + math.sqrt(1 - 0.81) * rng.gauss(0, 1) for s in state]
            runs.append([s > 0 for s in state])
        rejected += trend_z([bits("".join("1" if x else "0" for x in r)) for r in runs], steps, 250) > 1.645
        # the permutation (Cochran–Armitage within problems) variance: Σ_t w_t² · Σ_i r_i (L − r_i) / (L (L − 1))
        w = [c - 25 for c in steps]
        u = sum(wt * sum(r) for wt, r in zip(w, runs))
        r_i = [sum(r[i] for r in runs) for i in range(250)]
        var = sum(x * x for x in w) * sum(r * (6 - r) for r in r_i) / 30
        permuted += -u / math.sqrt(var) > 1.645
    assert 8 <= rejected <= 36  # 5% of 400 = 20; binomial 99.9% range about 7-37
    assert permuted > 40  # the exchangeable null is fooled by the drift (56 of 400 here, 14%)


def test_history_compares_with_the_best_so_far_and_corrects_for_choosing_it():
    h = GoldHistory()
    first = h.update(0, 0.5, 8, reward=0.0, correct="11110000")
    assert first.best_step is None and first.z == 0.0
    h.update(10, 0.625, 8, reward=1.0, correct="11111000")
    h.update(20, 0.625, 8, reward=2.0, correct="11110100")  # ties the best: the later one becomes the best
    p = h.update(30, 0.125, 8, reward=3.0, correct="10000000")
    assert (p.best_step, p.best_accuracy, p.candidates, p.paired) == (20, 0.625, 3, True)
    assert (p.worse, p.better) == (4, 0)  # problems 1, 2, 3, 5 right at step 20 and wrong now
    assert p.p == pytest.approx(1 / 16)
    assert p.p_selected == pytest.approx(3 / 16) and p.z == pytest.approx(-NormalDist().inv_cdf(3 / 16))
    assert p.reward_held and p.trend_z is None  # the best is the evaluation just before: no trend of 3
    assert p.interval[0] == pytest.approx(-0.5)
    assert "4 right -> wrong, 0 wrong -> right" in describe(p.to_dict())


def test_history_trend_reward_condition_and_unpaired_fallback():
    h = GoldHistory()
    h.update(0, 0.75, 4, reward=0.0, correct="1110")
    h.update(10, 0.5, 4, reward=1.0, correct="1100")
    p = h.update(20, 0.25, 4, reward=0.45, correct="1000")
    assert p.trend_z == pytest.approx(trend_z([bits("1110"), bits("1100"), bits("1000")], [0, 10, 20], 4))
    # the smaller of the two one-sided p, times the 2 earlier evaluations the best (step 0) was chosen from
    assert p.p == pytest.approx(1 / 4) and p.p_trend == pytest.approx(NormalDist().cdf(-p.trend_z))
    assert p.p_selected == pytest.approx(min(1.0, 2 * min(p.p, p.p_trend)))
    # the reward at the best (step 0) was 0.0 and never rose above it: "held" means above 0.0 − 0 / 2
    assert p.reward_held
    p = h.update(30, 0.25, 4, reward=-0.1, correct=None)  # no per-problem results: unpaired, conservative
    assert not p.paired and not p.reward_held and p.p == pytest.approx(unpaired_p(0.75, 4, 0.25, 4))
    p = h.update(40, 0.25, 4, reward=1.0, correct="10")  # results of other problems: unpaired too
    assert not p.paired


def test_problem_results_are_read_from_complete_samples_files(tmp_path):
    (tmp_path / "samples").mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.5, "eval/n": 4}, {"step": 10, "eval/accuracy": 0.5, "eval/n": 4},
            {"step": 20, "eval/accuracy": 0.25, "eval/n": 4, "eval/correct": "1000"}, {"step": 21}]
    (tmp_path / "samples" / "step_0.jsonl").write_text(
        "".join(json.dumps({"prompt": str(i), "correct": c}) + "\n" for i, c in enumerate([True, False, True, False])))
    (tmp_path / "samples" / "step_10.jsonl").write_text(json.dumps({"correct": True}) + "\n")  # 1 of 4: partial
    (tmp_path / "samples" / "step_20.jsonl").write_text("not json\n")  # not read: the row has its results
    out = with_problem_results(rows, tmp_path)
    assert out[0]["eval/correct"] == "1010" and "eval/correct" not in out[1] and out[2]["eval/correct"] == "1000"
    assert "eval/correct" not in out[3]


def test_false_alarm_simulation_machinery():
    """bench/gold_false_alarms.py, at a handful of runs: its flat runs have the accuracy and the decaying
    correlation asked for, and the monitor it feeds sees a real fall (a true 12-point drop at the last two of 5
    evaluations of 250 problems) in nearly every run while flat runs almost never alarm. It fails on a broken
    generator, on rows the monitor cannot alarm on (no eval/n, no reward), or on a band that alarms on noise
    far more often than the simulated ~2%."""
    import importlib.util
    from pathlib import Path

    np = pytest.importorskip("numpy")
    path = Path(__file__).resolve().parents[1] / "bench" / "gold_false_alarms.py"
    spec = importlib.util.spec_from_file_location("gold_false_alarms", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(0)
    flat = bench.simulated_runs(rng, 40, [0.5] * 5, 250, lam=0.13, phi=0.62)
    assert abs(flat.mean() - 0.5) < 0.01
    lag1 = np.mean([bench.phi_coefficient(r[0], r[1]) for r in flat])
    lag4 = np.mean([bench.phi_coefficient(r[0], r[4]) for r in flat])
    assert 0.4 < lag1 < 0.55 and 0.08 < lag4 < 0.25  # latent 0.13 + 0.87·0.62^lag: phi about 0.47 and 0.16
    assert sum(bench.alarms(r, 0.0) for r in flat) <= 3  # about 2% expected: 0.8 of 40
    fall = bench.simulated_runs(rng, 20, [0.5, 0.5, 0.5, 0.38, 0.38], 250, lam=0.13, phi=0.62)
    assert sum(bench.alarms(r, 0.0) for r in fall) >= 18


def test_upper_tail_keeps_the_far_tail():
    from tether.diagnostics.gold import upper_tail

    assert upper_tail(0.0) == 0.5 and upper_tail(1.959963985) == pytest.approx(0.025)
    # 1 − Φ(9.36) = 3.97e-21 (tables; Φ(−9.36) in float through erf is 0.0)
    assert upper_tail(9.36) == pytest.approx(3.97e-21, rel=0.01) and z_of(upper_tail(9.36)) == pytest.approx(9.36)
