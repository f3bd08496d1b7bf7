"""What the held-out evaluations say about a run beyond the gold bands' alarms (D2): a significant held-out gain that
vouches against the drift bands' alarms it covers, and the warnings that are no alarm — the reward rose without
gold, gold fell without reaching significance, a gold band past its warning level. Read by
:func:`tether.diagnostics.doctor.diagnose`; imports only the standard library and the diagnostics' own modules.
"""

from __future__ import annotations

import math

from tether.diagnostics.gold import describe, upper_tail
from tether.diagnostics.groups import flat_groups_kind
from tether.diagnostics.health import GOLD_ALARM, GOLD_MEASURES, GOLD_WARN, Alert, HealthMonitor

# Bands that predict damage which a held-out gold evaluation measures directly: a per-token KL tail, an entropy
# drop, shorter replies. On a short-answer task learning itself trips them (recipe 4: the one token that changes in
# "The answer is N." is N; the policy grows sure of a digit the reference gave < 0.3%, k3 > 5 there, and one number
# token in seven puts the 99th percentile on it; the entropy falls as guessing turns into knowing).
VOUCHABLE = ("kl_mean", "kl_max", "entropy", "length_collapse")
# Groups flat because every sample is rewarded are the training prompts learned, not a failure, when the held-out
# problems confirm it; flat because none is rewarded stays an alarm (the task is out of reach).
LEARNED = ("the flat groups are solved ones (every sample rewarded: the training prompts are learned; harder "
           "prompts to go on), and ")
# Flat because none was rewarded at first, then healthy again before the evaluation that found the gain: the task
# came within reach as the policy learned (the #51 measurement's gated arm: 87% flat at step 2, 4% -> 48% held out).
WITHIN_REACH = ("the flat groups were unsolved ones at first (no sample rewarded) and the band was healthy again by "
                "the evaluation: the task came within reach as the policy learned; --filter-groups would have spent "
                "those steps on groups with signal, and ")
VOUCH_P = upper_tail(GOLD_ALARM)  # the gold bands' own alarm level, one-sided p 0.00135
# How much further out than the evaluation saw it a band may go after the evaluation and stay vouched for: a plateau
# wobbles (recipe 4's KL p99 between 5.5 and 8), a blow-up multiplies (issue 51: 0.9 -> 6.8 -> 52 nats a token).
VOUCH_SLACK = 1.25
REWARD_WITHOUT_GOLD = "reward without gold"
GOLD_FELL = "gold fell"


def gold_tracker(monitor: HealthMonitor):
    """The gold band tracker holding the run's held-out evaluations (None when there were none)."""
    return next((t for t in monitor.trackers.values() if t.band.measure in GOLD_MEASURES and t.gold.evaluations),
                None)


def _gold_alarmed(monitor: HealthMonitor) -> bool:
    return any(t.first_alert is not None for t in monitor.trackers.values() if t.band.measure in GOLD_MEASURES)


def gold_vouches(monitor: HealthMonitor) -> tuple[int, str] | None:
    """(step, why) when the run's last held-out evaluation shows it got better at the task, not worse: gold accuracy
    above the first evaluation's on the same problems with exact one-sided McNemar p <= :data:`VOUCH_P`, its
    answers still varied (``eval_distinct`` ok at that evaluation) and still alike the reference's in form
    (``eval_shortcut`` ok, its overlap measured). Alarms of :data:`VOUCHABLE` bands that the evaluation covers
    (:func:`covered`; and a "no signal in the groups" alarm whose flat groups are solved ones) then count as notes,
    not as the verdict — the mirror of a gold fall overruling the proxy (a gold band is the verdict whenever it
    alarms). None when any of it is not measured: the bands stand."""
    gold = gold_tracker(monitor)
    gain = gold.gold.gain_since_first() if gold is not None else None
    if gain is None:
        return None
    gained, lost, p = gain
    first, last = gold.gold.evaluations[0], gold.gold.evaluations[-1]
    if p > VOUCH_P or first.accuracy >= last.accuracy:
        return None
    states = {}
    for name in ("eval_distinct", "eval_shortcut"):
        tracker = monitor.trackers.get(name)
        point = next((q for q in reversed(tracker.trace) if q.step == last.step), None) if tracker else None
        if point is None or point.state != "ok" or tracker.first_alert is not None:
            return None
        states[name] = point
    return last.step, (
        f"held-out gold accuracy {100 * first.accuracy:.0f}% at step {first.step} -> {100 * last.accuracy:.0f}% at "
        f"step {last.step} (paired: {gained} wrong -> right, {lost} right -> wrong, p = {p:.2g}), the answers still "
        f"varied (eval/distinct_responses {states['eval_distinct'].measure:.2f}x the first evaluation) and alike the "
        f"reference's (eval/reference_overlap {states['eval_shortcut'].value:.2f}): the drift bought the task; "
        f"read the answers to be sure")


