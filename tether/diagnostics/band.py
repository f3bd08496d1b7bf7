"""One row of the health table (:class:`Band`): which metric it judges, what the value is compared with (its
*measure*), the healthy and alarm ranges, the failure mode it points to. The table itself is
:mod:`tether.diagnostics.bands`; the no-op and late-collapse rows live in their own modules
(:mod:`tether.diagnostics.noop`, :mod:`tether.diagnostics.drift`), which import this one. Imports only the standard
library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# What a band's measure is:
#   value   the metric itself
#   recent  metric / median of its previous `window` values          (sudden jumps and drops)
#   early   metric / median of its first `baseline_steps` values     (drift from the start of the run)
#   rise    metric − median of its first `baseline_steps` values     (a share that may start at 0: repetition)
#   first   metric / its first value                                   (evaluations: few, far apart)
#   gold    evidence (a one-sided z; tether.diagnostics.gold) that the gold metric fell below its best evaluation
#           so far, at evaluations where the reward kept at least half its gain: "the proxy still says better"
#   gold_collapse  the same evidence at evaluations where the reward fell too
MEASURES = ("value", "recent", "early", "rise", "first", "gold", "gold_collapse")
GOLD_MEASURES = ("gold", "gold_collapse")


@dataclass(frozen=True)
class Band:
    """One row of the health table. ``None`` bounds are absent. A measure is *alarm* when it is below
    ``alarm_low`` or above ``alarm_high``; *warn* when it is outside ``healthy`` on an alarm side; else *ok*."""

    name: str
    key: str  # metric key in metrics.jsonl
    measure: str  # one of MEASURES
    healthy: tuple[float | None, float | None]
    alarm_low: float | None
    alarm_high: float | None
    failure_mode: str
    meaning: str
    warmup: bool = False  # skip the first `HealthConfig.warmup` values (the critic is still learning)
    # (metric, low, high): judged only on rows where that metric lies in [low, high] or is absent;
    # other rows are skipped like rows without the band's own metric
    only_if: tuple[str, float | None, float | None] | None = None
    reported_by_some_runs: bool = False  # absent by design elsewhere: doctor does not list it as "not checked"
    # the HealthConfig field that says how long an alarm must last, or "once": an exact count (not a noisy estimate)
    # whose first value in alarm is already the fault, confirmed at once
    persistence: str = "persistence"
    # At the run's final step an alarm counts at once, and with the tether off (β = 0) a warning too:
    # nothing comes after to confirm it, and that value judges the policy the run hands over (the gold
    # bands, whose z already allows for noise; a tethered run's last-moment dip stays a warning).
    final_confirms: bool = False
    needs: tuple[str, ...] = ()  # other keys the measure reads (a band without them is not checked)

    def state(self, m: float) -> str:
        if not math.isfinite(m):
            return "alarm"  # a NaN/inf metric means the run has blown up
        if (self.alarm_low is not None and m < self.alarm_low) or (
                self.alarm_high is not None and m > self.alarm_high):
            return "alarm"
        low, high = self.healthy
        if (self.alarm_low is not None and low is not None and m < low) or (
                self.alarm_high is not None and high is not None and m > high):
            return "warn"
        return "ok"

    def applies(self, row: dict) -> bool:
        if self.only_if is None:
            return True
        key, low, high = self.only_if
        v = _number(row.get(key))
        return v is None or ((low is None or v >= low) and (high is None or v <= high))

    def _range(self, low, high, unit: str) -> str:
        if low is not None and high is not None:
            return f"{low:g}–{high:g}{unit}"
        return f"≥ {low:g}{unit}" if low is not None else f"≤ {high:g}{unit}"

    def healthy_text(self) -> str:
        return self._range(*self.healthy, self.unit())

    def alarm_text(self) -> str:
        parts = []
        if self.alarm_low is not None:
            parts.append(f"< {self.alarm_low:g}{self.unit()}")
        if self.alarm_high is not None:
            parts.append(f"> {self.alarm_high:g}{self.unit()}")
        return " or ".join(parts)

    def unit(self) -> str:
        gold = " σ below best"
        return {"recent": "× recent median", "early": "× early median", "rise": " above the early median",
                "first": "× first evaluation", "gold": gold, "gold_collapse": gold}.get(self.measure, "")


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)
