"""Run independent demo stages side by side, one process each, with the same numbers as one after the other.

The demo's two PPO runs (β > 0 and β = 0) share nothing but their inputs, and each seeds every generator
from the run's seed (``tether.ppo.setup.seed_everything``). A process of its own, with the parent's torch
thread count and deterministic algorithms, runs the same kernels on the same data as the parent would, so
its numbers are the same bit for bit (checked: ``tests/test_demo_side_by_side.py``); only the wall time changes. On a
2-core machine the two 1-thread PPO runs then take the time of one.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

from tether.errors import TetherError


def fix_kernels(threads: int) -> None:
    """The demo's repeatability settings, in its main process and in each side-by-side one: the thread count
    fixes how CPU kernels split their reductions; deterministic algorithms refuse any op whose result could
    depend on scheduling (none of the demo's CPU ops do today; this keeps it so)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def log_path(run_dir: Path) -> Path:
    """Where a side-by-side run's own output goes: ``DIR/ppo_beta_0.log`` beside ``DIR/ppo_beta_0/``."""
    return run_dir.parent / f"{run_dir.name}.log"


def run_side_by_side(fn: Callable[..., Path], jobs: Sequence[tuple], steps: int, poll_seconds: float = 2.0) -> None:
    """``fn(*job)`` for every job, each in its own process, all at once; ``job[0]`` is the run folder.

    Progress is read from each run's ``metrics.jsonl`` (one bar per run). If a run fails, the others are
    stopped and a :class:`TetherError` names the run, its exit code and its log.
    """
    from tqdm.auto import tqdm

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
    threads = torch.get_num_threads()
    procs = [context.Process(target=_child, args=(fn, job, threads), name=job[0].name) for job in jobs]
    for proc in procs:
        proc.start()
    # a live bar per run on a terminal; in a log, tqdm writes a line per update, so update rarely there
    interval = 1.0 if sys.stderr.isatty() else 30.0
    bars = [tqdm(total=steps, desc=job[0].name, position=i, leave=True, mininterval=interval)
            for i, job in enumerate(jobs)]
    stopped = set()  # the runs stopped here because another one failed
    try:
        while any(proc.is_alive() for proc in procs):
            if any(proc.exitcode not in (None, 0) for proc in procs):
                break
            _advance(bars, jobs)
            time.sleep(poll_seconds)
        _advance(bars, jobs)
    finally:
        for bar in bars:
            bar.close()
        for i, proc in enumerate(procs):
            if proc.is_alive():
                stopped.add(i)
                proc.terminate()
            proc.join()
    for i in sorted(range(len(jobs)), key=lambda i: i in stopped):  # a run's own failure before those stopped
        proc, job = procs[i], jobs[i]
        if proc.exitcode != 0:
            raise TetherError(f"{job[0]}: the run failed (exit code {proc.exitcode}): {last_line(log_path(job[0]))} "
                              f"(whole output: {log_path(job[0])})")


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()] \
        if path.exists() else []
    return lines[-1].strip() if lines else "no output"


def _advance(bars, jobs) -> None:
    for bar, job in zip(bars, jobs):
        metrics = job[0] / "metrics.jsonl"
        text = metrics.read_text(encoding="utf-8") if metrics.exists() else ""
        bar.update(text.count('"objective/kl"') - bar.n)  # one per PPO step (eval rows have no KL)


def _child(fn: Callable[..., Path], job: tuple, threads: int) -> None:
    """In the new process: the parent's kernel settings, output to the run's log."""
    fix_kernels(threads)
    with open(log_path(job[0]), "w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1)  # the file descriptors, so that C-level output lands there too
        os.dup2(log.fileno(), 2)
        try:
            fn(*job)
        except BaseException:
            traceback.print_exc()  # its last line, the error, is what the parent reports
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
