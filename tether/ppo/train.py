"""The PPO run around :func:`tether.ppo.step.ppo_step`: resume, the step loop with progress, evaluation on
held-out prompts (B13), checkpoints (B14), live health alerts (D3), and the final policy export.

Run directory: ``config.yaml``, ``metrics.jsonl`` (one row per step), ``samples/step_K.jsonl``,
``alerts.jsonl``, ``checkpoints/step_K/``, and ``policy/`` (the final policy as a plain Hugging Face
model directory, LoRA merged). What is written, and by which process, is :class:`~tether.ppo.runlog.RunLog`'s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tether.checkpoint import (
    atomic_dir,
    check_finite,
    clean_temporary,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_pretrained,
    set_rng_state,
)
from tether.errors import TetherError
from tether.ppo.evaluate import evaluate
from tether.ppo.runlog import RunLog
from tether.ppo.sharding import (
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
    load_sharded_checkpoint,
)
from tether.ppo.step import ppo_step


def trainer_state(run, step: int, rng_per_rank: list[dict], optimizers: tuple[dict, dict] | None = None) -> dict:
    """Everything but the weights that the run needs to continue exactly; ``rng_per_rank``: every process's
    RNG state in rank order (each process samples its own responses). ``rng`` (rank 0's) stays for
    checkpoints read by older versions. ``optimizers``: the (policy, critic) optimiser states gathered from
    sharded models, in place of the local ones."""
    o, d = run.optim, run.data
    optimizers = optimizers or (o.policy_optimizer.state_dict(), o.critic_optimizer.state_dict())
    return {"step": step, "policy_optimizer": optimizers[0], "critic_optimizer": optimizers[1],
            "policy_scheduler": o.policy_scheduler.state_dict(), "critic_scheduler": o.critic_scheduler.state_dict(),
            "kl_controller": o.kl_controller.state_dict(), "running_scores": d.running_scores.state_dict(),
            "prompts": d.prompts.state_dict(), "rng": rng_per_rank[0], "rng_per_rank": rng_per_rank,
            "grad_scaler": o.scaler.state_dict()}  # fp16's loss scale and its growth count; {} otherwise


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


def restore(run, run_dir: Path) -> int:
    """Load the newest complete checkpoint into ``run``; returns its step."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise TetherError(f"--resume: {run_dir} has no complete checkpoint")
    o, d, m = run.optim, run.data, run.models
    state = load_weights(run, checkpoints[-1])
    if m.fsdp is not None:  # full optimiser states keyed by parameter name; each process keeps its shard
        load_full_optimizer_state(m.policy_model, o.policy_optimizer, state["policy_optimizer"])
        load_full_optimizer_state(m.critic, o.critic_optimizer, state["critic_optimizer"])
    else:
        o.policy_optimizer.load_state_dict(state["policy_optimizer"])
        o.critic_optimizer.load_state_dict(state["critic_optimizer"])
    # Only the schedules' positions come from the checkpoint: their shape is this run's (--steps may have grown).
    o.policy_scheduler = continue_schedule(o.policy_scheduler, state["policy_scheduler"]["last_epoch"])
    o.critic_scheduler = continue_schedule(o.critic_scheduler, state["critic_scheduler"]["last_epoch"])
    o.kl_controller.load_state_dict(state["kl_controller"])
    if state.get("grad_scaler"):  # fp16 (a resumed run has the saved --model-dtype: check_same_config)
        o.scaler.load_state_dict(state["grad_scaler"])
    d.running_scores.load_state_dict(state["running_scores"])
    d.prompts.load_state_dict(state["prompts"])
    restore_rng(run, state)
    return int(state["step"])


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
                     "tensorboard", "progress", "collective_timeout_minutes", "eval.", "health.")


