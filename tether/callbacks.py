"""Callbacks of the Python trainers (:class:`tether.PPOTrainer`, :class:`tether.RewardTrainer`), the record of one
step they receive, and the result a run returns.

A callback is any object with some of these methods (:class:`Callback` has them all, doing nothing):

- ``on_step_end(record)`` — a :class:`StepRecord`, before its row is written; a returned dict of numbers is
  added to the row (``metrics.jsonl`` and the trackers);
- ``on_evaluate(metrics)`` — an evaluation's metrics (a dict returned is added to the row as well);
- ``on_save(path)`` — a checkpoint or a final model directory was written;
- ``on_alert(alert)`` — a health alert (:class:`tether.diagnostics.health.Alert`, or a line of text).

Any of them stops the run by raising :class:`StopTraining`: the step it was called for completes, a checkpoint
is written (the run resumes exactly from it) and the final model is exported, as at the end of a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.errors import TetherError

EVENTS = ("on_step_end", "on_evaluate", "on_save", "on_alert")


class StopTraining(Exception):
    """Raised by a callback to end the run after the current step (the message is the reason recorded)."""


class Callback:
    """A callback doing nothing: subclass it and override the events you need."""

    def on_step_end(self, record: "StepRecord") -> dict | None:
        return None

    def on_evaluate(self, metrics: dict) -> dict | None:
        return None

    def on_save(self, path: Path) -> None:
        return None

    def on_alert(self, alert) -> None:
        return None


@dataclass
class StepRecord:
    """One optimisation step of a run, as the trainer made it."""

    step: int                      # 1-based step number
    metrics: dict[str, Any]        # the metrics row of the step (what metrics.jsonl gets), callbacks' included
    alerts: list = field(default_factory=list)  # health alerts and dropped-row notes raised at this step
    checkpoint: Path | None = None  # the checkpoint written after this step, if one was


@dataclass
class TrainResult:
    """What a finished (or stopped) run left: where, its last metrics, and the saved models."""

    run_dir: Path                  # the run's directory (PPO) or the reward model's (RewardTrainer)
    metrics: dict[str, Any]        # PPO: the last step's row; reward model: the held-out evaluation
    models: dict[str, Path]        # saved model directories by role ("policy", "reward_model")
    steps: int                     # steps done
    stopped: str | None = None     # why the run ended early (a callback's StopTraining, a health alarm)
    model: Any = None              # the trained model object where there is one (RewardTrainer: a RewardModel)


class Callbacks:
    """The callbacks of one run, called in order. A :class:`StopTraining` from one is kept (``stop_reason``)
    and the others still run."""

    def __init__(self, callbacks=()):
        callbacks = [callbacks] if not isinstance(callbacks, (list, tuple)) else list(callbacks)
        for cb in callbacks:
            if not any(callable(getattr(cb, name, None)) for name in EVENTS):
                raise TetherError(f"callbacks: {cb!r} has none of the methods {', '.join(EVENTS)}")
        self.callbacks = callbacks
        self.stop_reason: str | None = None

    def __call__(self, event: str, arg, into: dict | None = None) -> dict:
        """Call ``event`` on every callback that has it; the metrics they return are added to ``into`` (a key
        already there is a one-line error naming the callback). Returns ``into``."""
        into = {} if into is None else into
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            try:
                out = method(arg)
            except StopTraining as stop:
                self.stop_reason = self.stop_reason or (str(stop) or f"{type(cb).__name__}.{event}")
                continue
            if out is not None:
                add_metrics(into, out, f"{type(cb).__name__}.{event}")
        return into


def add_metrics(row: dict, out, where: str) -> None:
    """Add a callback's returned metrics to ``row``: a dict of numbers under string keys, none of them already
    in the row (one-line errors naming the callback ``where``)."""
    if not isinstance(out, dict):
        raise TetherError(f"{where}: returned {type(out).__name__}; return a dict of metrics or None")
    for key, value in out.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TetherError(f"{where}: metric {key!r} = {value!r}; metrics are numbers under string keys")
        if key in row:
            raise TetherError(f"{where}: metric {key!r} is already in the step's row; name yours apart "
                              f"(e.g. 'custom/{key.rsplit('/', 1)[-1]}')")
    row.update(out)
