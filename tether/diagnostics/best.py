"""The best held-out evaluation of a run (issue #54): which evaluation ``--keep-best`` keeps a checkpoint of, and
the one the doctor names when a run fell after it. One rule for both, so the step the doctor names is the step in
``RUN_DIR/best/``.

The measure is the gold bands' (:mod:`tether.diagnostics.gold`): held-out gold accuracy (``eval/accuracy``, the
same problems at every evaluation) where a gold rule exists, otherwise the held-out reward (``eval/reward``, the
same prompts). An evaluation becomes the best when its measure is *strictly higher* than the best so far's; a tie
keeps the earlier one (no evidence the later policy is better, and it has drifted further from the reference).
A plain point estimate, not a paired test against the current best: a test would hold the best at an early
evaluation while a run climbs in steps each too small to be significant against it, and keep a checkpoint worse
than the run reached; the point estimate on the same problems picks the best-measured policy among those
evaluated. The selection is optimistic (the maximum of several noisy evaluations): ``best.json`` records the paired
counts against the evaluation it replaced and how many evaluations it was chosen from, so that a reader can judge
it. A held-out reward is the proxy's own verdict: without a gold rule the best is the reward's best, which reward
hacking can fool. Imports only the standard library and the gold statistics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tether.diagnostics.gold import bits, mcnemar_one_sided

BEST_DIR = "best"  # RUN_DIR/best: the checkpoint of the best evaluation (--keep-best)
BEST_JSON = "best.json"
RULE = ("strictly higher held-out gold accuracy (eval/accuracy) than every earlier evaluation, or, without a gold "
        "rule, strictly higher held-out reward (eval/reward); ties keep the earlier evaluation")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measure_of(row: dict) -> tuple[str, float] | None:
    """("accuracy", eval/accuracy) of an evaluation row, else ("reward", eval/reward); None for a row that is no
    evaluation or whose measure is not finite (a NaN reward: every row failed)."""
    if _finite(row.get("eval/accuracy")):
        return "accuracy", float(row["eval/accuracy"])
    if _finite(row.get("eval/reward")):
        return "reward", float(row["eval/reward"])
    return None


@dataclass
class BestEvaluation:
    """The best evaluation so far: its step, measure (``accuracy`` or ``reward``) and value, its ``n`` held-out
    problems, its per-problem results (``eval/correct``, for the paired counts against the next best), how many
    evaluations were seen when it was chosen, and the paired counts against the best it replaced."""

    step: int
    measure: str
    value: float
    n: int | None = None
    correct: str | None = None
    candidates: int = 1  # evaluations seen up to and including this one
    previous_step: int | None = None  # the best it replaced
    previous_value: float | None = None
    gained: int | None = None  # problems wrong at the previous best, right here (paired, same problems)
    lost: int | None = None
    p_gain: float | None = None  # exact one-sided McNemar p of the gain (information: the rule is the point estimate)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> BestEvaluation | None:
        if not d:
            return None
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})

    def describe(self) -> str:
        """``step 6 (accuracy 62.5% on 8 problems)`` or ``step 6 (reward 0.412)``."""
        if self.measure == "accuracy":
            of = f" on {self.n} problems" if self.n else ""
            return f"step {self.step} (accuracy {100 * self.value:.1f}%{of})"
        return f"step {self.step} (held-out reward {self.value:.4g})"


def consider(best: BestEvaluation | None, row: dict, seen: int) -> BestEvaluation | None:
    """The new best when evaluation ``row`` (a metrics row with ``step``) beats ``best`` by :data:`RULE`, else None.
    ``seen``: the evaluations so far, this one included. An accuracy beats a reward-only best (a gold rule appeared);
    a reward never beats an accuracy."""
    m = measure_of(row)
    if m is None:
        return None
    measure, value = m
    if best is not None and (measure, best.measure) != ("accuracy", "reward"):
        if measure != best.measure or value <= best.value:
            return None
    n = row.get("eval/n") if isinstance(row.get("eval/n"), int) else None
    correct = row.get("eval/correct") if isinstance(row.get("eval/correct"), str) else None
    new = BestEvaluation(int(row["step"]), measure, value, n, correct, seen)
    if best is not None:
        new.previous_step, new.previous_value = best.step, best.value
        if correct is not None and best.correct is not None and len(correct) == len(best.correct):
            now, then = bits(correct), bits(best.correct)
            new.gained, new.lost = (now & ~then).bit_count(), (then & ~now).bit_count()
            new.p_gain = mcnemar_one_sided(new.gained, new.lost)  # the gain's roles swapped, as gain_since_first
    return new


def history_best(rows: list[dict]) -> tuple[BestEvaluation | None, dict | None, int]:
    """(the best evaluation by :data:`RULE`, the last evaluation row, evaluations seen) over a run's metrics rows
    in order — what ``--keep-best`` would have chosen."""
    best, last, seen = None, None, 0
    for row in rows:
        if measure_of(row) is None:
            continue
        seen += 1
        last = row
        best = consider(best, row, seen) or best
    return best, last, seen


def best_on_disk(run_dir: str | Path) -> BestEvaluation | None:
    """``RUN_DIR/best/best.json`` as a :class:`BestEvaluation` (None when absent or unreadable)."""
    import json

    path = Path(run_dir) / BEST_DIR / BEST_JSON
    try:
        return BestEvaluation.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def fell_from_best(rows: list[dict]) -> tuple[BestEvaluation, dict] | None:
    """(best, last evaluation row) when the run's last evaluation is below its best, an earlier one; else None."""
    best, last, _ = history_best(rows)
    if best is None or last is None or int(last["step"]) == best.step:
        return None
    m = measure_of(last)
    if m is None or m[0] != best.measure or m[1] >= best.value:
        return None
    return best, last


