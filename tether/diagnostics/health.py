"""Health bands of a PPO run (SPEC D1) and the live monitor that checks them step by step (D3).

The bands are one table of data, :data:`BANDS` (:mod:`tether.diagnostics.bands`): which metric (a key of ``metrics.jsonl``), what it is
compared with, the healthy range, the alarm threshold, what it means and the failure mode it points to.
Defaults come from the reference (§D, tables D.1–D.5); :class:`HealthConfig` (the ``health`` section of
the PPO config) overrides them. :class:`HealthMonitor` is fed one metrics row per PPO step; it returns an
:class:`Alert` when a band first enters its alarm range and keeps a trace that ``tether doctor`` reads.

The exact rules (persistence, onset, trend baselines) are written out in ``docs/diagnostics.md``.
Imports only the standard library, ``tether.config`` and :mod:`tether.diagnostics.gold` (the gold bands'
paired statistics).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from tether.config import option
from tether.diagnostics.bands import (  # noqa: F401  the table and the failure modes, importable from here too
    BAND_NAMES, BANDS, COLLAPSE, GOLD_ALARM, GOLD_MEASURES, GOLD_WARN, KL_EXPLOSION, MEASURES, MODE_COLLAPSE,
    NO_SIGNAL, NOT_LEARNING, RATIO, REWARD_HACKING, SAMPLER_MISMATCH, SHORTCUT, TASK_DROPPED, VALUE_COLLAPSE, Band,
    _number)
from tether.diagnostics.gold import GoldHistory, GoldPoint, describe
from tether.errors import ConfigError

REWARD_KEYS = ("eval/reward", "objective/scores_raw", "objective/scores")  # reward for the gold band


@dataclass
class HealthConfig:
    """Health bands and live alarms (the ``health`` section of the PPO config)."""

    persistence: int = option(2, "steps a metric must stay in its alarm range before it counts", low=1,
                              flag="--health-persistence")
    warmup: int = option(5, "first values of value/loss and value/explained_variance not judged "
                            "(the critic is still learning)", low=0, flag="--health-warmup")
    window: int = option(10, "steps in the recent median that entropy and value loss are compared with",
                         low=2, flag="--health-window")
    baseline_steps: int = option(5, "first steps whose median response length is the baseline", low=1,
                                 flag="--health-baseline-steps")
    not_learning_steps: int = option(20, "steps the clip fraction must stay < 5% to count as not learning",
                                     low=1, flag="--health-not-learning-steps")
    stop_on_alarm: bool = option(False, "stop training at the first health alarm", flag="--stop-on-alarm")
    rollback: bool = option(False, "on an alarm, go back to the last checkpoint saved while healthy",
                            flag="--rollback-on-alarm")
    max_skipped_steps: int = option(3, "stop the run after this many consecutive steps whose optimizer updates "
                                    "were all skipped for non-finite losses or gradients", low=1,
                                    flag="--max-skipped-steps")
    hang_seconds: float | None = option(None, "several processes: seconds a process may stay in one phase before it "
                                        "writes one line and an alerts.jsonl row naming its rank, phase and step, "
                                        "and its threads' stacks (the hang watchdog, docs/distributed.md); below the "
                                        "collective timeout; null (default) = 300 s or half the collective timeout "
                                        "if that is shorter; 0 = off", low=0.0, flag="--hang-timeout")
    bands: list[str] = option([], "override a band: NAME=HEALTHY_LOW:HEALTHY_HIGH:ALARM_LOW:ALARM_HIGH "
                                  "(empty = no bound) or NAME=off", repeat=True, flag="--health-band")

    def validate(self) -> None:
        resolve_bands(self)


def _parse_bound(text: str, where: str) -> float | None:
    try:
        return float(text) if text.strip() else None
    except ValueError:
        raise ConfigError(f"{where}: '{text.strip()}' is not a number") from None


def resolve_bands(config: HealthConfig) -> list[Band]:
    """The default table with ``config.bands`` overrides applied; bands set to ``off`` are dropped."""
    table = {b.name: b for b in BANDS}
    for spec in config.bands:
        where = f"health.bands '{spec}'"
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or name not in table:
            raise ConfigError(f"{where}: expected NAME=LOW:HIGH:ALARM_LOW:ALARM_HIGH with NAME one of "
                              f"{', '.join(BAND_NAMES)}")
        if rest.strip().lower() == "off":
            table[name] = None
            continue
        parts = rest.split(":")
        if len(parts) != 4:
            raise ConfigError(f"{where}: expected 4 ':'-separated bounds, got {len(parts)}")
        low, high, alarm_low, alarm_high = (_parse_bound(p, where) for p in parts)
        if alarm_low is None and alarm_high is None:
            raise ConfigError(f"{where}: give at least one alarm bound (or NAME=off)")
        default = table[name] or next(b for b in BANDS if b.name == name)  # "off" earlier in the list: back on
        table[name] = dataclasses.replace(default, healthy=(low, high), alarm_low=alarm_low, alarm_high=alarm_high)
    return [b for b in table.values() if b is not None]


@dataclass
class Point:
    """One judged value of a band: the step, the raw metric, the measure compared and its state."""

    step: int
    value: float
    measure: float
    state: str  # ok | warn | alarm


@dataclass
class Alert:
    """A band that entered its alarm range. ``str(alert)`` is the one line to print."""

    step: int  # the step at which the alarm was confirmed (after `persistence` steps in alarm)
    alarm_step: int  # the first step of that stretch in alarm
    onset_step: int  # the first step of the stretch outside the healthy band that led to it
    band: Band
    value: float  # the metric at `step`
    measure: float
    evidence: str = ""  # gold bands: the paired comparison with the best evaluation (gold.describe)

    @property
    def failure_mode(self) -> str:
        return self.band.failure_mode

    def __str__(self) -> str:
        b = self.band
        shown = f"{self.value:.4g}" if b.measure == "value" else f"{self.value:.4g} ({self.measure:.3g}{b.unit()})"
        since = f" since step {self.onset_step}" if self.onset_step != self.step else ""
        evidence = f"; {self.evidence}" if self.evidence else ""
        return (f"health alarm at step {self.step}: {b.key} = {shown}, alarm {b.alarm_text()}, healthy "
                f"{b.healthy_text()}; out of band{since}{evidence} -> {b.failure_mode} (see `tether doctor`)")


class _Tracker:
    """Streaming state of one band: its measure's baseline, the current stretches, its trace."""

    def __init__(self, band: Band, config: HealthConfig):
        self.band, self.config = band, config
        self.need = 1 if band.persistence == "once" else getattr(config, band.persistence)
        self.history: list[float] = []  # raw values seen (for the recent/early baselines)
        self.gold = GoldHistory()  # gold bands: the evaluations so far
        self.point: GoldPoint | None = None  # gold bands: the latest evaluation against the best before it
        self.trace: list[Point] = []
        self.seen = 0  # values of the metric seen, judged or not
        self.seen_ok = False
        self.stretch_start: int | None = None  # first step of the current warn/alarm stretch
        self.alarm_start: int | None = None
        self.alarm_len = 0
        self.alerted = False  # an alert has been returned for this band
        self.first_alert: Alert | None = None
        self.beta_start: float | None = None  # the first objective/kl_coef of the rows seen (the run's kl.coef)

    def _measure(self, step: int, value: float, row: dict) -> float | None:
        b, cfg = self.band, self.config
        if b.measure == "value":
            return value
        if b.measure == "recent":
            previous = self.history[-cfg.window:]
            self.history.append(value)
            if len(previous) < min(3, cfg.window):
                return None
            base = statistics.median(previous)
            return value / base if base > 0 else None
        if b.measure in ("early", "rise"):
            self.history.append(value)
            if len(self.history) <= cfg.baseline_steps:
                return None
            base = statistics.median(self.history[:cfg.baseline_steps])
            if b.measure == "rise":
                return value - base
            return value / base if base > 0 else None
        if b.measure == "first":
            self.history.append(value)
            base = self.history[0]
            return value / base if len(self.history) > 1 and base > 0 else None
        # gold: needs a reward and the evaluation's size on the same row; per-problem results when logged
        reward = next((v for k in REWARD_KEYS if (v := _number(row.get(k))) is not None and math.isfinite(v)), None)
        n = _number(row.get("eval/n"))
        if reward is None or n is None or n < 1:
            return None
        correct = row.get("eval/correct")
        self.point = self.gold.update(step, value, int(n), reward,
                                      correct if isinstance(correct, str) else None,
                                      _number(row.get("objective/kl_coef")), self.beta_start)
        return self.point.z if self.point.reward_held == (b.measure == "gold") else 0.0

    def update(self, step: int, row: dict, final: bool = False) -> Alert | None:
        if self.beta_start is None:  # the run's first β: the gold bands judge the β in force against it
            self.beta_start = _number(row.get("objective/kl_coef"))
        value = _number(row.get(self.band.key))
        if value is None:
            return None
        self.seen += 1
        if self.band.warmup and self.seen <= self.config.warmup:
            return None
        if not self.band.applies(row):
            return None
        if self.band.only_if and self.band.only_if[0] == "objective/kl" and "objective/kl" not in row:
            return None  # the KL was not computed (no reference pass, tether.ppo.skips): the band cannot tell
        measure = self._measure(step, value, row)
        if measure is None:
            return None
        state = self.band.state(measure)
        alone = final and self.band.final_confirms and (
            state == "alarm" or (state == "warn" and self.point is not None and self.point.tether_off))
        state = "alarm" if alone else state
        self.trace.append(Point(step, value, measure, state))
        if state == "ok":
            self.seen_ok, self.stretch_start, self.alarm_start, self.alarm_len = True, None, None, 0
            return None
        if self.stretch_start is None:
            self.stretch_start = step
        if state == "warn":
            self.alarm_start, self.alarm_len = None, 0
            return None
        if self.alarm_start is None:
            self.alarm_start = step
        self.alarm_len += 1
        if alone:
            self.alarm_len = max(self.alarm_len, self.need)
        if self.alarm_len < self.need or self.alerted:
            return None
        self.alerted = True
        # A stretch that began with the first judged value has no healthy point before it: its onset is
        # the alarm itself (e.g. explained variance still low at the end of the critic's warm-up).
        onset = self.stretch_start if self.seen_ok else self.alarm_start
        evidence = describe(self.point.to_dict()) if self.point is not None else ""
        self.first_alert = Alert(step, self.alarm_start, onset, self.band, value, measure, evidence)
        return self.first_alert

    @property
    def in_alarm(self) -> bool:
        return self.alarm_len >= self.need


