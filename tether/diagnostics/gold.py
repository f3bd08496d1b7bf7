"""Paired evidence that the held-out gold metric fell (SPEC D1): the statistics of the ``gold_drop`` and
``gold_collapse`` health bands, fed one evaluation at a time, live by the trainer and offline by the doctor.

Every evaluation scores the same held-out problems, so two evaluations are paired samples: the problems
each got right are mostly the same ones, and a fall is judged by the problems that changed (the
*discordant* ones), not by two accuracies treated as independent samples. An evaluation's per-problem
results are the ``eval/correct`` string of its metrics row ("1" = correct, in prompt order); a row without
them (a run made before they were recorded, another logger) falls back to the unpaired z of two
proportions, which is conservative.

At each evaluation after the first the current one is compared with the *best so far* (highest accuracy
among the earlier ones, ties to the later): the one-sided exact McNemar p of the fall, times the number
of earlier evaluations it was chosen from (Bonferroni: the best is selected for being high, which
inflates the fall; the product bounds the chance that *any* earlier evaluation looks that much better,
whatever the correlation between evaluations), expressed as the z of a one-sided normal test. The
paired trend over the evaluations from the best to now says whether the fall is a last-moment dip or a
descent. Thresholds and the false-alarm rates they give are in ``docs/diagnostics.md``
(``bench/gold_false_alarms.py`` simulates them). Imports only the standard library.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

Z_MAX = 37.0  # z of p = 1e-300; a p that underflows to 0 is shown as this
TREND_MIN_EVALS = 3  # a trend spans the best and at least two evaluations after it (two: McNemar's own test)
TETHER_OFF_SHARE = 0.01  # β in force ≤ 1% of the run's first β counts as the tether off (adaptive: 7 halvings)


def mcnemar_one_sided(worse: int, better: int) -> float:
    """Exact one-sided McNemar p that the second evaluation is worse than the first.

    ``worse``: problems right at the first and wrong at the second (n10); ``better``: the reverse (n01).
    Under H0 (the two evaluations are exchangeable on each problem) each of the d = n10 + n01 discordant
    problems goes either way with probability ½:

        p = P[X ≥ n10] = Σ_{i=n10}^{d} C(d, i) / 2^d,   X ~ Binomial(d, ½)

    Summed in integers (exact for any d; a float 2^d overflows past d = 1023). No fall (n10 = 0) gives 1.
    """
    if worse < 0 or better < 0:
        raise ValueError(f"counts must be >= 0, got {worse}, {better}")
    if worse == 0:
        return 1.0
    d = worse + better
    return sum(math.comb(d, i) for i in range(worse, d + 1)) / 2**d


def unpaired_p(p_best: float, n_best: float, p: float, n: float) -> float:
    """One-sided p of a fall from proportion ``p_best`` (of ``n_best``) to ``p`` (of ``n``) as independent
    samples, for rows without per-problem results: 1 − Φ(z) with the Agresti–Caffo z (one success and one
    failure added to each side, so 0% and 100% still have an error),

        z = (ã_best − ã) / sqrt(ã_best(1 − ã_best)/(n_best + 2) + ã(1 − ã)/(n + 2)),   ã = (k + 1)/(n + 2).

    Conservative for evaluations of the same problems (their correlation makes the true error smaller)."""
    a = (p_best * n_best + 1) / (n_best + 2)
    b = (p * n + 1) / (n + 2)
    se = math.sqrt(a * (1 - a) / (n_best + 2) + b * (1 - b) / (n + 2))
    return upper_tail((a - b) / se)


def upper_tail(z: float) -> float:
    """P[Z ≥ z] for a standard normal Z, ½·erfc(z/√2): exact in the far tail, where 1 − Φ(z) rounds to 0."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def z_of(p: float) -> float:
    """The one-sided normal z of a p-value, z = Φ⁻¹(1 − p): 0 for p ≥ ½ (no evidence of a fall), and
    :data:`Z_MAX` for a p that underflowed to 0."""
    if p >= 0.5:
        return 0.0
    if p <= 1e-300:
        return Z_MAX
    return -NormalDist().inv_cdf(p)


