"""``tether doctor RUN_DIR``: read a PPO run's metrics, find the cause, name the failure mode, prescribe (D2).

The cause is the first metric, in time, to leave its healthy band on the way to an alarm; later alarms are
symptoms ("the earliest abnormal metric is the real cause", reference D.6) — except a significant fall of
the held-out gold metric while the reward keeps its gain (``gold_drop``, judged on per-problem results
paired between evaluations): it measures the outcome against the task's truth, so it is the verdict (reward
hacking) whenever it alarms, and the bands that left earlier (typically the KL, with β = 0) are the route the
run took. The rules are :mod:`tether.diagnostics.health`'s, replayed over ``metrics.jsonl`` (per-problem
results from ``samples/`` for older runs) by the monitor that raises live alerts. Prescriptions come from
reference §D (D.2–D.5), in priority order, each with its config key, the run's current value and a
suggestion. It also says where a step's time went (C2): mean seconds per phase and the rollout share.

The headline has three levels (:mod:`tether.diagnostics.headline`): HEALTHY, WARNING (no alarm, but the held-out
evaluations say the run did not do what it should) and UNHEALTHY; a reward with no signal ranks above every band.

Exit code: 0 healthy or warning, 1 unhealthy, 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from tether.config import config_from_dict
from tether.diagnostics.best import add_best
from tether.diagnostics.gold import describe, with_problem_results
from tether.diagnostics.groups import flat_groups_prescriptions
from tether.diagnostics.hangs import format_hang, read_hangs
from tether.diagnostics.headline import (FLAT_KEY, FLAT_REWARD, collapsed_answers, flat_evidence, flat_reward,
                                         is_warning, level)
from tether.diagnostics.health import (BANDS, GOLD_MEASURES, NO_SIGNAL, NOT_LEARNING, SHORTCUT, TASK_DROPPED, Alert,
                                       HealthConfig, HealthMonitor)
from tether.diagnostics.heldout import (REWARD_WITHOUT_GOLD, gold_fell, gold_summary, gold_vouches, reward_without_gold,
                                        vouched_reason)
from tether.diagnostics.phases import (PHASES, SCORE_SPLIT, config_value, format_phases, phase_seconds,  # noqa: F401
                                       rollout_layout)
from tether.diagnostics.prescriptions import PRESCRIPTIONS, Rx
from tether.diagnostics.shortcut import add_verdict, judge_run
from tether.errors import TetherError

@dataclass
class Diagnosis:
    """The doctor's verdict on one run."""

    healthy: bool
    failure_mode: str | None
    cause_metric: str | None  # a key of metrics.jsonl
    cause_band: str | None  # a name in tether.diagnostics.health.BANDS
    first_step: int | None  # the step the cause left its healthy band
    alarm_step: int | None  # the first step of its alarm
    evidence: dict = field(default_factory=dict)
    prescriptions: list[dict] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # bands whose metric (or a key it needs) never appears
    n_steps: int = 0
    phases: dict = field(default_factory=dict)  # phase -> mean seconds per step (C2), see phase_seconds
    gold: list[dict] = field(default_factory=list)  # each evaluation against the best before it (GoldPoint)
    notes: list[str] = field(default_factory=list)  # warnings that are no alarm (a gold fall not confirmed)
    layout: str = ""  # the rollout layout the phases were measured in (C4), see rollout_layout
    hang: dict = field(default_factory=dict)  # the run's first stall (several processes), see read_hangs

    def to_dict(self) -> dict:
        return {**asdict(self), "level": self.level}

    @property
    def level(self) -> str:
        """HEALTHY, WARNING or UNHEALTHY (:func:`tether.diagnostics.headline.level`)."""
        return level(self.healthy, self.notes)

    @property
    def warnings(self) -> list[str]:
        """The notes that make a healthy run's headline a WARNING, each by its title."""
        return [_title(n) for n in self.notes if is_warning(n)]

    @property
    def reward_without_gold(self) -> bool:
        """The held-out reward rose significantly while gold accuracy did not (the heldout module's warning)."""
        return any(n.startswith(REWARD_WITHOUT_GOLD) for n in self.notes)

    def summary(self) -> str:
        if self.healthy:
            warned = f"; {', '.join(self.warnings)}" if self.warnings else ""
            return f"{self.level.lower()} ({self.n_steps} steps, no band in alarm{warned})"
        return (f"{self.failure_mode}: {self.cause_metric} left its healthy band at step {self.first_step}"
                f" (alarm at step {self.alarm_step})")