def covered(alert: Alert, monitor: HealthMonitor, step: int) -> bool:
    """Whether the held-out evaluation at ``step`` covers ``alert``'s stretch: the alarm began at or before it and,
    after it, the band went no further out than :data:`VOUCH_SLACK` times the worst the stretch had reached by then.
    The evaluation measured a policy that far out, not further: a KL of 0.9 nats a token at the evaluation that runs
    to 6.8 and 52 in the ten steps after it is a blow-up the evaluation never saw (issue 51), while a KL tail that
    holds its level after it is the policy the evaluation judged."""
    if alert.alarm_step > step:
        return False
    trace = monitor.trace(alert.band.name)
    before = [p.measure for p in trace if alert.onset_step <= p.step <= step and math.isfinite(p.measure)]
    after = [p.measure for p in trace if p.step > step]
    if any(not math.isfinite(m) for m in after):
        return False
    if not before or not after:
        return True
    if alert.band.alarm_high is not None:  # further out = higher (KL)
        return max(after) <= VOUCH_SLACK * max(before)
    return min(after) >= min(before) / VOUCH_SLACK  # further out = lower (entropy, length against their baselines)


def vouched_reason(alert: Alert, monitor: HealthMonitor, rows: list[dict], step: int) -> str | None:
    """The note's preamble when the held-out gain found at ``step`` vouches against ``alert`` ('' for a
    :data:`VOUCHABLE` band), None when the alert stands: it must be :func:`covered`, and a "no signal in the groups"
    alarm only where its flat groups are solved ones (:data:`LEARNED`) or were unsolved with the band healthy again by
    that evaluation (:data:`WITHIN_REACH`)."""
    if not covered(alert, monitor, step):
        return None
    if alert.band.name in VOUCHABLE:
        return ""
    if alert.band.name != "no_spread":
        return None
    kind = flat_groups_kind(rows, alert.onset_step)
    if kind == "solved":
        return LEARNED
    points = [p for p in monitor.trace(alert.band.name) if p.step <= step]
    return WITHIN_REACH if kind == "unsolved" and points and points[-1].state == "ok" else None


