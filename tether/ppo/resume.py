"""What a PPO checkpoint holds and how a run continues from one (B14): the trainer state beside the weights,
restoring it (optimisers, schedules at their position, KL controller, score normaliser, data position, every
process's RNG, the health bookkeeping: the rollback targets and the non-finite skip streak), when a checkpoint is due, whether a run directory starts in place or resumes, and the settings
a resume must keep. The files themselves are :mod:`tether.checkpoint`'s.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tether.checkpoint import (checkpoint_dir, list_checkpoints, load_checkpoint, rng_state, save_checkpoint,
                               set_rng_state)
from tether.diagnostics.best import BEST_DIR, BEST_JSON, RULE
from tether.errors import TetherError
from tether.sharding import (
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
    load_sharded_checkpoint,
)


def trainer_state(run, step: int, rng_per_rank: list[dict], optimizers: tuple[dict, dict] | None = None,
                  in_flight: list | None = None, health: dict | None = None) -> dict:
    """Everything but the weights that the run needs to continue exactly; ``rng_per_rank``: every process's
    RNG state in rank order (each process samples its own responses). ``rng`` (rank 0's) stays for
    checkpoints read by older versions. ``optimizers``: the (policy, critic) optimiser states gathered from
    sharded models, in place of the local ones. A run without a critic (B17) saves None for its states.
    ``in_flight``: one step off (C7), every trainer's batch in flight, in rank order (tether.ppo.offpolicy).
    ``health``: the trainer's health bookkeeping (:func:`health_book`)."""
    o, d = run.optim, run.data
    optimizers = optimizers or (o.policy_optimizer.state_dict(), state_of(o.critic_optimizer))
    return {"step": step, "policy_optimizer": optimizers[0], "critic_optimizer": optimizers[1],
            "policy_scheduler": o.policy_scheduler.state_dict(), "critic_scheduler": state_of(o.critic_scheduler),
            "kl_controller": o.kl_controller.state_dict(), "running_scores": d.running_scores.state_dict(),
            "prompts": d.prompts.state_dict(), "rng": rng_per_rank[0], "rng_per_rank": rng_per_rank,
            "grad_scaler": o.scaler.state_dict(),  # fp16's loss scale and its growth count; {} otherwise
            "reference_answers": d.reference_answers, "health": health or health_book([], 0),
            "weight_versions": {"trainer": run.versions.trainer, "engine": run.versions.engine},
            **({"in_flight": in_flight} if in_flight is not None else {})}


def health_book(healthy_checkpoints: list[tuple[int, Path]], skip_streak: int, best: dict | None = None) -> dict:
    """What the trainer's health decisions carry from step to step, for a checkpoint: the steps of the checkpoints
    saved while no band was in alarm (``--rollback-on-alarm``'s targets) and the streak of steps whose optimizer
    updates were all skipped (B16's stop). Without them a resumed run had nothing to roll back to where the
    uninterrupted run rolled back, and restarted the streak at 0. ``best``: the best evaluation so far and the
    evaluations seen (``{"best": BestEvaluation dict or None, "seen": n}``), so that a resumed run judges its next
    evaluations against it (``--keep-best``)."""
    return {"healthy_steps": [int(step) for step, _ in healthy_checkpoints], "skip_streak": int(skip_streak),
            "best": best or {"best": None, "seen": 0}}


def from_health_book(book: dict, run_dir: Path) -> tuple[list[tuple[int, Path]], int]:
    """(healthy checkpoints as (step, path), skip streak) of a restored :func:`health_book`; a checkpoint saved
    before the book was ({}): none, 0 — as such runs resumed before."""
    steps = book.get("healthy_steps", [])
    return [(int(s), checkpoint_dir(run_dir, int(s))) for s in steps], int(book.get("skip_streak", 0))


def state_of(x) -> dict | None:
    """``x.state_dict()``, or None for the critic's optimiser and schedule of a run without a critic."""
    return None if x is None else x.state_dict()


def restore_rng(run, state: dict) -> None:
    """This process's RNG state; a checkpoint from another number of processes (or from a version that
    saved rank 0's only) cannot continue the others' streams exactly: say so and reseed them."""
    p = run.processes
    per_rank = state.get("rng_per_rank")
    if per_rank is not None and len(per_rank) == p.world_size:
        set_rng_state(per_rank[p.rank])
        return
    set_rng_state(state["rng"])
    if p.world_size > 1:
        if p.rank > 0:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())) + p.rank)
        if p.is_main:
            saved = len(per_rank) if per_rank is not None else 1
            print(f"note: the checkpoint holds RNG states of {saved} process(es), this run has {p.world_size}: "
                  f"processes other than 0 continue from new streams (not bitwise the uninterrupted run)")