def _title(note: str) -> str:
    """A warning note's title: "reward hacking, not confirmed" of "warning (reward hacking, not confirmed): ...",
    "reward without gold" of "reward without gold: ..."."""
    if note.startswith("warning (") and ")" in note:
        return note[len("warning ("):note.index(")")]
    return note.split(":")[0]


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (blank lines skipped); one-line errors name file and line."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TetherError(f"{run_dir}: run directory not found")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise TetherError(f"{path}: not found (is {run_dir} a `tether ppo` run directory?)")
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TetherError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TetherError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
            # a row without a step is placed after the previous one
            if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
                row["step"] = rows[-1]["step"] + 1 if rows else 1
            rows.append(row)
    if not rows:
        raise TetherError(f"{path}: no metric rows")
    return rows


def load_run_config(run_dir: str | Path) -> dict:
    """The run's resolved ``config.yaml`` as a dict ({} when absent)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise TetherError(f"{path}: unreadable YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise TetherError(f"{path}: expected a mapping at the top level")
    return data


def health_config_from_run(run_config: dict) -> HealthConfig:
    """The ``health`` section of a run's config (defaults where absent)."""
    section = run_config.get("health") or {}
    return config_from_dict(HealthConfig, section, where="config.yaml health") if section else HealthConfig()


def _point(p) -> dict:
    return {"step": p.step, "value": _clean(p.value), "measure": _clean(p.measure), "state": p.state}


