"""What a run (PPO, SFT) writes as it goes — the one place that decides "only the main process does this".

``metrics.jsonl`` (one row per step), ``alerts.jsonl``, ``samples/step_K.jsonl``, ``config.yaml``, the
experiment trackers of ``--log-with`` (TensorBoard, W&B, MLflow, … through accelerate's tracking), and
console lines. On every other process each method does nothing, so the run loop has no rank checks.
A run's config names its trackers with ``log_with``, ``tensorboard`` and ``tracker_project``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

from tether.config import config_to_dict, flatten, save_config
from tether.errors import TetherError


def progress_mode(stream, enabled: bool = True) -> str:
    """How a run shows its steps on ``stream``: ``"bar"`` on a terminal; ``"lines"`` otherwise, one plain line a
    step (a bar redraws itself with ``\\r``, which a CI log or a batch scheduler's file keeps as one line of
    several KB); ``"off"`` when not ``enabled`` (``--progress false``, a process other than the main one)."""
    if not enabled:
        return "off"
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


class StepProgress:
    """Per-step progress on stderr by :func:`progress_mode`: tqdm's bar on a terminal, else one line per
    :meth:`update` (``DESC step N/TOTAL  key value ...``, no ``\\r``). Used by ``sft`` and ``train-rm``."""

    def __init__(self, desc: str, total: int, initial: int = 0, enabled: bool = True, stream=None, **bar_args):
        self.stream = stream if stream is not None else sys.stderr
        self.desc, self.total, self.n = desc, total, initial
        self.mode = progress_mode(self.stream, enabled)
        self.bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=desc, initial=initial, total=total, unit="step", file=self.stream, **bar_args)

    def update(self, **postfix: str) -> None:
        """One step done; ``postfix``: its figures, already formatted."""
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(**postfix, refresh=False)
        elif self.mode == "lines":
            figures = "".join(f"  {key} {value}" for key, value in postfix.items())
            print(f"{self.desc} step {self.n}/{self.total}{figures}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_jsonl(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file this run appended to (empty when the file does not exist). A last line that
    is cut short (the process was killed mid-write) is dropped; a bad line before it is a one-line error."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if i == len(lines) - 1:  # no newline after it: a write the kill cut short
                break
            raise TetherError(f"{path}: line {i + 1} is not a JSON row; the run's log is damaged "
                              f"(remove that line to resume)") from None
    return rows


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a temporary file renamed over it: a kill leaves the old text or the new one."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop rows written after ``last_step`` (they are redone after a resume) and any cut-short last line."""
    rows = [row for row in read_jsonl_rows(path) if row.get("step", 0) <= last_step]
    if path.is_file():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def tracker_names(cfg) -> list[str]:
    """The trackers asked for: ``--log-with`` (a list) plus ``tensorboard`` when ``--tensorboard true``."""
    names = [n for n in cfg.log_with if n and n != "none"]
    if cfg.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def check_trackers(names: list[str]) -> None:
    """One line per unknown or uninstalled tracker (accelerate would skip a missing one silently)."""
    if not names:
        return
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = [t.value for t in LoggerType]
    available = {str(t) for t in get_available_trackers()}
    for name in names:
        if name not in known:
            raise TetherError(f"--log-with: {name!r} is not a tracker accelerate knows ({', '.join(known)})")
        if name != "all" and name not in available:
            raise TetherError(f"--log-with {name}: the {name} package is not installed (pip install {name})")


def _flat(d: dict) -> dict:
    """Nested config -> flat ``{"kl.coef": 0.05}`` with scalar values (trackers' hyper-parameter tables)."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(d).items()}


class RunLog:
    """The run's outputs, written by the main process only (``processes.is_main``)."""

    def __init__(self, run_dir: Path, processes, cfg):
        self.run_dir = Path(run_dir)
        self.enabled = processes.is_main
        self.accelerator = processes.accelerator
        self.trackers = tracker_names(cfg)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.alerts_path = self.run_dir / "alerts.jsonl"
        self.closed = False  # the trackers finished

    def start(self, cfg, resumed_at: int | None) -> list[dict]:
        """Prepare the run directory (after a resume: drop rows past the checkpoint), save the config,
        start the trackers; returns the metric rows already written (replayed into the health monitor)."""
        # Every process reads the kept rows before the main process rewrites the file.
        kept = [row for row in read_jsonl_rows(self.metrics_path)
                if row.get("step", 0) <= resumed_at] if resumed_at is not None else []
        if self.enabled:
            if resumed_at is not None:
                truncate_jsonl(self.metrics_path, resumed_at)
                truncate_jsonl(self.alerts_path, resumed_at)
            else:  # a fresh start in place (train() said what it replaces): no rows of the old run survive
                self.clear_outputs()
            (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            if self.trackers:
                self.accelerator.init_trackers(cfg.tracker_project, config=_flat(config_to_dict(cfg)))
        return kept

    def clear_outputs(self) -> None:
        """Remove the metrics, alerts and samples of a run that never reached a checkpoint."""
        for path in (self.metrics_path, self.alerts_path):
            path.unlink(missing_ok=True)
        for path in (self.run_dir / "samples").glob("step_*.jsonl"):
            path.unlink()

    def metrics(self, row: dict) -> None:
        if not self.enabled:
            return
        write_jsonl(self.metrics_path, row)
        if self.trackers:
            values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                      and not isinstance(v, bool) and math.isfinite(v)}
            self.accelerator.log(values, step=row["step"])

    def alert(self, step: int, alert) -> None:
        if self.enabled:
            self.print(f"[health] {alert}")
            write_jsonl(self.alerts_path, {"step": step, "alert": str(alert)})

    def samples(self, step: int, samples: list[dict], n: int) -> None:
        if self.enabled and samples:
            path = self.run_dir / "samples" / f"step_{step}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples[:n]), encoding="utf-8")

    def print(self, message: str) -> None:
        """A console line that does not break the progress bar."""
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(message, file=sys.stderr)

    @contextlib.contextmanager
    def closed_on_error(self):
        """Finish the trackers when the body raises, then re-raise: a process of a launch ends with ``os._exit``
        (tether.processes.leave_without_teardown), so no atexit handler would, and an unfinished tracker run is
        lost or left open (W&B: crashed; MLflow: RUNNING)."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Finish the trackers, once (the end of a run, or an error on the way: :meth:`closed_on_error`)."""
        # The trackers only: accelerator.end_training() would also destroy the process group, which the run's
        # last collectives (rank digests, export) still use; Processes.close() leaves it, on every process.
        if self.enabled and self.trackers and not self.closed:
            self.closed = True
            for tracker in self.accelerator.trackers:
                tracker.finish()
