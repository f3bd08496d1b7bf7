"""The SFT run (Stage 0, S1–S3), for ``tether sft`` and Python scripts alike: :class:`SFTTrainer` sets the run up
(or resumes it), ``step()`` runs one optimiser step (:func:`tether.sft.step.sft_step`) with its evaluation when due,
callbacks, the metrics row and a checkpoint when due; ``train()`` runs to the end; ``finish()`` evaluates and
writes the policy.

The output directory is the run's while it trains — ``config.yaml``, ``metrics.jsonl``, ``alerts.jsonl``,
``samples/step_K.jsonl``, ``checkpoints/step_K/`` (:mod:`tether.sft.resume`) — and at the end becomes the policy
itself, swapped in atomically: the model (a full fine-tune, or LoRA merged, or the adapter alone with
``--export-lora adapter``: :func:`tether.export.write_policy`) in ``--model-dtype``, its tokenizer and chat
template, ``tether_sft.json`` (config, data counts, evaluation, run) and ``eval.json``, beside the run's files.
``--policy`` of ``tether ppo`` and ``--model`` of ``tether train-rm`` take it as it is. A finished run's
checkpoints go (nothing is left to resume); a run stopped by a callback keeps its checkpoint and resumes exactly.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from tether.callbacks import Callbacks, StepRecord, TrainResult
from tether.checkpoint import atomic_dir, check_finite, clean_temporary
from tether.config import check_config, config_to_dict
from tether.errors import ConfigError, TetherError
from tether.runlog import RunLog, StepProgress
from tether.sft.config import SFTConfig
from tether.sft.evaluate import gold_accuracy, held_out_loss
from tether.sft.resume import (METADATA_FILE, check_same_config, checkpoint, checkpoint_due, finished_files,
                               restore, start_in_place)
from tether.sft.setup import PYTHON, Given, setup
from tether.sft.step import sft_step
from tether.trl_compat.arguments import sft_arguments


def name_given(cfg: SFTConfig, given: Given) -> None:
    """Record what Python handed over as ``python:NAME`` in the config (saved in config.yaml, compared on resume).
    One-line errors: an object given beside a file or path for the same setting, and a ``python:`` setting (a saved
    config's) whose object is not given again."""
    slots = (("model.path", "model", given.model), ("data.files", "train_data", given.train_data),
             ("data.eval_files", "eval_data", given.eval_data), ("eval.prompts", "eval_prompts", given.eval_prompts))
    for key, argument, obj in slots:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        values = value if isinstance(value, list) else [value] if value else []
        from_python = bool(values) and all(v.startswith(PYTHON) for v in values)
        if obj is not None and values and not from_python:
            raise ConfigError(f"{key} {','.join(values)}: {argument}= was given from Python as well; give one or "
                              f"the other")
        if obj is None and from_python:
            raise ConfigError(f"{key} {','.join(values)}: was given from Python; give it again "
                              f"(SFTTrainer(..., {argument}=...)) to run or resume")
        if obj is not None and not values:
            setattr(getattr(cfg, section), name, [PYTHON + argument] if isinstance(value, list) else PYTHON + argument)
    if given.gold is not None:
        cfg.eval.gold = PYTHON + getattr(given.gold, "__name__", type(given.gold).__name__).replace(":", "_")
    elif cfg.eval.gold.startswith(PYTHON):
        raise ConfigError(f"eval.gold {cfg.eval.gold}: was given from Python; give it again (SFTTrainer(..., "
                          f"gold=...)) to run or resume")


def evaluates_here(run) -> bool:
    """The main process evaluates; under FSDP2 every process does (a sharded forward is collective)."""
    return run.processes.is_main or run.fsdp is not None


class SFTTrainer:
    """SFT from Python: ``SFTTrainer(config, train_data=...).train()``, or ``.step()`` one step at a time.

    ``config``: an :class:`~tether.sft.config.SFTConfig`, a dict of its keys (nested or dotted, TRL's flat names
    too) or a YAML path, checked as the command line checks its flags; none: the defaults. ``train_data``/
    ``eval_data``: a ``datasets.Dataset`` or a list of rows (:mod:`tether.sft.data` shapes) in place of the files, or
    a file's path; ``eval_prompts``: prompt rows for gold accuracy; ``model``/``tokenizer``: a causal LM object
    (trained in place) and its tokenizer (loaded from ``model.name_or_path`` when not given) in place of
    ``model.path``, or a name or path; TRL's names are taken too (:func:`tether.trl_compat.arguments.sft_arguments`:
    ``args``, ``train_dataset``, ``eval_dataset``, ``processing_class``);
    ``gold``: the rule of ``eval/accuracy`` as a callable; ``callbacks``: :mod:`tether.callbacks`; ``resume``:
    continue the run in ``output_dir`` from its newest checkpoint."""

    def __init__(self, config=None, train_data=None, eval_data=None, eval_prompts=None, model=None, tokenizer=None,
                 callbacks=(), resume: bool = False, gold=None, *, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None):
        cfg, model, tokenizer, train_data, eval_data, eval_prompts = sft_arguments(  # a copy of the caller's config
            SFTConfig, config, args, model, tokenizer, processing_class, train_data, train_dataset, eval_data, eval_dataset,
            eval_prompts)
        given = Given(train_data, eval_data, eval_prompts, model, tokenizer, gold)
        name_given(cfg, given)
        self.cfg, self.callbacks = check_config(cfg), Callbacks(callbacks)
        self.run_dir = Path(cfg.output_dir)
        self.started = time.perf_counter()
        resume, note = start_in_place(self.run_dir, resume, cfg.tracker_project)
        if resume:
            check_same_config(cfg, self.run_dir)
        self.run = run = setup(cfg, given)
        if run.processes.is_main:  # the inputs are good: only now is anything in the directory touched
            clean_temporary(self.run_dir)
            if note.startswith("tether sft: replacing"):
                shutil.rmtree(self.run_dir)
            if note:
                print(note, file=sys.stderr)
            print(data_summary(run), file=sys.stderr)
        run.processes.wait()
        self.steps_done, self.skip_streak = restore(run, self.run_dir) if resume else (0, 0)
        self.log = RunLog(self.run_dir, run.processes, cfg)
        self.log.start(cfg, self.steps_done if resume else None)
        self.bar = StepProgress("sft", run.total_steps, self.steps_done, cfg.progress and run.processes.is_main,
                                dynamic_ncols=True)
        self.last_save = time.monotonic()
        self.stopped: str | None = None  # why the run ends before its last step: a callback's reason
        self.last_row: dict = {}
        self.result: TrainResult | None = None
        if cfg.eval.at_start and self.steps_done == 0:
            self.log.metrics({"step": 0, **self.evaluated(0)})

    @property
    def model(self):
        """The model being trained (unwrapped: a transformers model, or a peft model with LoRA)."""
        return self.run.unwrapped if self.run is not None else None

    def step(self) -> StepRecord:
        """The next optimiser step, its evaluation when due (every ``eval.every`` steps and at the last),
        callbacks, the metrics row, and a checkpoint when due (or when a callback stops the run)."""
        cfg, run, log = self.cfg, self.run, self.log
        if self.result is not None or self.steps_done >= run.total_steps:
            raise TetherError(f"SFTTrainer.step: the run is finished ({self.steps_done} of {run.total_steps} steps)")
        step, self.stopped, self.callbacks.stop_reason = self.steps_done + 1, None, None
        metrics = sft_step(run, cfg)
        self.skip_streak = self.skip_streak + 1 if metrics["sft/skipped"] else 0
        if step == run.total_steps or (cfg.eval.every and step % cfg.eval.every == 0):
            metrics.update(self.evaluated(step))
        record = StepRecord(step=step, metrics={"step": step, **metrics})
        row = self.callbacks("on_step_end", record, into=record.metrics)
        log.metrics(row)
        if metrics["sft/skipped"]:
            note = f"step {step}: non-finite gradient norm ({metrics['sft/grad_norm']}); update skipped"
            log.alert(step, note)
            record.alerts.append(note)
            self.callbacks("on_alert", note)
            if self.skip_streak >= cfg.optim.max_skipped_steps:
                log.close()
                raise TetherError(f"step {step}: {self.skip_streak} consecutive steps with a non-finite loss or "
                                  f"gradient (optim.max_skipped_steps); stopped. The last checkpoint is intact")
        self.steps_done, self.last_row = step, row
        self.bar.update(loss=f"{row['sft/loss']:.4f}", lr=f"{row['sft/lr']:.3g}")
        stop = run.processes.broadcast(self.callbacks.stop_reason)
        last = step == run.total_steps  # the policy is written next: a checkpoint would have nothing to resume
        if not last and (checkpoint_due(run, cfg, step, self.last_save) or stop):
            record.checkpoint = self.save(step)
        if stop:
            self.stopped = stop
            log.print(f"[callback] stopping at step {step} ({stop})")
        return record

    def train(self) -> TrainResult:
        """Run the remaining steps (until a callback stops the run), then :meth:`finish`."""
        while self.steps_done < self.run.total_steps and self.stopped is None:
            self.step()
        return self.finish()

    def finish(self) -> TrainResult:
        """End the run where it is: its evaluation (when the last row has none), then the policy written into the
        output directory (module docstring). Returns the run's result."""
        if self.result is not None:
            return self.result
        run, cfg = self.run, self.cfg
        self.bar.close()
        evaluation = {k: v for k, v in self.last_row.items() if k.startswith("eval/")}
        if not evaluation and self.steps_done:
            evaluation = self.evaluated(self.steps_done, write_samples=False)
        self.log.close()
        keep = self.stopped is not None and self.steps_done < run.total_steps  # a stopped run can resume
        info = {"training": config_to_dict(cfg), "data": run.data_info, "evaluation": evaluation,
                "run": {"steps": self.steps_done, "seconds": round(time.perf_counter() - self.started, 2),
                        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                        "stopped": self.stopped}}
        export(run, cfg, self.run_dir, keep, info)
        if run.processes.is_main:
            self.callbacks("on_save", self.run_dir)
        run.processes.close()
        model = run.unwrapped if run.processes.world_size == 1 else None
        if run.processes.world_size > 1:
            self.run = None  # the sharded or DDP-wrapped model goes with the process group
        self.result = TrainResult(run_dir=self.run_dir, metrics={**self.last_row, **evaluation}, steps=self.steps_done,
                                  models={"policy": self.run_dir}, stopped=self.stopped, model=model)
        return self.result

    def evaluate(self) -> dict:
        """The eval/ metrics of the model as it is (held-out loss, perplexity, gold accuracy); nothing is written.
        On the main process ({} on the others)."""
        if self.run is None:
            raise TetherError("SFTTrainer.evaluate: a multi-process run releases its model at finish(); evaluate "
                              "before, or load the exported policy")
        if not evaluates_here(self.run):
            return {}
        metrics = held_out_loss(self.run, self.cfg.eval.batch_size)
        metrics.update(gold_accuracy(self.run, self.cfg)[0])
        return metrics if self.run.processes.is_main else {}

    def evaluated(self, step: int, write_samples: bool = True) -> dict:
        """The step's evaluation on the processes that take part (main's figures kept), its samples written, and
        the metrics ``on_evaluate`` callbacks add."""
        if not evaluates_here(self.run):
            return {}
        metrics = held_out_loss(self.run, self.cfg.eval.batch_size)
        gold, samples = gold_accuracy(self.run, self.cfg)
        metrics.update(gold)
        if not self.run.processes.is_main or not metrics:
            return {}
        if write_samples:
            self.log.samples(step, samples, self.cfg.eval.samples)
        return self.callbacks("on_evaluate", dict(metrics), into=metrics)

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step`` (every process takes part); its path on the main process."""
        saved = checkpoint(self.run, self.cfg, self.run_dir, step, self.skip_streak)
        self.last_save = time.monotonic()
        if saved is not None:
            self.callbacks("on_save", saved)
        return saved


def data_summary(run) -> str:
    """The lines a run prints about its data and model once everything is checked."""
    i, t = run.data_info, run.data_info["train"]
    held = i.get("held_out") or {}
    return (f"data: {i['read']}; {i['train_rows']} train rows, {i['held_out_rows']} held-out rows\n"
            f"tokens: {t['tokens']} in {t['rows']} train sequences, {t['trained_tokens']} trained; prompt cut from the "
            f"left in {t['prompt_truncated']}, response cut in {t['response_truncated']} "
            f"(--max-length {run.fmt.max_length})" + (f"; held-out: {held['trained_tokens']} trained tokens, "
                                                       f"{held['prompt_truncated']} prompts and "
                                                       f"{held['response_truncated']} responses cut" if held else "")
            + f"\nmodel: {i['trainable_parameters']:,} trainable parameters, {i['format']} format, packing "
            f"{i['packing']}; {run.total_steps} steps ({i['steps_per_epoch']} per epoch)")


def export(run, cfg: SFTConfig, out_dir: Path, keep_checkpoints: bool, info: dict) -> None:
    """The policy swapped in as ``out_dir`` (atomically), with the run's files moved in beside it; checkpoints
    kept only for a run that can resume. Collective under FSDP2 (the full state is gathered first)."""
    from tether.export import write_policy
    from tether.sharding import full_model_state

    state = full_model_state(run.unwrapped) if run.fsdp is not None else None
    if run.processes.is_main:
        check_finite(run.unwrapped, str(out_dir), state)  # refused (one line) if a weight is NaN/Inf
        previous = finished_files(out_dir)

        def write(tmp: Path) -> None:
            write_policy(tmp, run.unwrapped, run.tokenizer, cfg.model.export_lora, cfg.model.dtype, state)
            info["policy_files"] = sorted(p.name for p in tmp.iterdir())
            (tmp / METADATA_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            (tmp / "eval.json").write_text(json.dumps(info["evaluation"], indent=1) + "\n", encoding="utf-8")
            for entry in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:  # the run's files join the policy
                name = entry.name
                if (tmp / name).exists() or name in previous or name.startswith((".tmp-", ".old-")) or (
                        name == "checkpoints" and not keep_checkpoints):
                    continue
                os.replace(entry, tmp / name)

        atomic_dir(out_dir, write)
        print(f"tether sft: policy written to {out_dir}", file=sys.stderr)
    run.processes.wait()
