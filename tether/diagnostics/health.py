"""Health bands of a PPO run (SPEC D1) and the live monitor that checks them step by step (D3).

The bands are one table of data, :data:`BANDS`: which metric (a key of ``metrics.jsonl``), what it is
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
from tether.diagnostics.gold import GoldHistory, GoldPoint, describe
from tether.errors import ConfigError

# Failure modes, named as in SPEC D2.
KL_EXPLOSION = "KL explosion"
RATIO = "ratio out of control"
VALUE_COLLAPSE = "value collapse"
MODE_COLLAPSE = "mode collapse"
REWARD_HACKING = "reward hacking"
COLLAPSE = "collapse"
NOT_LEARNING = "not learning"
NO_SIGNAL = "no signal in the groups"
SHORTCUT = "shortcut"
TASK_DROPPED = "the check satisfied, the task dropped"  # per problem: tether.diagnostics.shortcut
SAMPLER_MISMATCH = "sampler mismatch"

# What a band's measure is:
#   value   the metric itself
#   recent  metric / median of its previous `window` values          (sudden jumps and drops)
#   early   metric / median of its first `baseline_steps` values     (drift from the start of the run)
#   first   metric / its first value                                   (evaluations: few, far apart)
#   gold    evidence (a one-sided z; tether.diagnostics.gold) that the gold metric fell below its best evaluation
#           so far, at evaluations where the reward kept at least half its gain: "the proxy still says better"
#   gold_collapse  the same evidence at evaluations where the reward fell too
MEASURES = ("value", "recent", "early", "first", "gold", "gold_collapse")
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
    persistence: str = "persistence"  # the HealthConfig field that says how long an alarm must last
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
        return {"recent": "× recent median", "early": "× early median", "first": "× first evaluation", "gold": gold,
                "gold_collapse": gold}.get(
            self.measure, "")


GOLD_WARN, GOLD_ALARM = 2.05, 3.0  # σ of the gold bands' corrected evidence (one-sided p 0.0202, 0.00135)

# The table, in the order of the causal chain of reference D.6 (ratio → KL → value → entropy/length →
# reward hacking): when two bands leave their healthy range at the same step the earlier row is the cause.
BANDS: tuple[Band, ...] = (
    # First in the chain: samples drawn from another distribution than the one PPO scores make every ratio
    # wrong from the start (B19). Only an engine that reports its log-probs gives these; fp32 gives ~1e-14 KL and a
    # 1e-7 gap, a bf16 engine 1e-4–1e-3 KL. One step off (C7) the engine's weights are one update older by design:
    # rows with rollout/staleness > 0 measure that update too, and are left to the ratio bands.
    Band("rollout_mismatch", "rollout/mismatch_kl", "value", (None, 0.002), None, 0.02, SAMPLER_MISMATCH,
         "mean per-token KL(π_engine ‖ π_old) on the sampled tokens: the engine samples another distribution than "
         "PPO scores (its precision or kernels, a missed weight sync, a stale prefix cache); uncorrected "
         "(--rollout-correction none) the policy gradient is biased by it", reported_by_some_runs=True,
         only_if=("rollout/staleness", None, 0)),
    # The gap is the same fault as the mismatch KL seen per token, not an epoch loop gone off-policy: its cures are
    # the sampler's (the correction, the sync, the engine's precision), not smaller steps.
    Band("sampler_gap", "rollout/logprob_gap_mean", "value", (None, 0.01), None, 0.05, SAMPLER_MISMATCH,
         "mean |log π_sampler − log π_old| per response token: the rollout engine samples another distribution "
         "than the one PPO scores (a missed weight sync, a sampling option the engine applied, low precision)",
         reported_by_some_runs=True, only_if=("rollout/staleness", None, 0)),
    Band("ratio_std", "policy/ratio_std", "value", (None, 0.1), None, 0.3, RATIO,
         "spread of π/π_old over the epoch loop; large = the last epochs are far off-policy (IS fails)"),
    Band("clip_fraction", "policy/clip_fraction", "value", (0.05, 0.2), None, 0.5, RATIO,
         "share of tokens whose ratio hit the clip; > 50% = severely off-policy"),
    Band("kl_mean", "objective/kl", "value", (0.01, 0.1), None, 0.5, KL_EXPLOSION,
         "mean per-token KL to the reference; the tether is slipping"),
    # "KL max per token" (reference D.2) judged on the 99th percentile of the batch's per-token KL, not its
    # maximum: the max of B·T single-sample estimates is an extreme-value statistic that grows with batch
    # size and response length, and one token decides it. In the demo's β = 0.2 run (1,000 tokens a step) the
    # max was 6.3 and the 99th percentile 3.5 (exact per-position KL, Σ_v π log(π/π_ref): 5.5 and 3.4), the
    # top tokens a character policy changing a digit the reference held at p = 0.001–0.004. At least 1% of
    # tokens must run away to alarm.
    Band("kl_max", "objective/kl_p99", "value", (None, 1.0), None, 5.0, KL_EXPLOSION,
         "99th percentile of the per-token KL to the reference (its max, robust to a handful of tokens); "
         "high = a share of tokens has run away (gibberish, repetition)"),
    Band("value_loss", "value/loss", "recent", (None, 2.0), None, 5.0, VALUE_COLLAPSE,
         "critic loss against its recent median; should fall, a jump = reward outlier or critic LR too high",
         warmup=True),
    Band("explained_variance", "value/explained_variance", "value", (0.5, None), 0.0, None, VALUE_COLLAPSE,
         "1 − Var[R − V]/Var[R]; < 0 = the critic explains nothing", warmup=True,
         only_if=("value/returns_std", 0.01, None)),  # constant returns: nothing to explain
    Band("entropy", "policy/entropy", "recent", (0.8, None), 0.5, None, MODE_COLLAPSE,
         "policy entropy against its recent median; a sudden drop = the policy collapses onto few outputs"),
    Band("length_collapse", "response/length_mean", "early", (0.67, None), 0.5, None, MODE_COLLAPSE,
         "mean response length against the start of the run; collapse = degenerate short outputs"),
    Band("length_surge", "response/length_mean", "early", (None, 1.5), None, 2.0, REWARD_HACKING,
         "mean response length against the start of the run; surge = the reward model's length bias is gamed"),
    # A drop is judged by its significance, not by a fixed number of points (an evaluation of 250 prompts
    # has a standard error of ~3 points, one of 32 of ~9): the paired exact test of the problems that changed
    # since the best evaluation, times the evaluations the best was chosen from, as a one-sided z. The alarm
    # level is set by simulated flat runs (bench/gold_false_alarms.py, docs/diagnostics.md).
    Band("gold_drop", "eval/accuracy", "gold", (None, GOLD_WARN), None, GOLD_ALARM, REWARD_HACKING,
         "held-out gold metric significantly below its best evaluation (paired on the same problems) while the "
         "reward kept at least half its gain (Goodhart)",
         needs=("eval/n",), final_confirms=True),
    Band("gold_collapse", "eval/accuracy", "gold_collapse", (None, GOLD_WARN), None, GOLD_ALARM, COLLAPSE,
         "held-out gold metric significantly below its best evaluation while the reward fell too: the run got "
         "worse by its own measure as well, a breakdown rather than Goodhart",
         needs=("eval/n",), final_confirms=True),
    # The greedy policy answering every held-out prompt alike (recipe 2's GRPO run: "The answer is 2." to all 100,
    # its 8% accuracy the 8 problems whose answer is 2): no reward or gold band sees a constant guess that scores.
    Band("eval_distinct", "eval/distinct_responses", "first", (0.5, None), 0.25, None, MODE_COLLAPSE,
         "share of distinct held-out responses against the first evaluation; collapse = the same answer to "
         "different prompts", final_confirms=True),
    # A reward that is its own gold (a checker) is blind to a policy that satisfies the check and drops the task (a
    # title repeated in place of the content, a required closing phrase as the whole answer): no gold band sees it.
    # What does: the held-out answers no longer resemble the reference policy's answers to the same prompts while
    # the held-out reward is up. Word-bag F1 with the step-0 answers: 1 at step 0; an arithmetic answer that turns
    # right keeps its words ("The answer is 7." vs "... 5.": 0.75).
    Band("eval_shortcut", "eval/reference_overlap", "value", (0.3, None), 0.15, None, SHORTCUT,
         "word-bag F1 of the held-out answers with the reference policy's (step-0) answers to the same prompts, "
         "judged while the held-out reward is above its step-0 value: low = the reward rose while the answers "
         "stopped resembling the task's (a check satisfied, the task dropped: read the answers)",
         only_if=("eval/reward_gain", 1e-9, None), final_confirms=True, reported_by_some_runs=True),
    # K >= 2 samples per prompt (B17): a group scored all alike gives every group baseline a zero advantage; for a 0/1
    # reward solved with probability p their share is p^K + (1 − p)^K (K = 4: 0.13 at p = 0.5, 0.82 at p = 0.05).
    Band("no_spread", "group/no_spread_fraction", "value", (None, 0.5), None, 0.8, NO_SIGNAL,
         "share of prompt groups whose K samples all got the same score: no signal for a group baseline "
         "(all solved, or none)", reported_by_some_runs=True),
    Band("not_learning", "policy/clip_fraction", "value", (0.05, None), 0.05, None, NOT_LEARNING,
         "clip fraction < 5% for a long stretch while the policy stays at the reference (KL < 0.01): "
         "it barely moves (LR too low? no advantage signal?)",
         persistence="not_learning_steps", only_if=("objective/kl", None, 0.01)),
)
BAND_NAMES = tuple(b.name for b in BANDS)
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
        self.need = getattr(config, band.persistence)
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
        if b.measure == "early":
            self.history.append(value)
            if len(self.history) <= cfg.baseline_steps:
                return None
            base = statistics.median(self.history[:cfg.baseline_steps])
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


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


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