def check_same_config(cfg, run_dir: Path) -> None:
    """--resume continues the saved run exactly, so the settings that shape the training must be the saved
    ones: the first difference is a one-line error."""
    import yaml

    from tether.config import config_to_dict, flatten

    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = flatten(yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {})
    except (yaml.YAMLError, AttributeError):
        raise TetherError(f"{saved_path}: not a readable config; cannot check --resume against it") from None
    if "ppo.target_kl" not in saved and "kl.target" in saved:  # saved before the key: its early stop read kl.target
        saved["ppo.target_kl"] = saved["kl.target"]
    for key, value in flatten(config_to_dict(cfg)).items():
        if key.startswith(RESUMABLE_CHANGES) or key == "output_dir" or key not in saved:
            continue
        if saved[key] != value:
            raise TetherError(f"--resume: {key} is {value!r} but the run in {run_dir} was made with {saved[key]!r} "
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


def note_non_finite(log: RunLog, step: int, notes: list[str], streak: int, limit: int) -> int:
    """Alert lines for rows dropped and updates skipped (B16); returns the new streak of steps with no
    applied update, and stops the run (one-line error) when it reaches ``limit``."""
    for note in notes:
        log.alert(step, note)
    if streak >= limit:
        log.close()
        raise TetherError(f"step {step}: {streak} consecutive steps skipped every optimizer update (non-finite "
                          f"loss or gradient norm; health.max_skipped_steps={limit}); stopped. The weights of the "
                          f"last complete checkpoint are intact; alerts.jsonl names the bad rows")
    return streak


def load_weights(run, path: Path) -> dict:
    """Load checkpoint ``path``'s weights into the run's models on this process; returns its trainer state.
    Collective under FSDP2 (every process keeps its shard)."""
    m = run.models
    if m.fsdp is not None:
        return load_sharded_checkpoint(path, m.policy_model, m.critic)
    return load_checkpoint(path, m.unwrapped_policy, m.unwrapped_critic)


def export_policy(run, run_dir: Path) -> Path | None:
    """The final policy as a plain Hugging Face directory (LoRA merged into a copy), with its tokenizer,
    written by the main process. Every process calls it: a sharded policy is gathered first (collective)."""
    model = run.models.unwrapped_policy
    state = full_model_state(model) if run.models.fsdp is not None else None
    if not run.processes.is_main:
        return None
    check_finite(model, f"{run_dir / 'policy'}", state)  # refused (one line) if a weight is NaN/Inf

    def write(tmp: Path):
        if hasattr(model, "peft_config"):
            merged_lora_copy(model, state).save_pretrained(tmp, safe_serialization=True)
        else:
            save_pretrained(model, tmp, state)
        run.models.tokenizer.save_pretrained(tmp)

    return atomic_dir(run_dir / "policy", write)


def merged_lora_copy(model, state: dict | None):
    """A plain copy of the LoRA policy with the adapter merged. ``state``: the full state dict of a sharded
    policy (its base is reloaded from the adapter's base path and the state loaded into it)."""
    import copy

    if state is None:
        return copy.deepcopy(model).merge_and_unload()
    from peft import get_peft_model

    from tether.ppo.models import load_causal_lm

    config = copy.deepcopy(model.peft_config["default"])
    dtype = next(v.dtype for k, v in state.items() if "lora_" not in k and v.is_floating_point())
    base = load_causal_lm(config.base_model_name_or_path, {torch.float32: "fp32", torch.bfloat16: "bf16",
                                                           torch.float16: "fp16"}[dtype])
    plain = get_peft_model(base, config)
    plain.load_state_dict(state, strict=True)
    return plain.merge_and_unload()


def evaluate_and_log(run, cfg, log: RunLog, step: int) -> dict:
    """Evaluate on the main process (the others get no eval metrics) and write its samples. A sharded policy's
    forward, and a collective engine's generate, are collective: every process evaluates the same rows, the main
    process's figures are kept."""
    if not run.processes.is_main and run.models.fsdp is None and not run.models.engine.collective:
        return {}
    metrics, samples = evaluate(run, cfg, step)
    if not run.processes.is_main:
        return {}
    log.samples(step, samples, cfg.eval.samples)
    return metrics


def checkpoint(run, cfg, run_dir: Path, step: int) -> Path | None:
    """Save checkpoint ``step`` (weights and trainer state from the main process, every process's RNG
    state); every process waits for it. Returns its path on the main process."""
    rng_per_rank = run.processes.gather_objects(rng_state())
    m, o = run.models, run.optim
    sharded = {}
    if m.fsdp is not None:  # full states gathered on the main process (collective)
        sharded = {"policy_state": full_model_state(m.policy_model), "critic_state": full_model_state(m.critic),
                   "optimizers": (full_optimizer_state(m.policy_model, o.policy_optimizer),
                                  full_optimizer_state(m.critic, o.critic_optimizer))}
    saved = None
    if run.processes.is_main:
        state = trainer_state(run, step, rng_per_rank, sharded.pop("optimizers", None))
        saved = save_checkpoint(run_dir, step, m.unwrapped_policy, m.unwrapped_critic, state, cfg.keep_checkpoints,
                                **sharded)
    run.processes.wait()
    return saved


def train(cfg, resume: bool = False) -> Path:
    """Run (or resume) PPO as configured; returns the run directory."""
    from tqdm.auto import tqdm

    from tether.diagnostics.health import HealthMonitor
    from tether.ppo.setup import setup

    from tether.ppo.layout import launch_layout

    if launch_layout(cfg).is_rollout:  # disaggregated layout: this process only generates (tether.ppo.rollout_process)
        from tether.ppo.rollout_process import serve

        return serve(cfg)
    run_dir = Path(cfg.output_dir)
    resume, note = start_in_place(run_dir, resume)
    if resume:
        check_same_config(cfg, run_dir)
    run = setup(cfg)
    if run.processes.is_main:  # the inputs are good: only now is anything in run_dir touched
        clean_temporary(run_dir)
        if note:
            print(note, file=sys.stderr)
    start = restore(run, run_dir) if resume else 0
    log = RunLog(run_dir, run.processes, cfg)
    monitor = HealthMonitor(cfg.health)
    for row in log.start(cfg, start if resume else None):  # replay history: alerts fire on new crossings only
        monitor.update(row["step"], row)
    healthy_checkpoints: list[tuple[int, Path]] = []  # saved while no band was in alarm
    bar = tqdm(range(start + 1, cfg.steps + 1), desc="ppo", initial=start, total=cfg.steps,
               disable=not (cfg.progress and run.processes.is_main), dynamic_ncols=True)
    stopped_by_alarm = False
    last_save, skip_streak = time.monotonic(), 0
    if cfg.eval.every and cfg.eval.at_start and start == 0:
        log.metrics({"step": 0, **evaluate_and_log(run, cfg, log, 0)})
    for step in bar:
        metrics = ppo_step(run, cfg, step)
        notes = metrics.pop("health/notes", [])
        skip_streak = skip_streak + 1 if metrics["ppo/updates"] == 0 else 0
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
            metrics.update(evaluate_and_log(run, cfg, log, step))
        row = {"step": step, **metrics}
        alerts = monitor.update(step, row, final=step == cfg.steps)
        log.metrics(row)
        for alert in alerts:
            log.alert(step, alert)
        note_non_finite(log, step, notes, skip_streak, cfg.health.max_skipped_steps)
        bar.set_postfix(score=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.4f}",
                        beta=f"{row['objective/kl_coef']:.3g}")
        if checkpoint_due(run, cfg, step, last_save):
            saved = checkpoint(run, cfg, run_dir, step)
            last_save = time.monotonic()
            if saved is not None and monitor.healthy:
                healthy_checkpoints.append((step, saved))
        # The main process decides (only it has the evaluation metrics the gold band reads), every process follows.
        if run.processes.broadcast(bool(alerts) and (cfg.health.stop_on_alarm or cfg.health.rollback)):
            stopped_by_alarm = True
            log.print(f"[health] stopping at step {step} (health alarm)")
            break
    bar.close()
    log.close()
    if stopped_by_alarm and cfg.health.rollback:
        rollback(run, log, monitor, healthy_checkpoints)
    if run.processes.world_size > 1 and run.models.fsdp is None:  # FSDP2 holds one sharded copy: nothing to compare
        check_ranks_in_sync(run, log, run_dir)
    export_policy(run, run_dir)
    run.processes.close()
    return run_dir


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

    mine = {"policy": digest(run.models.unwrapped_policy), "critic": digest(run.models.unwrapped_critic)}
    gathered = [None] * run.processes.world_size
    torch.distributed.all_gather_object(gathered, mine)
    in_sync = all(g == gathered[0] for g in gathered)
    if run.processes.is_main:
        (run_dir / "ranks.json").write_text(json.dumps({"world_size": run.processes.world_size, "in_sync": in_sync,
                                                        "digests": gathered}, indent=1), encoding="utf-8")
    if not in_sync:
        log.print("[ddp] warning: ranks hold different weights")
    return in_sync
