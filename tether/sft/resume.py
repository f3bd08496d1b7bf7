"""What an SFT checkpoint holds and how a run continues from one (S1): ``DIR/checkpoints/step_K/`` holds
``policy/`` (the LoRA adapter or the full model's fp32 masters, safetensors) and ``trainer_state.pt`` (optimiser,
schedule, loss scaler, the data position — epoch, step in it, the generator as the epoch began —, every process's
RNG state, a digest of the tokenised training rows), written atomically and fsync'd by :mod:`tether.checkpoint`.
``--resume`` continues from the newest: the same batches in the same order, the same weights as a straight run,
bit for bit (``tests/test_sft.py``). Whether a directory starts, resumes or is refused is decided here too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tether.checkpoint import list_checkpoints, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from tether.errors import TetherError
from tether.sharding import full_model_state, full_optimizer_state, load_full_optimizer_state, load_sharded_checkpoint

METADATA_FILE = "tether_sft.json"  # written last into a finished output directory: what was trained, how
RUN_FILES = {"checkpoints", "config.yaml", "metrics.jsonl", "alerts.jsonl", "samples"}  # what a run writes as it goes
# What may differ between a run and its --resume: how it saves, logs, shows progress and evaluates.
RESUMABLE_CHANGES = ("save_every", "save_every_minutes", "keep_checkpoints", "log_with", "tracker_project",
                     "tensorboard", "progress", "collective_timeout_minutes", "eval.", "model.export_lora", "output_dir")


def start_in_place(out_dir: Path, resume: bool, tracker_project: str) -> tuple[bool, str]:
    """Whether the run resumes, and the note to print once the inputs are checked. A directory with a checkpoint
    needs ``resume``; a finished one (no checkpoint) is replaced by a new run and cannot be resumed; one holding only
    what a run writes before its first checkpoint starts again in place; anything else is the user's and refused."""
    if not out_dir.exists():
        return False, ""
    if not out_dir.is_dir():
        raise TetherError(f"--output-dir {out_dir}: exists and is not a directory")
    if list_checkpoints(out_dir):
        if not resume:
            raise TetherError(f"--output-dir {out_dir}: holds an unfinished run; use --resume to continue it or "
                              f"choose another directory")
        return True, ""
    finished = (out_dir / METADATA_FILE).is_file()
    ours = finished or all(p.name in RUN_FILES or p.name == tracker_project or p.name.startswith((".tmp-", ".old-"))
                           for p in out_dir.iterdir())
    if not ours:
        raise TetherError(f"--output-dir {out_dir}: exists and is not a tether SFT run; refusing to replace it")
    if resume and finished:
        raise TetherError(f"--resume: {out_dir} holds a finished run (no checkpoint left); nothing to resume")
    if finished:
        return False, f"tether sft: replacing the finished run in {out_dir}"
    if any(out_dir.iterdir()):
        return False, f"tether sft: {out_dir} has no complete checkpoint; starting from step 0 in place"
    return False, ""


def check_same_config(cfg, out_dir: Path) -> None:
    """--resume continues the saved run exactly: the settings that shape the training must be the saved ones (the
    first difference is a one-line error). A model or data given from Python is named ``python:...`` in both."""
    from tether.config import config_differences

    saved = out_dir / "config.yaml"
    if saved.is_file():
        for key, value, then in config_differences(cfg, saved, RESUMABLE_CHANGES)[:1]:
            raise TetherError(f"--resume: {key} is {value!r} but the run in {out_dir} was made with {then!r} "
                              f"(config.yaml); resume with the same settings or start a new --output-dir")


def checkpoint_due(run, cfg, step: int, last_save: float) -> bool:
    """Save after this step? Every ``save_every`` steps, once ``save_every_minutes`` have passed since the last
    save. The main process's clock decides for all (processes save together)."""
    due = bool(cfg.save_every and step % cfg.save_every == 0) or bool(
        cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes)
    return bool(run.processes.broadcast(due))


def checkpoint(run, cfg, out_dir: Path, step: int, skip_streak: int) -> Path | None:
    """Checkpoint ``step`` (weights and trainer state from the main process, every process's RNG state); every
    process takes part (FSDP2 gathers full states on the main process) and waits for it. Its path on the main
    process."""
    rngs = run.processes.gather_objects(rng_state())
    model_state = optimizer_state = None
    if run.fsdp is not None:
        model_state = full_model_state(run.unwrapped)
        optimizer_state = full_optimizer_state(run.unwrapped, run.optimizer)
    saved = None
    if run.processes.is_main:
        state = {"step": step, "stream": run.stream.state_dict(), "rng_per_rank": rngs, "skip_streak": skip_streak,
                 "optimizer": optimizer_state if optimizer_state is not None else run.optimizer.state_dict(),
                 "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
                 "data_digest": run.data_info["digest"]}
        saved = save_checkpoint(out_dir, step, run.unwrapped, None, state, cfg.keep_checkpoints,
                                policy_state=model_state)
    run.processes.wait()
    return saved


def restore(run, out_dir: Path) -> tuple[int, int]:
    """Load the newest checkpoint into ``run`` on every process; returns ``(step, skip streak)``."""
    path = list_checkpoints(out_dir)[-1]
    if run.fsdp is not None:
        state = load_sharded_checkpoint(path, run.unwrapped, None)
        load_full_optimizer_state(run.unwrapped, run.optimizer, state["optimizer"])
    else:
        state = load_checkpoint(path, run.unwrapped, None)
        run.optimizer.load_state_dict(state["optimizer"])
    if state["data_digest"] != run.data_info["digest"]:
        raise TetherError(f"--resume: the training rows differ from those of {path} (the same data and settings "
                          f"are needed to continue exactly)")
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.stream.load_state_dict(state["stream"])
    rngs = state["rng_per_rank"]
    if len(rngs) != run.processes.world_size:
        raise TetherError(f"--resume: {path} was written by {len(rngs)} process(es), this launch has "
                          f"{run.processes.world_size}; resume with the same number")
    set_rng_state(rngs[run.processes.rank])
    return int(state["step"]), int(state.get("skip_streak", 0))


def finished_files(out_dir: Path) -> set[str]:
    """The model files a previous export wrote into ``out_dir`` (a resumed stopped run exports again)."""
    meta = out_dir / METADATA_FILE
    if not meta.is_file():
        return set()
    try:
        return set(json.loads(meta.read_text(encoding="utf-8")).get("policy_files", []))
    except (OSError, ValueError):
        return set()

