"""The doctor's headline in three levels, and the checks that rank above the bands (D2, issue 51).

- **UNHEALTHY**: a band (or a check below) is in alarm: the verdict names it, its evidence and prescriptions.
- **WARNING**: nothing alarmed, but something says the run did not do what it should: the reward rose without the
  gold metric, gold fell without reaching significance, a gold band or the shortcut detector past its warning level.
- **HEALTHY**: neither.

A reward with no signal comes first of all: when every score is identical over the run's first steps, no estimator
has anything to learn from and every later band only describes a policy drifting on noise (issue 51: a run scored
0.000 on every row, its answers collapsed to two, was called healthy, and "not learning" put "raise the actor
learning rate" above the reward). Imports only the standard library.
"""

from __future__ import annotations

import math

FLAT_REWARD = "no reward signal"
FLAT_KEY = "objective/scores_raw"
COLLAPSED_SHARE = 0.25  # distinct held-out answers per answer at or below this is "collapsed" (2 distinct in 8)
# The note prefixes that make a healthy run's headline a WARNING (the heldout module's, the gold bands' and the
# shortcut detector's "warning (...)" lines). "... not counted (...)" notes are a held-out gain vouching: healthy.
WARNING_PREFIXES = ("warning", "reward without gold", "gold fell", "answers collapsed")


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _no_spread(row: dict) -> bool | None:
    """Whether the step's scores were all identical, where the row says: ``objective/scores_std`` 0, or (K ≥ 2)
    every group flat and each counted both solved and unsolved (all samples of the step alike). None: unknown."""
    std = _number(row.get("objective/scores_std"))
    if std is not None:
        return std <= 1e-12
    flat, solved, unsolved = (_number(row.get(k)) for k in ("group/no_spread_fraction", "group/solved_fraction",
                                                            "group/unsolved_fraction"))
    if flat is not None and solved is not None and unsolved is not None:
        return flat >= 1.0 and solved >= 1.0 and unsolved >= 1.0
    return None


def flat_reward(rows: list[dict], first_steps: int = 5) -> dict | None:
    """The first ``first_steps`` training steps (all of them in a shorter run; at least 2) when every score in them
    was identical: the same mean raw score (``objective/scores_raw``, else ``objective/scores``) at each step, and no
    spread within any step that says (:func:`_no_spread`). Runs that log no spread at all are judged by the means
    alone (identical to 1e-9 over the steps: a reward that varies does not repeat its batch mean exactly).
    Returns ``{"steps": [...], "score": s, "spread_known": bool}`` or None."""
    trained = [r for r in rows if _number(r.get(FLAT_KEY, r.get("objective/scores"))) is not None
               and int(r.get("step", 0)) > 0][:first_steps]
    if len(trained) < 2:
        return None
    means = [_number(r.get(FLAT_KEY, r.get("objective/scores"))) for r in trained]
    if max(means) - min(means) > 1e-9 * max(1.0, abs(means[0])):
        return None
    spread = [_no_spread(r) for r in trained]
    if any(s is False for s in spread):
        return None
    return {"steps": [int(r["step"]) for r in trained], "score": means[0],
            "spread_known": all(s is not None for s in spread)}


def collapsed_answers(rows: list[dict]) -> str | None:
    """A line naming the last evaluation's answers when they are collapsed: at most :data:`COLLAPSED_SHARE` of them
    distinct (``eval/distinct_responses`` × ``eval/n``, e.g. 2 distinct in 8). None otherwise, or without an
    evaluation."""
    last = next((r for r in reversed(rows) if _number(r.get("eval/distinct_responses")) is not None), None)
    if last is None:
        return None
    share, n = last["eval/distinct_responses"], _number(last.get("eval/n"))
    if share > COLLAPSED_SHARE:
        return None
    count = f"{round(share * n)} distinct in {int(n)}" if n else f"{share:.2f} of them distinct"
    return (f"answers collapsed: the held-out answers at step {last['step']} are {count} (the same answer to "
            f"different prompts); read them")


def flat_evidence(flat: dict, rows: list[dict], chain: list[dict]) -> dict:
    """The evidence of a flat-reward verdict in the shape of a band's (:func:`tether.diagnostics.doctor._evidence`)."""
    def point(step):
        row = next(r for r in rows if r.get("step") == step)
        value = _number(row.get(FLAT_KEY, row.get("objective/scores")))
        return {"step": step, "value": value, "measure": value, "state": "alarm"}

    steps = flat["steps"]
    how = "and no spread within any step" if flat["spread_known"] else "(no spread logged: judged by the means)"
    return {"band": "flat_reward", "key": FLAT_KEY, "measure": "value",
            "meaning": f"every score of the first {len(steps)} steps is {flat['score']:.4g} {how}: no sample was "
                       "better than another, so no estimator has a gradient to follow",
            "healthy": "scores that vary", "alarm": f"every score identical over the first {len(steps)} steps",
            "onset": point(steps[0]), "first_alarm": point(steps[-1]), "peak": point(steps[-1]),
            "series": [point(s) for s in steps], "chain": chain}


def is_warning(note: str) -> bool:
    return note.startswith(WARNING_PREFIXES)


def level(healthy: bool, notes: list[str]) -> str:
    """HEALTHY, WARNING or UNHEALTHY (module docstring)."""
    if not healthy:
        return "UNHEALTHY"
    return "WARNING" if any(is_warning(n) for n in notes) else "HEALTHY"