def best_prescription(rows: list[dict], run_dir: str | Path) -> str | None:
    """The doctor's line for a run that fell after its best evaluation: which step was best, and where its weights
    are — ``RUN_DIR/best`` (``--keep-best``), a periodic checkpoint of that step, or nowhere. None when the last
    evaluation is the best (nothing to go back to)."""
    fell = fell_from_best(rows)
    if fell is None:
        return None
    best, last = fell
    run_dir = Path(run_dir)
    _, now = measure_of(last)
    now_text = f"{100 * now:.1f}%" if best.measure == "accuracy" else f"{now:.4g}"
    head = f"the best held-out evaluation was {best.describe()}; the last, step {last['step']}: {now_text}"
    kept = best_on_disk(run_dir)
    if kept is not None and kept.step == best.step:
        where = run_dir / BEST_DIR
        return (f"{head}. Its checkpoint is {where} (--keep-best; best.json): {where / 'model'} is the policy as a "
                f"plain model — start a new run from it with `tether ppo --policy {where / 'model'} ...`, or load it "
                f"with from_pretrained (tether has no --resume-from or export command; `tether ppo --resume` continues "
                f"from the newest periodic checkpoint, not from best/)")
    periodic = run_dir / "checkpoints" / f"step_{best.step:06d}"
    if (periodic / "trainer_state.pt").is_file():
        return (f"{head}. A checkpoint of that step is on disk: {periodic} ({periodic / 'policy'} holds its weights, "
                f"without the tokenizer); --keep-best would have kept it in {run_dir / BEST_DIR}")
    other = f" ({BEST_DIR}/ holds step {kept.step})" if kept is not None else ""
    return (f"{head}. No checkpoint of step {best.step} is on disk{other}: rerun with --keep-best "
            f"(eval.keep_best) to keep the best evaluation's checkpoint in {run_dir / BEST_DIR}")


def add_best(d, rows: list[dict], run_dir: str | Path, run_config: dict) -> None:
    """Name the best evaluation in a doctor's :class:`~tether.diagnostics.doctor.Diagnosis` ``d`` of a run that is not
    HEALTHY and fell after its best (:func:`best_prescription`): an unhealthy run's first prescription (its key
    ``eval.keep_best``, suggested on when the run did not keep it), a warned run's note (no warning of its own)."""
    if d.level == "HEALTHY":
        return
    line = best_prescription(rows, run_dir)
    if line is None:
        return
    if d.healthy:
        d.notes.append(f"best evaluation: {line}")
        return
    kept = bool((run_config.get("eval") or {}).get("keep_best"))
    d.prescriptions.insert(0, {"priority": None, "action": line, "key": "eval.keep_best", "current": kept,
                               "suggestion": None if kept else "true", "in_place": False})
    for i, p in enumerate((p for p in d.prescriptions if not p["in_place"]), 1):
        p["priority"] = i