class HealthMonitor:
    """Checks each step's metrics against the bands; used live by the trainer and offline by the doctor.

    ``update`` returns the alerts of bands that *first* enter their alarm range at this step (each band
    alerts once per run; ``reset()`` after a rollback starts afresh). ``healthy`` is False while any band
    is in alarm; a checkpoint saved while ``healthy`` and before an alert's ``onset_step`` is a safe
    rollback target.
    """

    def __init__(self, config: HealthConfig | None = None):
        self.config = config or HealthConfig()
        self.bands = resolve_bands(self.config)
        self.reset()

    def reset(self) -> None:
        self.trackers = {b.name: _Tracker(b, self.config) for b in self.bands}
        self.last_step: int | None = None

    def update(self, step: int, metrics: dict, final: bool = False) -> list[Alert]:
        """``final``: this is the run's last step (bands with ``final_confirms`` alarm without persistence)."""
        self.last_step = step
        return [a for t in self.trackers.values() if (a := t.update(step, metrics, final)) is not None]

    @property
    def healthy(self) -> bool:
        return not any(t.in_alarm for t in self.trackers.values())

    def alerts(self) -> list[Alert]:
        """Every band's first alert so far, in time order of onset (ties: table order)."""
        order = {name: i for i, name in enumerate(BAND_NAMES)}
        found = [t.first_alert for t in self.trackers.values() if t.first_alert is not None]
        return sorted(found, key=lambda a: (a.onset_step, order[a.band.name]))

    def trace(self, name: str) -> list[Point]:
        return self.trackers[name].trace
