"""The hang watchdog of a multi-process run: a daemon thread per process that knows the phase its process is in,
and since when, and says so once when that phase outlasts a bound.

Why: a process stuck before a collective (a reward call that never returns, a slow disk, a deadlock) leaves every
other process waiting in the next collective until the collective timeout (``collective_timeout_minutes``, 60)
fails the run with no word of which process or phase. With the watchdog each process writes, after
``health.hang_seconds`` in one phase, one line on stderr and one row in ``alerts.jsonl`` naming its rank, the phase,
the step, since when (UTC) and for how long, plus the stacks of its threads (``faulthandler``) in
``hang_stacks_rank{R}.txt``; when the phase then ends, one more row says after how long (``hang_end``). The stalled
process shows as "in phase X", the others as waiting in the phase after it; ``tether doctor`` reads the rows
(:mod:`tether.diagnostics.hangs`).

Phases are marked by :func:`mark` (the PPO step's :class:`~tether.ppo.perf.PhaseTimer` marks its blocks, the
trainer the evaluation and checkpoint); with no watchdog started it does nothing. Imports only the standard library
and :mod:`tether.errors`.

Test hook (tests only; harmless otherwise, it does nothing unless set): ``TETHER_TEST_STALL="rank=1,phase=reward,
seconds=5[,step=2]"`` makes that rank sleep that long on entering that phase (the first time, or at that step).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tether.errors import ConfigError

STALL_ENV = "TETHER_TEST_STALL"


def utc(epoch: float) -> str:
    """``epoch`` seconds as ``2026-12-07T05:40:01Z``."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Hang:
    """One process in one phase past the bound (``ended`` False), or that phase's end after an alert (True)."""

    rank: int
    phase: str
    step: int
    since: float     # wall-clock epoch seconds the phase began
    seconds: float   # how long it had lasted when this was written
    seq: int         # phases entered so far on this process: the process with the smallest is the one behind
    ended: bool = False

    def line(self) -> str:
        if self.ended:
            return (f"rank {self.rank} left phase '{self.phase}' of step {self.step} after {self.seconds:.1f} s "
                    f"(since {utc(self.since)})")
        return (f"rank {self.rank} in phase '{self.phase}' at step {self.step} for {self.seconds:.1f} s "
                f"(since {utc(self.since)}): a stall, or waiting for a process that is")

    def record(self) -> dict:
        """The ``alerts.jsonl`` row (``step`` and ``alert`` as every alert row has them)."""
        return {"step": self.step, "alert": self.line(), "kind": "hang_end" if self.ended else "hang",
                "rank": self.rank, "phase": self.phase, "since": utc(self.since), "seconds": round(self.seconds, 2),
                "seq": self.seq}


@dataclass(frozen=True)
class Stall:
    """The test hook's stall (:data:`STALL_ENV`)."""

    rank: int
    phase: str
    seconds: float
    step: int | None = None


def stall_from_env(value: str | None) -> Stall | None:
    """``rank=1,phase=reward,seconds=5[,step=2]`` as a :class:`Stall`; None when unset; a one-line error otherwise."""
    if not value:
        return None
    fields = dict(part.split("=", 1) for part in value.split(",") if "=" in part)
    try:
        return Stall(int(fields["rank"]), fields["phase"], float(fields["seconds"]),
                     int(fields["step"]) if "step" in fields else None)
    except (KeyError, ValueError):
        raise ConfigError(f"{STALL_ENV}={value!r}: expected rank=R,phase=NAME,seconds=S[,step=N] "
                          "(a test hook; unset it)") from None


