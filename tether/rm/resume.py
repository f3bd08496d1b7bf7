"""Checkpoints of reward-model training (``train-rm --save-every N``, ``--save-every-minutes M``, ``--resume``),
and the loop's callbacks: where a training loop is, what it must save to continue exactly, and when.

While training runs, ``DIR/checkpoints/step_K/`` holds the trainable weights (``trainable.safetensors``: the
whole model, or the LoRA adapter and the head), ``trainer_state.pt`` (optimiser, schedule, loss scaler, the
epoch and the next batch in it, the batch-order generator as the epoch began, RNG states, the metric rows so
far, a digest of the tokenised training pairs) and ``config.yaml``, written atomically
(:func:`tether.checkpoint.atomic_dir`); the newest one is kept. ``--resume`` continues from it with the same
batches in the same order, so a run killed and resumed ends with the same weights as a straight one. The
finished reward model replaces ``DIR`` whole: its checkpoints go with it (there is nothing left to resume).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tether.callbacks import Callbacks, StepRecord
from tether.checkpoint import atomic_dir, checkpoint_dir, clean_temporary, list_checkpoints, rng_state, set_rng_state
from tether.config import config_differences, save_config
from tether.errors import TetherError

# What may differ between a run and its --resume: how often it saves, how it scores in batches.
RESUMABLE_CHANGES = ("save_every", "save_every_minutes", "eval_batch_size")


def data_digest(encoded: list[tuple]) -> str:
    """SHA-256 of the tokenised training items (``encoded``: tuples of objects with ``ids``), in order."""
    h = hashlib.sha256()
    for item in encoded:
        for e in item:
            h.update(torch.tensor(e.ids, dtype=torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()


class TrainingProgress:
    """A reward-model training loop's position, checkpoints and callbacks. Built before anything is written:
    ``resume`` with a complete checkpoint in ``out_dir`` continues from it; a directory holding one is never
    restarted without ``resume``; one with no complete checkpoint (killed before its first) starts again."""

    def __init__(self, out_dir: Path | None, cfg, callbacks: Callbacks | None = None, resume: bool = False):
        """``out_dir`` None: no checkpoints (a loop run on its own, as tests do)."""
        self.out_dir, self.cfg = Path(out_dir) if out_dir is not None else None, cfg
        self.callbacks = callbacks or Callbacks()
        found = list_checkpoints(self.out_dir) if self.out_dir is not None else []
        if found and not resume:
            raise TetherError(f"--output-dir {out_dir}: holds an unfinished training run ({found[-1].name}); "
                              f"use --resume to continue it or choose another directory")
        self.checkpoint = found[-1] if resume and found else None
        if resume and not found and self.out_dir is not None:
            print(f"note: --resume: {out_dir} has no checkpoint; training from step 0")
        if self.checkpoint is not None:
            differences = config_differences(cfg, self.checkpoint / "config.yaml", RESUMABLE_CHANGES)
            if differences:
                key, now, then = differences[0]
                raise TetherError(f"--resume: {key} is {now!r} but the run in {out_dir} was made with {then!r}; "
                                  f"resume with the same settings or start a new --output-dir")
        self.epoch, self.next_batch, self.stopped = 0, 0, None
        self.last_save = time.monotonic()

    def restore(self, model, optimizer, scheduler, scaler, generator: torch.Generator, digest: str) -> list[dict]:
        """Load the checkpoint being resumed (if any) into these; returns the metric rows so far."""
        if self.out_dir is not None:
            clean_temporary(self.out_dir)
        self.digest = digest
        if self.checkpoint is None:
            return []
        state = torch.load(self.checkpoint / "trainer_state.pt", weights_only=True)
        if state["data_digest"] != digest:
            raise TetherError(f"--resume: the training pairs differ from those of {self.checkpoint} (same files "
                              f"and settings are needed to continue exactly)")
        weights = load_file(str(self.checkpoint / "trainable.safetensors"))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(weights) != trainable:
            raise TetherError(f"{self.checkpoint}: its weights do not match the model's trainable parameters "
                              f"(e.g. {sorted(set(weights) ^ trainable)[:2]})")
        model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        generator.set_state(state["epoch_generator"])  # the batch order is drawn again from the epoch's start
        set_rng_state(state["rng"])
        self.epoch, self.next_batch = int(state["epoch"]), int(state["next_batch"])
        print(f"resumed from {self.checkpoint.name}: epoch {self.epoch + 1}, step {state['step']}")
        return list(state["history"])

    def first_batch(self, epoch: int) -> int:
        """Where ``epoch``'s loop starts: the next batch of the checkpoint's epoch, else its beginning."""
        return self.next_batch if epoch == self.epoch else 0

    def step_done(self, history: list[dict], epoch: int, next_batch: int, epoch_generator: torch.Tensor,
                  objects: tuple) -> bool:
        """After an optimiser step: callbacks (their metrics join the step's row), a checkpoint when due.
        ``objects``: (model, optimizer, scheduler, scaler). Returns whether a callback stopped the run."""
        row = history[-1]
        record = StepRecord(step=row["step"], metrics=row)
        self.callbacks("on_step_end", record, into=row)
        self.stopped = self.callbacks.stop_reason
        if self.due(row["step"]) and not self.stopped:
            record.checkpoint = self.save(history, epoch, next_batch, epoch_generator, *objects)
        return self.stopped is not None

    def due(self, step: int) -> bool:
        cfg = self.cfg
        if self.out_dir is None:
            return False
        return bool(cfg.save_every and step % cfg.save_every == 0) or bool(
            cfg.save_every_minutes and time.monotonic() - self.last_save >= 60 * cfg.save_every_minutes)

    def save(self, history, epoch, next_batch, epoch_generator, model, optimizer, scheduler, scaler) -> Path:
        step = history[-1]["step"]
        state = {"step": step, "epoch": epoch, "next_batch": next_batch, "epoch_generator": epoch_generator,
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "scaler": scaler.state_dict(), "rng": rng_state(), "history": history, "data_digest": self.digest}

        def write(tmp: Path) -> None:
            weights = {n: p.detach().clone().contiguous() for n, p in model.named_parameters() if p.requires_grad}
            save_file(weights, str(tmp / "trainable.safetensors"))
            torch.save(state, tmp / "trainer_state.pt")
            save_config(self.cfg, tmp / "config.yaml")

        path = atomic_dir(checkpoint_dir(self.out_dir, step), write)
        for old in list_checkpoints(self.out_dir)[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        self.last_save = time.monotonic()
        self.callbacks("on_save", path)
        return path