def _clean(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no NaN/inf


def _evidence(alert: Alert, monitor: HealthMonitor, others: list[Alert]) -> dict:
    b = alert.band
    trace = monitor.trace(b.name)
    onset = next(p for p in trace if p.step == alert.onset_step)
    alarm = next(p for p in trace if p.step == alert.alarm_step)
    sign = 1.0 if b.alarm_high is not None else -1.0
    peak = max(trace, key=lambda p: sign * p.measure if math.isfinite(p.measure) else math.inf)
    i0 = max(0, trace.index(onset) - 3)
    i1 = trace.index(alarm) + 4
    return {
        "band": b.name, "key": b.key, "measure": b.measure, "meaning": b.meaning,
        "healthy": b.healthy_text(), "alarm": b.alarm_text(),
        "onset": _point(onset), "first_alarm": _point(alarm), "peak": _point(peak),
        "series": [_point(p) for p in trace[i0:i1]],
        "chain": [{"band": a.band.name, "key": a.band.key, "failure_mode": a.failure_mode,
                   "onset_step": a.onset_step, "alarm_step": a.alarm_step} for a in others],
    }


def _prescribe(mode: str, run_config: dict, rows: list[dict] = (), since_step: int = 0) -> list[dict]:
    """The mode's prescriptions with the run's current values: those to try, numbered in priority order, then
    those the run already follows (``in_place``, no priority)."""
    rxs = [Rx(*rx) for rx in flat_groups_prescriptions(rows, since_step)] if mode == NO_SIGNAL else PRESCRIPTIONS[mode]
    out = []
    for rx in rxs:
        current = config_value(run_config, rx.key) if rx.key else None
        in_place = current is not None and rx.done(current)
        out.append({"priority": None, "action": rx.action, "key": rx.key, "current": current,
                    "suggestion": None if in_place or not rx.key else rx.suggest(current), "in_place": in_place})
    out.sort(key=lambda p: p["in_place"])  # stable: the priority order within each part
    for i, p in enumerate((p for p in out if not p["in_place"]), 1):
        p["priority"] = i
    return out


def diagnose(rows: list[dict], config: HealthConfig | None = None, *, run_config: dict | None = None
             ) -> Diagnosis:
    """Replay ``rows`` (metrics.jsonl) through the health monitor and name the cause.

    Cause = a reward with no signal over the first steps (:func:`~tether.diagnostics.headline.flat_reward`) above
    all; else the alarmed band with the earliest onset (ties: the order of the D.6 chain), except that an alarmed
    gold band (reward hacking measured against the truth) is the cause whenever present; "not learning" is named
    only when nothing else alarmed. Alarms a held-out gain covers are notes (:func:`_vouch`); the warnings of
    :mod:`tether.diagnostics.heldout` make a healthy run's headline a WARNING. ``run_config`` (the run's
    config.yaml) fills in current values.
    """
    monitor = HealthMonitor(config)
    planned = (run_config or {}).get("steps")  # the last row is the run's final step only if it reached it
    finished = bool(rows) and isinstance(planned, int) and int(rows[-1]["step"]) >= planned
    for i, row in enumerate(rows):
        monitor.update(int(row["step"]), row, final=finished and i == len(rows) - 1)
    present = {k for row in rows for k in row}
    # a critic-free run (B17) has no value metrics by design: its value bands are not "unchecked", they do not apply
    no_critic = config_value(run_config or {}, "advantage.estimator") not in (None, "gae")
    # nor has a run that skipped the reference pass (β = 0 throughout, kl.reference auto: tether.ppo.skips) its KL
    no_kl = "objective/kl" not in present and "objective/kl_coef" in present
    unchecked = [b.name for b in monitor.bands if not {b.key, *b.needs} <= present and not b.reported_by_some_runs
                 and not (no_critic and b.key.startswith("value/"))
                 and not (no_kl and b.key.startswith("objective/kl"))]
    gold, notes = gold_summary(monitor)
    notes += reward_without_gold(monitor, rows) or ([] if notes else gold_fell(monitor))
    alerts, vouched = _vouch(monitor.alerts(), monitor, rows)
    notes = vouched + notes
    failures = [a for a in alerts if a.failure_mode != NOT_LEARNING] or alerts
    # steps trained: step 0's row is the evaluation before the first step, not a step
    common = dict(unchecked=unchecked, n_steps=sum(int(r["step"]) > 0 for r in rows), phases=phase_seconds(rows), gold=gold, notes=notes,
                  layout=rollout_layout(run_config or {}))
    flat = flat_reward(rows, monitor.config.baseline_steps)
    if flat is not None:  # ranked above every band: with no signal, the bands describe a drift on noise
        return _flat_verdict(flat, rows, failures, run_config or {}, common)
    if not failures:
        return Diagnosis(True, None, None, None, None, None, **common)
    outcome = [a for a in failures if a.band.measure == "gold"]  # reward hacking, measured against the truth
    cause = outcome[0] if outcome else failures[0]
    rest = [a for a in failures if a is not cause]
    return Diagnosis(
        healthy=False, failure_mode=cause.failure_mode, cause_metric=cause.band.key, cause_band=cause.band.name,
        first_step=cause.onset_step, alarm_step=cause.alarm_step,
        evidence=_evidence(cause, monitor, rest),
        prescriptions=_prescribe(cause.failure_mode, run_config or {}, rows, cause.onset_step), **common)


def _vouch(alerts: list[Alert], monitor: HealthMonitor, rows: list[dict]) -> tuple[list[Alert], list[str]]:
    """The alerts that stand, and a note for each a held-out gain vouches against (:func:`gold_vouches`; which
    alarms it may answer: :func:`~tether.diagnostics.heldout.vouched_reason`)."""
    vouch = gold_vouches(monitor)
    if vouch is None:  # the outcome measured on held-out problems contradicts what these bands predict
        return alerts, []
    step, why = vouch
    overruled = [(a, reason) for a in alerts if (reason := vouched_reason(a, monitor, rows, step)) is not None]
    return [a for a in alerts if all(a is not b for b, _ in overruled)], [
        f"{a.failure_mode} not counted ({a.band.key} in alarm from step {a.alarm_step}): {reason}{why}"
        for a, reason in overruled]


def _flat_verdict(flat: dict, rows: list[dict], failures: list[Alert], run_config: dict, common: dict) -> Diagnosis:
    """The verdict when every score of the first steps was identical (:func:`tether.diagnostics.headline.flat_reward`):
    the reward first, the bands that alarmed after it as what followed, collapsed answers named."""
    chain = [{"band": a.band.name, "key": a.band.key, "failure_mode": a.failure_mode, "onset_step": a.onset_step,
              "alarm_step": a.alarm_step} for a in failures]
    evidence = flat_evidence(flat, rows, chain)
    collapsed = collapsed_answers(rows)
    if collapsed:
        evidence["answers_collapsed"] = collapsed.split(" are ")[1].split(" (")[0]
        common["notes"] = [collapsed] + common["notes"]
    return Diagnosis(False, FLAT_REWARD, FLAT_KEY, "flat_reward", flat["steps"][0], flat["steps"][-1],
                     evidence=evidence, prescriptions=_prescribe(FLAT_REWARD, run_config, rows), **common)


def diagnose_run(run_dir: str | Path, config: HealthConfig | None = None) -> Diagnosis:
    """Load a run directory and diagnose it, with the health settings of its config unless given. A shortcut's
    evidence carries held-out answers beside the reference's, from the evaluation where it alarmed."""
    run_config = load_run_config(run_dir)
    rows = with_problem_results(load_metrics(run_dir), run_dir)
    d = diagnose(rows, config or health_config_from_run(run_config), run_config=run_config)
    if d.failure_mode == SHORTCUT:
        d.evidence["answers"] = answers_beside_reference(run_dir, d.alarm_step)
    # per problem: tether.diagnostics.shortcut
    add_verdict(d, judge_run(run_dir, rows), _prescribe(TASK_DROPPED, run_config))
    d.hang = read_hangs(run_dir)
    add_best(d, rows, run_dir, run_config)  # a run that fell: the best evaluation's step and where its weights are
    return d


def answers_beside_reference(run_dir: str | Path, step: int, n: int = 3) -> list[dict]:
    """Up to ``n`` held-out samples of the evaluation at ``step`` (samples/step_K.jsonl) that carry the reference
    policy's answer, least alike first (word-bag F1)."""
    path = Path(run_dir) / "samples" / f"step_{step}.jsonl"
    if not path.is_file():
        return []
    samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    paired = [s for s in samples if isinstance(s.get("reference"), str)]
    from tether.diagnostics.text import word_f1

    return sorted(({"prompt": s.get("prompt"), "response": s["response"], "reference": s["reference"],
                    "overlap": word_f1(s["response"], s["reference"])} for s in paired),
                  key=lambda s: s["overlap"])[:n]


def _short(text: str, n: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def format_diagnosis(d: Diagnosis, run_dir: str | Path = "") -> str:
    """The doctor's verdict as plain text (what `tether doctor` prints)."""
    head = f"{run_dir}: " if run_dir else ""
    if d.healthy:
        vouched = sum(" not counted (" in n for n in d.notes)
        quiet = (f"no band reached its alarm in {d.n_steps} steps" if not vouched else
                 f"no alarm stands in {d.n_steps} steps ({vouched} answered by the held-out evaluation, below)")
        lines = [f"{head}HEALTHY: {quiet}" if not d.warnings else
                 f"{head}WARNING: {'; '.join(d.warnings)} (below); {quiet}"]
    else:
        e = d.evidence
        unit = "" if e["measure"] == "value" else f" ({e['measure']} measure)"
        collapsed = f"; answers collapsed ({e['answers_collapsed']})" if e.get("answers_collapsed") else ""
        lines = [f"{head}UNHEALTHY: {d.failure_mode}{collapsed}",
                 f"cause: {d.cause_metric}{unit} left its healthy band ({e['healthy']}) at step {d.first_step}"
                 f" ({_fmt(e['onset']['measure'])}), alarm ({e['alarm']}) from step {d.alarm_step}"
                 f" ({_fmt(e['first_alarm']['measure'])}); peak {_fmt(e['peak']['measure'])} at step "
                 f"{e['peak']['step']}",
                 f"  meaning: {e['meaning']}",
                 "  evidence: " + ", ".join(f"step {p['step']}: {_fmt(p['measure'])} {p['state']}"
                                            for p in e["series"])]
        for a in e.get("answers", []):  # a shortcut is read in the answers
            if a.get("prompt") and a.get("signals"):  # the per-problem detector's: the prompt and what it saw
                lines.append(f"  prompt: {_short(a['prompt'])!r} ({', '.join(a['signals'])})")
            lines.append(f"  answer (overlap {a['overlap']:.2f}): {_short(a['response'])!r}  |  reference: "
                         f"{_short(a['reference'])!r}")
        if e["measure"] in GOLD_MEASURES:  # the paired comparisons at the alarm and at the last evaluation
            lines += ["  paired: " + describe(p) for p in d.gold if p["step"] in (d.alarm_step, d.gold[-1]["step"])]
        before = [c for c in e["chain"] if c["onset_step"] < d.first_step]
        for title, chain in (("what led there (bands out of band before it, in order):", before),
                             ("what followed (symptoms, in order):", [c for c in e["chain"] if c not in before])):
            if chain:
                lines.append(title)
                lines += [f"  step {c['onset_step']:>5}  {c['key']:<28} {c['failure_mode']} (alarm at step "
                          f"{c['alarm_step']})" for c in chain]
        lines.append("prescriptions (in priority order):")
        for p in (p for p in d.prescriptions if not p["in_place"]):
            key = ""
            if p["key"]:
                now = "" if p["current"] is None else f" (now {p['current']})"
                key = f"  [{p['key']}{now}" + (f" -> {p['suggestion']}" if p["suggestion"] else "") + "]"
            lines.append(f"  {p['priority']}. {p['action']}{key}")
        in_place = [p for p in d.prescriptions if p["in_place"]]
        if in_place:
            lines.append("already in place (this run does these): " + "; ".join(
                f"{p['key']} = {p['current']} ({p['action'].split(':')[0].split(' (')[0]})" for p in in_place))
    lines += d.notes
    if d.unchecked:
        lines.append(f"not checked (metric absent): {', '.join(d.unchecked)}")
    if d.phases and sum(d.phases.values()):
        lines.append(format_phases(d.phases, d.layout))
    return "\n".join(([format_hang(d.hang, run_dir)] if d.hang else []) + lines)  # a stall first: it names the rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `tether ppo` run directory (holds metrics.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object")
    parser.add_argument("--persistence", type=int, default=None, metavar="N",
                        help="steps a metric must stay in alarm to count [default: the run's health config, 2]")
    parser.add_argument("--band", action="append", default=[], metavar="NAME=LOW:HIGH:ALARM_LOW:ALARM_HIGH",
                        help=f"override a health band (or NAME=off); names: {', '.join(b.name for b in BANDS)}")


def run(args: argparse.Namespace) -> int:
    run_config = load_run_config(args.run_dir) if Path(args.run_dir).is_dir() else {}
    config = health_config_from_run(run_config)
    if args.persistence is not None:
        if args.persistence < 1:
            raise TetherError(f"--persistence: must be >= 1, got {args.persistence}")
        config.persistence = args.persistence
    config.bands = list(config.bands) + list(args.band)
    config.validate()
    hang = read_hangs(args.run_dir) if Path(args.run_dir).is_dir() else {}
    try:
        rows = with_problem_results(load_metrics(args.run_dir), args.run_dir)
    except TetherError:
        if not hang:
            raise
        # stalled before its first metrics row: the stall is the verdict
        print(json.dumps({"hang": hang}, ensure_ascii=False) if args.json else format_hang(hang, args.run_dir))
        return 1
    d = diagnose(rows, config, run_config=run_config)
    d.hang = hang
    add_verdict(d, judge_run(args.run_dir, rows), _prescribe(TASK_DROPPED, run_config))  # held-out answers, per problem
    add_best(d, rows, args.run_dir, run_config)
    if args.json:
        print(json.dumps(d.to_dict(), ensure_ascii=False))
    else:
        print(format_diagnosis(d, args.run_dir))
    return 0 if d.healthy and d.hang.get("stalled", {}).get("ended", True) else 1  # a stall never left: 1