class Watchdog:
    """The phase this process is in, and a thread that calls ``report(Hang)`` once when it lasts past
    ``bound_s`` (and once more when that phase ends). ``clock``/``wall``: monotonic and epoch seconds (a test's
    fake clock); :meth:`check` is the thread's whole judgement, callable directly."""

    def __init__(self, bound_s: float, rank: int, report: Callable[[Hang], None], clock=time.monotonic,
                 wall=time.time, stall: Stall | None = None):
        self.bound, self.rank, self.report = float(bound_s), rank, report
        self.clock, self.wall, self.stall = clock, wall, stall
        self.step_no, self.seq = 0, 0
        self._state: tuple | None = None   # (phase, step, since clock, since wall, seq); None: not watched
        self._alerted: tuple | None = None  # the state an alert was written for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, phase: str | None) -> None:
        """This process is now in ``phase`` (None: idle, not watched: between steps, in a script's hands)."""
        with self._lock:
            ended, now = self._alerted if self._alerted is self._state else None, self.clock()
            self.seq += 1
            self._state = None if phase is None else (phase, self.step_no, now, self.wall(), self.seq)
        if ended is not None:
            self.report(Hang(self.rank, ended[0], ended[1], ended[3], now - ended[2], ended[4], ended=True))
        s = self.stall
        if s is not None and phase == s.phase and self.rank == s.rank and s.step in (None, self.step_no):
            self.stall = None  # once
            time.sleep(s.seconds)

    @contextmanager
    def phase(self, name: str):
        """``name`` for the block; after it, ``after NAME`` (the collectives that follow a block belong to it)."""
        self.enter(name)
        try:
            yield
        finally:
            self.enter(f"after {name}")

    def check(self) -> Hang | None:
        """The alert due now: the current phase has lasted at least the bound and has had none yet."""
        with self._lock:
            state = self._state
            if state is None or state is self._alerted or self.clock() - state[2] < self.bound:
                return None
            self._alerted = state
        return Hang(self.rank, state[0], state[1], state[3], self.clock() - state[2], state[4])

    def start(self) -> Watchdog:
        """Start the thread and make this the process's watchdog (:func:`mark`)."""
        global _current
        poll = max(0.05, min(self.bound / 4, 5.0))  # an alert comes at most a quarter of the bound late

        def watch():
            while not self._stop.wait(poll):
                hang = self.check()
                if hang is not None:
                    self.report(hang)

        self._thread = threading.Thread(target=watch, name="tether-watchdog", daemon=True)
        self._thread.start()
        _current = self
        return self

    def stop(self) -> None:
        """Stop watching; a phase that alerted ends here (its ``hang_end`` row: the run went on to its end)."""
        global _current
        if _current is self:
            _current = None
        self.enter(None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


_current: Watchdog | None = None


def mark(phase: str | None) -> None:
    """This process is now in ``phase`` (the process's watchdog, if one runs)."""
    if _current is not None:
        _current.enter(phase)


def mark_step(step: int) -> None:
    """The phases marked from now on belong to ``step``."""
    if _current is not None:
        _current.step_no = step


@contextmanager
def phase(name: str):
    """``with phase("eval"):`` marks the block (:meth:`Watchdog.phase`); nothing without a watchdog."""
    if _current is None:
        yield
        return
    with _current.phase(name):
        yield


def alert_writer(run_dir: Path, stream=None) -> Callable[[Hang], None]:
    """What a hang does on this process: one line on ``stream`` (stderr), one row in ``RUN_DIR/alerts.jsonl`` (every
    process appends its own: one short write each), and for an alert the stacks of every thread of this process
    appended to ``RUN_DIR/hang_stacks_rank{R}.txt``."""
    run_dir = Path(run_dir)

    def report(hang: Hang) -> None:
        row = hang.record()
        if not hang.ended:
            stacks = run_dir / f"hang_stacks_rank{hang.rank}.txt"
            with open(stacks, "a", encoding="utf-8") as f:
                f.write(f"--- {utc(time.time())}: {hang.line()}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            row["stacks"] = stacks.name
        out = stream if stream is not None else sys.stderr
        print(f"[hang] {hang.line()}" + (f"; stacks in {row['stacks']}" if "stacks" in row else ""), file=out,
              flush=True)
        with open(run_dir / "alerts.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    return report


def start_watchdog(bound_s: float, rank: int, run_dir: Path) -> Watchdog | None:
    """The process's watchdog writing to ``run_dir`` (:func:`alert_writer`), started; None when ``bound_s`` is 0."""
    if bound_s <= 0:
        return None
    return Watchdog(bound_s, rank, alert_writer(run_dir), stall=stall_from_env(os.environ.get(STALL_ENV))).start()