def trend_z(correct: list[int], steps: list[float], n: int) -> float:
    """Paired linear trend over L ≥ 2 evaluations of the same ``n`` problems, positive for a decline: each
    problem's least-squares slope over the evaluations (up to a constant factor), averaged over the problems and
    divided by its standard error *across problems*. The problems are the independent units, so the test holds
    whatever the correlation between evaluations of one problem (a policy that drifts makes near evaluations
    agree more than far ones; a permutation test that treats the evaluations as exchangeable is fooled by it).

    ``correct``: each evaluation's per-problem results as a bit set (bit i = problem i right); ``steps``: the
    evaluations' steps c_t. With w_t = c_t − c̄ and s_i = Σ_t w_t x_it, by bit counts k_t = Σ_i x_it and
    o_tt' = Σ_i x_it x_it':

        mean = Σ_t w_t k_t / n,   var = (Σ_{t,t'} w_t w_t' o_tt' − n·mean²) / (n − 1),   z = −mean / sqrt(var / n)

    For L = 2 it is the paired z of the mean difference (McNemar's, with the sample variance). 0 when no
    problem changed."""
    L = len(correct)
    if L < 2 or L != len(steps) or n < 2:
        raise ValueError(f"need >= 2 evaluations with one step each and n >= 2, got {L}, {len(steps)}, n = {n}")
    mid = sum(steps) / L
    w = [s - mid for s in steps]
    mean = sum(wt * c.bit_count() for wt, c in zip(w, correct)) / n
    squares = sum(wa * wb * (a & b).bit_count() for wa, a in zip(w, correct) for wb, b in zip(w, correct))
    var = (squares - n * mean * mean) / (n - 1)
    return -mean / math.sqrt(var / n) if var > 1e-12 else 0.0


