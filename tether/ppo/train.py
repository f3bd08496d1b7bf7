"""The PPO run around :func:`tether.ppo.step.ppo_step`, with its state held on one object, :class:`PPOTrainer` —
the code path of ``tether ppo`` and of Python scripts alike: set-up and resume, the step (evaluation on
held-out prompts when due (B13), callbacks, live health alerts (D3), the metrics row, checkpoints (B14)), and the
end of the run (roll-back on an alarm, the final policy export).

Run directory: ``config.yaml``, ``metrics.jsonl`` (one row per step), ``samples/step_K.jsonl``,
``alerts.jsonl``, ``checkpoints/step_K/``, and ``policy/`` (the final policy, :mod:`tether.ppo.export`). What is
written, and by which process, is :class:`~tether.ppo.runlog.RunLog`'s; what a checkpoint holds and how a run
resumes, :mod:`tether.ppo.resume`'s.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

from tether.callbacks import Callbacks, StepRecord, TrainResult
from tether.checkpoint import clean_temporary
from tether.config import check_config
from tether.diagnostics.best import BEST_DIR, BestEvaluation, consider, measure_of
from tether.errors import TetherError
from tether.ppo.checks import hang_seconds
from tether.ppo.config import RunConfig
from tether.ppo.evaluate import evaluate
from tether.ppo.export import export_policy
from tether.ppo.inputs import detached, resolve_inputs
from tether.ppo.resume import (check_same_config, checkpoint, checkpoint_due, from_health_book, health_book,
                               load_weights, restore, start_in_place)
from tether.ppo.runlog import Progress, RunLog
from tether.ppo.step import ppo_step
from tether.rollout.layout import launch_layout
from tether.rollout.server import serve
from tether.trl_compat.arguments import ppo_arguments
from tether.watchdog import mark, mark_step, phase, start_watchdog

ALARM = "health alarm"


def note_non_finite(log: RunLog, step: int, notes: list[str], streak: int, limit: int) -> int:
    """Alert lines for rows dropped and updates skipped (B16); returns ``streak``, the steps in a row whose every
    update was skipped for a non-finite loss or gradient norm (or that had no finite row), and stops the run
    (one-line error) when it reaches ``limit``. A step with no update because dynamic sampling found no group with
    spread is not such a step."""
    for note in notes:
        log.alert(step, note)
    if streak >= limit:
        log.close()
        raise TetherError(f"step {step}: {streak} consecutive steps skipped every optimizer update (non-finite "
                          f"loss or gradient norm; health.max_skipped_steps={limit}); stopped. The weights of the "
                          f"last complete checkpoint are intact; alerts.jsonl names the bad rows")
    return streak


def evaluates_here(run) -> bool:
    """Whether this process takes part in an evaluation: the main process, and every process when the policy's
    forward (FSDP2) or the engine's generate is collective."""
    return run.processes.is_main or run.models.fsdp is not None or run.models.engine.collective


def settle_rollouts(run) -> None:
    """Collect a batch in flight to the rollout processes (one step off, C7) before the engine serves anything else:
    the rollout processes answer requests in order."""
    if run.data.ahead is not None:
        run.data.ahead.collect(run)


def evaluate_and_log(run, cfg, log: RunLog, step: int) -> dict:
    """Evaluate on the main process (the others get no eval metrics) and write its samples. A sharded policy's
    forward, and a collective engine's generate, are collective: every process evaluates the same rows, the main
    process's figures are kept."""
    if not evaluates_here(run):
        return {}
    metrics, samples = evaluate(run, cfg, step)
    if not run.processes.is_main:
        return {}
    log.samples(step, samples, len(samples) if cfg.eval.samples is None else cfg.eval.samples)
    return metrics