def restore(run, run_dir: Path) -> tuple[int, dict]:
    """Load the newest complete checkpoint into ``run``; returns its step and its health bookkeeping
    (:func:`health_book`; {} for a checkpoint saved without it)."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise TetherError(f"--resume: {run_dir} has no complete checkpoint")
    o, d, m = run.optim, run.data, run.models
    state = load_weights(run, checkpoints[-1])
    if m.fsdp is not None:  # full optimiser states keyed by parameter name; each process keeps its shard
        load_full_optimizer_state(m.policy_model, o.policy_optimizer, state["policy_optimizer"])
        if m.critic is not None:
            load_full_optimizer_state(m.critic, o.critic_optimizer, state["critic_optimizer"])
    else:
        o.policy_optimizer.load_state_dict(state["policy_optimizer"])
        if m.critic is not None:
            o.critic_optimizer.load_state_dict(state["critic_optimizer"])
    # Only the schedules' positions come from the checkpoint: their shape is this run's (--steps may have grown).
    o.policy_scheduler = continue_schedule(o.policy_scheduler, state["policy_scheduler"]["last_epoch"])
    if m.critic is not None:
        o.critic_scheduler = continue_schedule(o.critic_scheduler, state["critic_scheduler"]["last_epoch"])
    o.kl_controller.load_state_dict(state["kl_controller"])
    if state.get("grad_scaler"):  # fp16 (a resumed run has the saved --model-dtype: check_same_config)
        o.scaler.load_state_dict(state["grad_scaler"])
    d.running_scores.load_state_dict(state["running_scores"])
    d.prompts.load_state_dict(state["prompts"])
    d.reference_answers = state.get("reference_answers")
    versions = state.get("weight_versions", {})  # the engine is synced again at its first step: the same count
    run.versions.trainer, run.versions.engine = int(versions.get("trainer", 0)), int(versions.get("engine", 0))
    restore_in_flight(run, state.get("in_flight"))
    restore_rng(run, state)
    return int(state["step"]), state.get("health") or {}


def restore_in_flight(run, in_flight: list | None) -> None:
    """One step off (C7): this trainer's batch in flight at the checkpoint, ready for the next step. Saved by
    another number of trainers, or by a synchronous run, there is none to take: the next step samples its own."""
    ahead, p = run.data.ahead, run.processes
    if ahead is None:
        return
    mine = in_flight[p.rank] if in_flight is not None and len(in_flight) == p.world_size else None
    if in_flight is not None and mine is None and p.is_main:
        print(f"note: the checkpoint holds the batches in flight of {len(in_flight)} trainer(s), this run has "
              f"{p.world_size}: the next step samples anew (not bitwise the uninterrupted run)")
    ahead.load_state_dict(run, mine)


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, updates_done: int):
    """``scheduler`` (made by :func:`~tether.ppo.setup.make_optimisation` for this run's total of updates,
    steps × epochs × minibatches) moved to ``updates_done``, the optimizer updates the checkpoint had made, with
    each param group's LR set to that position's value, lr = base_lr × λ(updates_done): what the next update
    uses. The checkpoint's schedule and its optimizer state's LR were for the saved run's --steps: resumed with
    more steps, a finished linear decay would give LR 0. With the same --steps, the same LRs as the straight run
    (the scheduler's own step computes base_lr × λ(n) too)."""
    # A LambdaLR made at last_epoch n − 1 takes its first step to n on construction (public API, no state poking).
    return torch.optim.lr_scheduler.LambdaLR(scheduler.optimizer, scheduler.lr_lambdas, last_epoch=updates_done - 1)


def start_in_place(run_dir: Path, resume: bool) -> tuple[bool, str]:
    """Whether the run resumes, from what ``run_dir`` holds (B14), and the line to print once the inputs
    are checked. A directory with a complete checkpoint needs --resume; one without (a run killed before
    its first checkpoint) starts again at step 0, saying what it replaces, whether or not --resume was given."""
    if list_checkpoints(run_dir):
        if not resume:
            raise TetherError(f"--output-dir {run_dir}: already holds a run; use --resume to continue it "
                              f"or choose another directory")
        return True, ""
    metrics = run_dir / "metrics.jsonl"
    if not (resume or metrics.exists()):
        return False, ""
    rows = len([line for line in metrics.read_bytes().splitlines() if line.strip()]) if metrics.is_file() else 0
    return False, (f"tether ppo: {run_dir} has no complete checkpoint; starting from step 0 in place "
                   f"(replacing {rows} metric rows)")


# What may change between a run and its --resume: how long it runs, how it logs and saves, what it watches.
RESUMABLE_CHANGES = ("steps", "save_every", "save_every_minutes", "keep_checkpoints", "log_with", "tracker_project",
                     "tensorboard", "progress", "collective_timeout_minutes", "eval.", "health.", "model.export_lora")


def check_same_config(cfg, run_dir: Path) -> None:
    """--resume continues the saved run exactly, so the settings that shape the training must be the saved
    ones: the first difference is a one-line error."""
    import yaml

    from tether.config import config_differences, flatten

    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = flatten(yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {})
    except (yaml.YAMLError, AttributeError):
        raise TetherError(f"{saved_path}: not a readable config; cannot check --resume against it") from None
    if "ppo.target_kl" not in saved and "kl.target" in saved:  # saved before the key: its early stop read kl.target
        saved["ppo.target_kl"] = saved["kl.target"]
    if "kl.k3_clip" not in saved:  # saved before the key (#42): a run that used k3 never clipped it
        used_k3 = saved.get("kl.estimator") == "k3" or saved.get("kl.penalty_in") == "loss"
        saved["kl.k3_clip"] = 0.0 if used_k3 else cfg.kl.k3_clip
    for key, value, then in config_differences(cfg, saved, RESUMABLE_CHANGES + ("output_dir",))[:1]:
        raise TetherError(f"--resume: {key} is {value!r} but the run in {run_dir} was made with {then!r} "
                          f"(config.yaml); resume with the same settings or start a new --output-dir")


def checkpoint_due(run, cfg, step: int, last_save: float) -> bool:
    """Save after this step? Every ``save_every`` steps, once ``save_every_minutes`` have passed since the
    last save, and at the end. The main process's clock decides for all (ranks must save together)."""
    due = step == cfg.steps or bool(cfg.save_every and step % cfg.save_every == 0) or bool(
        cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes)
    if run.processes.world_size > 1:
        flag = [due]
        torch.distributed.broadcast_object_list(flag, src=0)
        due = flag[0]
    return due


def load_weights(run, path: Path) -> dict:
    """Load checkpoint ``path``'s weights into the run's models on this process; returns its trainer state.
    Collective under FSDP2 (every process keeps its shard)."""
    m = run.models
    if m.fsdp is not None:
        return load_sharded_checkpoint(path, m.policy_model, m.critic)
    return load_checkpoint(path, m.unwrapped_policy, m.unwrapped_critic)


def checkpoint(run, cfg, run_dir: Path, step: int, health: dict | None = None, best: dict | None = None
               ) -> Path | None:
    """Save checkpoint ``step`` (weights and trainer state from the main process, every process's RNG
    state, one step off every trainer's batch in flight, the main process's ``health`` bookkeeping); every process
    waits for it. Returns its path on the main process. ``best``: the checkpoint of the best evaluation
    (``--keep-best``) — written to ``RUN_DIR/best`` outside the rotation, with ``best.json`` (``best``) and
    ``model/`` (the policy as :mod:`tether.ppo.export` writes it, tokenizer beside it), in one atomic rename."""
    ahead = run.data.ahead
    in_flight = run.processes.gather_objects(ahead.state_dict(run)) if ahead is not None else None
    rng_per_rank = run.processes.gather_objects(rng_state())
    m, o = run.models, run.optim
    sharded = {}
    if m.fsdp is not None:  # full states gathered on the main process (collective)
        critic = m.critic is not None
        sharded = {"policy_state": full_model_state(m.policy_model),
                   "critic_state": full_model_state(m.critic) if critic else None,
                   "optimizers": (full_optimizer_state(m.policy_model, o.policy_optimizer),
                                  full_optimizer_state(m.critic, o.critic_optimizer) if critic else None)}
    saved = None
    if run.processes.is_main:
        state = trainer_state(run, step, rng_per_rank, sharded.pop("optimizers", None), in_flight, health)
        also = target = None
        if best is not None:
            target, also = run_dir / BEST_DIR, best_files(run, cfg, best, sharded.get("policy_state"))
        saved = save_checkpoint(run_dir, step, m.unwrapped_policy, m.unwrapped_critic, state, cfg.keep_checkpoints,
                                **sharded, target=target, also=also)
    run.processes.wait()
    return saved


def best_files(run, cfg, best: dict, policy_state: dict | None):
    """What ``RUN_DIR/best`` holds beside the checkpoint: ``best.json`` (the evaluation, how it was chosen) and
    ``model/``, the policy as the run's final export would write it (merged LoRA or the adapter, ``--model-dtype``,
    the tokenizer), loadable with ``from_pretrained`` and as a new run's ``--policy``."""
    import json

    from tether.export import write_policy

    def also(tmp: Path) -> None:
        (tmp / BEST_JSON).write_text(json.dumps({**best, "rule": RULE}, indent=1) + "\n", encoding="utf-8")
        write_policy(tmp / "model", run.models.unwrapped_policy, run.models.tokenizer, cfg.model.export_lora,
                     cfg.model.dtype, policy_state)
    return also