def paired_interval(worse: int, better: int, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """Difference of two paired accuracies on the same ``n`` problems, (n01 − n10)/n, and its Wald interval
    with the paired variance (the discordant problems carry it all):

        se = sqrt(n10 + n01 − (n01 − n10)²/n) / n,   interval = diff ± z·se

    Returns (diff, low, high). For the report's curve; the decisions use the exact test."""
    diff = (better - worse) / n
    se = math.sqrt(max(0.0, worse + better - (better - worse) ** 2 / n)) / n
    return diff, diff - z * se, diff + z * se


def bits(text: str) -> int:
    """``eval/correct`` ("1" = right, problem 0 first) as a bit set, bit i = problem i."""
    return int(text[::-1], 2) if text else 0


@dataclass
class GoldPoint:
    """What one evaluation shows against the best so far: ``p``, the one-sided McNemar p of the fall (the
    unpaired one when ``paired`` is False); ``p_trend``, that of the paired trend since the best; the smaller,
    times the earlier evaluations the best was chosen from, is ``p_selected``, and ``z`` its z."""

    step: int
    accuracy: float
    n: int
    reward: float
    best_step: int | None = None
    best_accuracy: float | None = None
    paired: bool = False
    worse: int | None = None  # n10: right at the best, wrong now
    better: int | None = None  # n01
    candidates: int = 0  # earlier evaluations the best was chosen from
    p: float = 1.0
    trend_z: float | None = None  # paired trend from the best to now (>= TREND_MIN_EVALS evaluations)
    p_trend: float = 1.0  # its one-sided p, 1 − Φ(trend_z)
    p_selected: float = 1.0  # min(1, candidates · min(p, p_trend))
    z: float = 0.0
    reward_held: bool = True  # the reward kept at least half its gain since the first evaluation
    beta: float | None = None  # the KL coefficient at this evaluation (objective/kl_coef), when logged
    beta_start: float | None = None  # the run's first logged KL coefficient (its kl.coef)
    interval: tuple[float, float, float] | None = None  # paired (diff, low, high) of accuracy − best

    @property
    def tether_off(self) -> bool:
        """β = 0 at this evaluation, β not logged, or β in force at most :data:`TETHER_OFF_SHARE` of the run's first
        β: an adaptive controller that halved it every step the KL stayed under target left a tether in name only."""
        if self.beta is None or self.beta <= 0:
            return True
        return self.beta_start is not None and self.beta <= TETHER_OFF_SHARE * self.beta_start

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class GoldHistory:
    """The evaluations of one run so far (``update`` each one in order) and the paired comparison of each
    with the best before it."""

    evaluations: list[GoldPoint] = field(default_factory=list)
    _correct: list[int | None] = field(default_factory=list)

    def update(self, step: int, accuracy: float, n: int, reward: float, correct: str | None = None,
               beta: float | None = None, beta_start: float | None = None) -> GoldPoint:
        point = GoldPoint(step, accuracy, int(n), reward, beta=beta, beta_start=beta_start)
        if correct is not None and len(correct) != n:
            correct = None  # not the evaluation's problems: judged unpaired
        earlier = self.evaluations
        if earlier:
            self._compare(point, correct)
        self.evaluations.append(point)
        self._correct.append(bits(correct) if correct is not None else None)
        return point

    def gain_since_first(self) -> tuple[int, int, float] | None:
        """The last evaluation against the first, paired on the same problems: (gained, lost, p), where p is the
        exact one-sided McNemar p of a gain (:func:`mcnemar_one_sided` with the two counts' roles swapped: the
        chance of at least ``gained`` of the ``gained + lost`` discordant problems going up under H0). None
        with fewer than two evaluations or without per-problem results for both."""
        if len(self.evaluations) < 2:
            return None
        first, last = self.evaluations[0], self.evaluations[-1]
        a, b = self._correct[0], self._correct[-1]
        if a is None or b is None or first.n != last.n:
            return None
        gained, lost = (b & ~a).bit_count(), (a & ~b).bit_count()
        return gained, lost, mcnemar_one_sided(gained, lost)

    def _compare(self, point: GoldPoint, correct: str | None) -> None:
        earlier = self.evaluations
        i_best = max(range(len(earlier)), key=lambda i: (earlier[i].accuracy, i))  # ties: the later one
        best = earlier[i_best]
        first_reward = earlier[0].reward
        point.best_step, point.best_accuracy, point.candidates = best.step, best.accuracy, len(earlier)
        # A proxy that kept half its gain still says "better" while gold says worse (Goodhart); one that
        # fell with gold is a collapse. Not "above the reward at the best": a flat reward wobbles around it.
        point.reward_held = point.reward > best.reward - max(0.0, best.reward - first_reward) / 2
        cur = bits(correct) if correct is not None else None
        if cur is not None and self._correct[i_best] is not None and best.n == point.n:
            b = self._correct[i_best]
            point.paired, point.worse, point.better = True, (b & ~cur).bit_count(), (cur & ~b).bit_count()
            point.p = mcnemar_one_sided(point.worse, point.better)
            point.interval = paired_interval(point.worse, point.better, point.n)
            span = list(range(i_best, len(earlier)))
            if len(span) + 1 >= TREND_MIN_EVALS and all(
                    self._correct[i] is not None and earlier[i].n == point.n for i in span):
                point.trend_z = trend_z([self._correct[i] for i in span] + [cur],
                                        [earlier[i].step for i in span] + [point.step], point.n)
                point.p_trend = upper_tail(point.trend_z)
        elif point.accuracy < best.accuracy:
            point.p = unpaired_p(best.accuracy, best.n, point.accuracy, point.n)
        point.p_selected = min(1.0, point.candidates * min(point.p, point.p_trend))
        point.z = z_of(point.p_selected)


def with_problem_results(rows: list[dict], run_dir: str | Path) -> list[dict]:
    """``rows`` with ``eval/correct`` (per-problem gold results, the gold bands' paired evidence) filled in
    where an evaluation row lacks it, from ``samples/step_K.jsonl`` when that file has a ``correct`` field for
    each of the evaluation's ``eval/n`` problems, in prompt order: runs made before the results went into
    the metrics, with ``eval.samples`` ≥ ``eval.n`` (the demo's). Unreadable or partial files are left out:
    that evaluation is judged unpaired."""
    for row in rows:
        n = row.get("eval/n")
        if "eval/accuracy" not in row or "eval/correct" in row or not isinstance(n, int) or n < 1:
            continue
        path = Path(run_dir) / "samples" / f"step_{row['step']}.jsonl"
        try:
            samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        correct = [s.get("correct") for s in samples[:n] if isinstance(s, dict)]
        if len(correct) == n and all(isinstance(c, bool) for c in correct):
            row["eval/correct"] = "".join("1" if c else "0" for c in correct)
    return rows


def describe(point: dict) -> str:
    """One line for an evaluation of :meth:`GoldHistory.update` (as ``GoldPoint.to_dict()``): its fall from the
    best so far and the evidence, e.g. ``step 40: 47.3% vs best 61.3% at step 0, paired: 47 right -> wrong,
    26 wrong -> right, p = 0.0093; trend since the best z = 3.81 (p = 7e-05); x4 earlier evaluations:
    p = 0.00028 (z = 3.45)``."""
    if point.get("best_step") is None:
        return f"step {point['step']}: {100 * point['accuracy']:.1f}% (first evaluation)"
    how = (f"paired: {point['worse']} right -> wrong, {point['better']} wrong -> right" if point["paired"]
           else "unpaired (no per-problem results)")
    line = (f"step {point['step']}: {100 * point['accuracy']:.1f}% vs best {100 * point['best_accuracy']:.1f}% at "
            f"step {point['best_step']}, {how}, p = {point['p']:.2g}")
    if point.get("trend_z") is not None:
        line += f"; trend since the best z = {point['trend_z']:.2f} (p = {point['p_trend']:.2g})"
    line += f"; x{point['candidates']} earlier evaluations: p = {point['p_selected']:.2g} (z = {point['z']:.2f})"
    return line + ("" if point["reward_held"] else "; the reward fell too")