def reward_std_at(rows: list[dict], step: int) -> float | None:
    """``eval/reward_std`` (the held-out rewards' standard deviation over the prompts) of the evaluation at ``step``."""
    v = next((r.get("eval/reward_std") for r in rows if r.get("step") == step and "eval/reward" in r), None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def reward_rise_z(first, last, rows: list[dict]) -> float | None:
    """z of the held-out reward's rise from the first evaluation to the last (GoldPoints), in units of its standard
    error, z = (r̄_last − r̄_first) / sqrt((s_first² + s_last²) / n), s the rewards' standard deviation over the n
    held-out prompts (``eval/reward_std``). Unpaired: the same prompts at both evaluations make the rewards
    positively correlated, so the paired error is smaller and this z understates a real rise (never overstates it).
    None when either evaluation lacks its spread (runs made before it was logged)."""
    s0, s1 = reward_std_at(rows, first.step), reward_std_at(rows, last.step)
    if s0 is None or s1 is None or first.n != last.n or first.n < 2:
        return None
    se = math.sqrt((s0 ** 2 + s1 ** 2) / first.n)
    diff = last.reward - first.reward
    return diff / se if se > 0 else (math.inf if diff > 0 else 0.0)


def reward_without_gold(monitor: HealthMonitor, rows: list[dict]) -> list[str]:
    """A warning when the last evaluation's held-out reward is significantly above the first's (:func:`reward_rise_z`
    ≥ the gold bands' warning level, 2.05: one-sided p 0.02) while its gold accuracy is not (the paired one-sided
    McNemar p of a gain above that level's 0.0202; without per-problem results, accuracy not above the first's), and
    no gold band alarmed. A learned reward can rise on held-out prompts while the task's own check stays put: the
    policy found what the reward model likes and the task does not (recipe 5 of docs/real-models.md, β = 0.2: held-out reward
    0.13 -> 0.82, accuracy 39% -> 37%, the replies gathering on two favourite numbers). A rise within the noise is
    no such evidence (issue 51: 0.380 -> 0.381 over 200 prompts gave the note, 0.379 none, a coin flip). Gold that
    moved a little is not a gain either (`tether rlhf` chain_sum seed 1, β = 0.04: reward 0.04 -> 0.99 as the replies
    took one phrasing the reward model favours, gold 39% -> 42%, +11 / −8, p of a gain 0.32). A reward that is the
    gold check itself (the held-out reward equal to the accuracy at both evaluations) gets no note: near the ceiling
    its unpaired rise can pass 2.05 while the paired test stays short (184 of 200 right, +16 / −6: z 2.2, p 0.026)."""
    gold = gold_tracker(monitor)
    if gold is None or len(gold.gold.evaluations) < 2 or _gold_alarmed(monitor):
        return []
    first, last = gold.gold.evaluations[0], gold.gold.evaluations[-1]
    z = reward_rise_z(first, last, rows)
    gain = gold.gold.gain_since_first()
    gold_rose = gain[2] <= upper_tail(GOLD_WARN) if gain else last.accuracy > first.accuracy
    reward_is_gold = all(abs(e.reward - e.accuracy) < 1e-9 for e in (first, last))
    if gold_rose or reward_is_gold or z is None or z < GOLD_WARN:
        return []
    paired = (f"; paired: {gain[0]} wrong -> right, {gain[1]} right -> wrong, p of a gain = {gain[2]:.2g}"
              if gain else "")
    return [f"{REWARD_WITHOUT_GOLD}: the held-out reward rose {first.reward:.3g} -> {last.reward:.3g} from step "
            f"{first.step} to step {last.step} (z = {z:.1f} standard errors) while gold accuracy did not rise "
            f"significantly ({100 * first.accuracy:.0f}% -> {100 * last.accuracy:.0f}%{paired}): the reward's gain "
            f"has not bought the task (a reward model's favourites, a format it over-rates); read the answers"]


def gold_fell(monitor: HealthMonitor) -> list[str]:
    """A warning when the last evaluation's gold accuracy is below the first's and no gold band alarmed (a fall too
    small, or too late, to confirm): the run ends worse at the task than it began, so its headline cannot read
    healthy, whatever the bands say."""
    gold = gold_tracker(monitor)
    if gold is None or len(gold.gold.evaluations) < 2 or _gold_alarmed(monitor):
        return []
    first, last = gold.gold.evaluations[0], gold.gold.evaluations[-1]
    if last.accuracy >= first.accuracy:
        return []
    gain = gold.gold.gain_since_first()
    paired = (f"; paired: {gain[1]} right -> wrong, {gain[0]} wrong -> right, p of a fall = "
              f"{_fall_p(gain):.2g}" if gain else "")
    return [f"{GOLD_FELL}: held-out gold accuracy {100 * first.accuracy:.1f}% at step {first.step} -> "
            f"{100 * last.accuracy:.1f}% at step {last.step}{paired}; not significant enough for an alarm, but the "
            f"run did not get better at the task"]


def _fall_p(gain: tuple[int, int, float]) -> float:
    from tether.diagnostics.gold import mcnemar_one_sided

    return mcnemar_one_sided(gain[1], gain[0])


def gold_summary(monitor: HealthMonitor) -> tuple[list[dict], list[str]]:
    """Each evaluation against the best before it; a note for a gold band whose last evaluation is past its
    warning level without an alarm (one evaluation of a run still going, a tethered run's last-moment dip)."""
    trackers = [t for t in monitor.trackers.values() if t.band.measure in GOLD_MEASURES]
    gold = [p.to_dict() for p in trackers[0].gold.evaluations] if trackers else []
    notes = [f"warning ({t.band.failure_mode}, not confirmed): {describe(t.point.to_dict())}" for t in trackers
             if t.first_alert is None and t.trace and t.trace[-1].state != "ok" and t.point is not None]
    return gold, notes