class PPOTrainer:
    """PPO from Python: ``PPOTrainer(config, reward=...).train()``, or ``.step()`` one step at a time.

    ``config``: a :class:`~tether.ppo.config.RunConfig`, a dict of its keys (nested or dotted, TRL's flat names
    too) or a YAML path, checked as the command line checks its flags (a bad value is the same one-line
    ConfigError); none: the defaults. ``reward``: reward
    sources beside ``reward.sources`` — specs, callables ``f(prompts, responses, **columns) -> list[float]``,
    ``RewardModel``/``RewardEnsemble``/``ProcessRewardModel`` objects, or a dict ``{name: source}``
    (:mod:`tether.ppo.inputs` says what the config records); ``prompts``/``eval_prompts``: a
    ``datasets.Dataset`` or a list of rows, texts or message lists, in place of the files, or a file's path;
    TRL's names are taken too (:func:`tether.trl_compat.arguments.ppo_arguments`: ``args``, ``model`` as a name or path,
    ``reward_funcs``, ``train_dataset``, ``eval_dataset``); ``gold``: the rule of
    ``eval/accuracy`` (``reward.gold``), a spec or a callable as a reward rule is; ``callbacks``:
    :mod:`tether.callbacks`; ``resume``: continue the run in ``output_dir`` from its newest checkpoint.

    Construction checks everything, loads the models and restores the checkpoint; ``step()`` runs the next step
    and returns its :class:`~tether.callbacks.StepRecord`; ``train()`` runs the remaining steps (until a callback
    or a health alarm stops the run) and finishes it (roll-back, export); ``evaluate()`` evaluates the current
    policy on the held-out prompts."""

    def __init__(self, config=None, reward=None, prompts=None, eval_prompts=None, callbacks=(), resume: bool = False,
                 gold=None, *, args=None, model=None, reward_funcs=None, train_dataset=None, eval_dataset=None):
        from tether.diagnostics.health import HealthMonitor
        from tether.ppo.setup import setup

        cfg, reward, prompts, eval_prompts = ppo_arguments(RunConfig, detached, config, args, model, reward,
                                                           reward_funcs, prompts, train_dataset, eval_prompts,
                                                           eval_dataset)  # a copy
        self.given = resolve_inputs(cfg, reward, prompts, eval_prompts, gold)
        self.cfg, self.callbacks = check_config(cfg), Callbacks(callbacks)
        self.run_dir = Path(cfg.output_dir)
        self._serves_rollouts = launch_layout(cfg).is_rollout
        if self._serves_rollouts:  # disaggregated layout: this process only generates, until the trainers stop
            self.run, self.steps_done = None, cfg.steps
            self.result = TrainResult(run_dir=serve(cfg), metrics={}, models={}, steps=cfg.steps)
            return
        resume, note = start_in_place(self.run_dir, resume)
        if resume:
            check_same_config(cfg, self.run_dir)
        self.run = run = setup(cfg, self.given)
        if run.processes.is_main:  # the inputs are good: only now is anything in run_dir touched
            clean_temporary(self.run_dir)
            if note:
                print(note, file=sys.stderr)
        self.steps_done, book = restore(run, self.run_dir) if resume else (0, {})
        self.log = RunLog(self.run_dir, run.processes, cfg)
        self.monitor = HealthMonitor(cfg.health)
        for row in self.log.start(cfg, self.steps_done if resume else None):  # replay: alerts fire on new crossings
            self.monitor.update(row["step"], row)
        # saved while no band was in alarm; the streak of steps with every update skipped (both in the checkpoints)
        self.healthy_checkpoints, self.skip_streak = from_health_book(book, self.run_dir)
        # the best evaluation so far (tether.diagnostics.best), tracked with or without --keep-best, in the checkpoints
        self.best, self.evals_seen = BestEvaluation.from_dict(book.get("best", {}).get("best")), \
            int(book.get("best", {}).get("seen", 0))
        self.bar = Progress(run, cfg, self.steps_done)  # the start-up summary; per step a bar or a plain line
        # One process cannot wait for another: the hang watchdog watches multi-process runs (docs/distributed.md).
        self.watchdog = (start_watchdog(hang_seconds(cfg), run.processes.rank, self.run_dir)
                         if run.processes.world_size > 1 else None)
        self.last_save = time.monotonic()
        self.stopped: str | None = None   # why the run stops before cfg.steps: a callback's reason or ALARM
        self.last_row: dict = {}
        self.result: TrainResult | None = None
        if run.data.eval_every and cfg.eval.at_start and self.steps_done == 0:
            with self.log.closed_on_error(), phase("eval"):
                self.log.metrics(row0 := {"step": 0, **self.evaluated(0)})
                self.bar.evaluated(row0)
                self.keep_best(0, row0)

    @property
    def is_rollout_process(self) -> bool:
        """True on a rollout process of the disaggregated layout (``--rollout-processes``): its construction served
        the trainers until they finished, and a script has nothing more to do there (``step``, ``train`` and
        ``evaluate`` are the trainers')."""
        return self._serves_rollouts

    def step(self) -> StepRecord:
        """The next PPO step (:func:`~tether.ppo.step.ppo_step`), its evaluation when due, callbacks, health alerts,
        its metrics row, and a checkpoint when due (or when a callback stops the run: it resumes from there)."""
        cfg, run, log = self.cfg, self.run, self.log
        if self.is_rollout_process:
            raise TetherError("PPOTrainer.step: this process is a rollout process (--rollout-processes); it served the "
                              "trainers until they finished (check PPOTrainer.is_rollout_process in a script)")
        if self.result is not None or self.steps_done >= cfg.steps:
            raise TetherError(f"PPOTrainer.step: the run is finished ({self.steps_done} of --steps {cfg.steps} done)"
                              if self.result is not None else f"PPOTrainer.step: all --steps {cfg.steps} are done; "
                              f"call train() to finish the run, or resume it with more --steps")
        step, self.stopped, self.callbacks.stop_reason = self.steps_done + 1, None, None  # a script may go on
        mark_step(step)  # the phases the hang watchdog names are this step's (ppo_step's PhaseTimer marks them)
        metrics = ppo_step(run, cfg, step)
        notes = metrics.pop("health/notes", [])
        # B16: only a step stalled by non-finite values counts, not one with no group with spread (#51)
        self.skip_streak = self.skip_streak + 1 if metrics.pop("health/non_finite_stall", False) else 0
        evaluates = bool(run.data.eval_every) and (step % run.data.eval_every == 0 or step == cfg.steps)
        if evaluates:
            with phase("eval"):
                metrics.update(self.evaluated(step))  # (a batch in flight to the rollout processes is collected first)
        record = StepRecord(step=step, metrics={"step": step, **metrics})
        row = self.callbacks("on_step_end", record, into=record.metrics)
        alerts = self.monitor.update(step, row, final=step == cfg.steps)
        record.alerts = [*alerts, *notes]
        log.metrics(row)
        for alert in alerts:
            log.alert(step, alert)
        for alert in record.alerts:
            self.callbacks("on_alert", alert)
        note_non_finite(log, step, notes, self.skip_streak, cfg.health.max_skipped_steps)
        self.steps_done, self.last_row = step, row
        self.bar.step(row)  # its line (or the bar), and the evaluation line when it evaluated
        # The main process decides (only it has the evaluation metrics the gold band reads), every process follows.
        alarm = run.processes.broadcast(bool(alerts) and (cfg.health.stop_on_alarm or cfg.health.rollback))
        stop = run.processes.broadcast(self.callbacks.stop_reason)
        if evaluates:  # before the periodic checkpoint, which carries the best so far
            with phase("checkpoint"):  # (the hang watchdog's name for it: a save, collective)
                self.keep_best(step, row)
        if checkpoint_due(run, cfg, step, self.last_save) or (stop and not alarm and step < cfg.steps):
            with phase("checkpoint"):
                record.checkpoint = self.save(step)
        if alarm or stop:
            self.stopped = ALARM if alarm else stop
            log.print(f"[{'health' if alarm else 'callback'}] stopping at step {step} ({self.stopped})")
        mark(None)  # between steps the process is the caller's: not watched
        return record

    def train(self) -> TrainResult:
        """Run the remaining steps, then :meth:`finish`; a step that raises finishes the trackers first (#42)."""
        if self.result is not None:  # finished, or a rollout process (it served until the trainers stopped)
            return self.result
        with self.log.closed_on_error():
            while self.steps_done < self.cfg.steps and self.stopped is None:
                self.step()
        return self.finish()

    def finish(self) -> TrainResult:
        """End the run where it is: roll back after a health alarm (``health.rollback``), check that the processes
        hold the same weights, export the policy (:mod:`tether.ppo.export`). Returns the run's result."""
        if self.result is not None:
            return self.result
        run, cfg = self.run, self.cfg
        mark("finish")  # roll-back, the ranks' weight digests, the export (process 0 writes, the others wait)
        self.bar.close()
        self.log.close()
        if self.stopped == ALARM and cfg.health.rollback:
            rollback(run, self.log, self.monitor, self.healthy_checkpoints)
        if run.processes.world_size > 1 and run.models.fsdp is None:  # FSDP2 holds one sharded copy: nothing to compare
            check_ranks_in_sync(run, self.log, self.run_dir)
        policy = export_policy(run, self.run_dir, cfg.model.export_lora, cfg.model.dtype)
        if policy is not None:
            self.callbacks("on_save", policy)
        run.processes.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if run.processes.world_size > 1:
            # The sharded or DDP-wrapped models (and their memory) go now: nothing may use them after the group is
            # destroyed. The group's gloo threads outlive this all the same (see processes.leave_without_teardown).
            self.run = run = None
            gc.collect()
        self.result = TrainResult(run_dir=self.run_dir, metrics=self.last_row, steps=self.steps_done,
                                  models={"policy": self.run_dir / "policy"}, stopped=self.stopped)
        return self.result

    def evaluate(self) -> dict:
        """The eval/ metrics of the current policy on the held-out prompts (B13), as a step's evaluation computes
        them; nothing is written; the main process gets them, the others {}. Collective wherever evaluation is:
        under FSDP2, with a tensor-parallel vLLM engine (``--engine-tp``) and with rollout processes
        (``--rollout-processes``) every training process must call it, as ``train()`` does; a script that calls it
        on the main process alone waits there until ``--collective-timeout-minutes`` and fails. A multi-process run
        releases its models at ``finish()``: evaluate before."""
        run = self.run
        # released at finish() (a rollout process has no models and returns {} below)
        if run is None and self.result is not None and self.result.models:
            raise TetherError("PPOTrainer.evaluate: a multi-process run releases its models at finish(); "
                              "evaluate before train() ends (e.g. from a callback) or load the exported policy")
        if run is None or not evaluates_here(run):
            return {}
        settle_rollouts(run)
        metrics, _ = evaluate(self.run, self.cfg, self.steps_done)
        return metrics if self.run.processes.is_main else {}

    def evaluated(self, step: int) -> dict:
        """The step's evaluation (:func:`evaluate_and_log`) with the metrics ``on_evaluate`` callbacks add."""
        settle_rollouts(self.run)
        metrics = evaluate_and_log(self.run, self.cfg, self.log, step)
        return self.callbacks("on_evaluate", dict(metrics), into=metrics) if metrics else metrics

    def keep_best(self, step: int, row: dict) -> None:
        """After an evaluation: when it beats the best so far (:func:`tether.diagnostics.best.consider`, decided on the
        main process, which alone has the evaluation), remember it and, with ``--keep-best``, write its checkpoint to
        ``RUN_DIR/best`` (every process takes part). The best changes only once its checkpoint is complete: a save
        that fails leaves the previous best on disk and in memory."""
        self.evals_seen += measure_of(row) is not None
        new = consider(self.best, row, self.evals_seen) if self.run.processes.is_main else None
        new = self.run.processes.broadcast(new.to_dict() if new is not None else None)
        if new is None:
            return
        if self.cfg.eval.keep_best:
            book = health_book(self.healthy_checkpoints, self.skip_streak, {"best": new, "seen": self.evals_seen})
            checkpoint(self.run, self.cfg, self.run_dir, step, book, best=new)
            self.log.print(f"[best] {BestEvaluation.from_dict(new).describe()}: checkpoint in {self.run_dir / BEST_DIR}")
        self.best = BestEvaluation.from_dict(new)

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step`` (every process takes part); its path on the main process."""
        healthy = self.monitor.healthy
        book = health_book(self.healthy_checkpoints + [(step, None)] * healthy, self.skip_streak,
                           {"best": self.best.to_dict() if self.best else None, "seen": self.evals_seen})
        saved = checkpoint(self.run, self.cfg, self.run_dir, step, book)
        self.last_save = time.monotonic()
        if saved is not None:
            if healthy:
                self.healthy_checkpoints.append((step, saved))
            self.callbacks("on_save", saved)
        return saved


def train(cfg, resume: bool = False) -> Path:
    """Run (or resume) PPO as configured; returns the run directory (``PPOTrainer(cfg, resume=...).train()``)."""
    return PPOTrainer(cfg, resume=resume).train().run_dir


def rollback(run, log: RunLog, monitor, healthy_checkpoints: list[tuple[int, Path]]) -> None:
    """Restore, on every process, the newest checkpoint saved before the first alarm's onset (a checkpoint
    saved between onset and alarm counts as healthy, but its metric was already drifting). The main process
    chooses it: it alone saw the evaluation metrics."""
    target = None
    if run.processes.is_main:
        onset = min(alert.onset_step for alert in monitor.alerts())
        candidates = [path for step, path in healthy_checkpoints if step < onset and path.is_dir()]
        target = str(candidates[-1]) if candidates else None
        if target is None:
            log.print(f"[health] no checkpoint saved before step {onset}: nothing to roll back to")
    target = run.processes.broadcast(target)
    if target is not None:
        load_weights(run, Path(target))
        log.print(f"[health] rolled back to {Path(target).name}; policy/ holds its weights")


def check_ranks_in_sync(run, log: RunLog, run_dir: Path) -> bool:
    """All ranks must hold identical weights after DDP training: compare SHA-256 digests of the
    trainable parameters across ranks and record them in ``ranks.json``."""
    import hashlib

    def digest(module) -> str:
        h = hashlib.sha256()
        for name, p in sorted(module.named_parameters()):
            if p.requires_grad:
                h.update(name.encode())
                h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    critic = run.models.unwrapped_critic
    mine = {"policy": digest(run.models.unwrapped_policy), "critic": digest(critic) if critic is not None else None}
    gathered = [None] * run.processes.world_size
    torch.distributed.all_gather_object(gathered, mine)
    in_sync = all(g == gathered[0] for g in gathered)
    if run.processes.is_main:
        (run_dir / "ranks.json").write_text(json.dumps({"world_size": run.processes.world_size, "in_sync": in_sync,
                                                        "digests": gathered}, indent=1), encoding="utf-8")
    if not in_sync:
        log.print("[ddp] warning: ranks hold different weights")
    return in_sync
