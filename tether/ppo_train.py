"""The PPO run around :func:`tether.ppo.ppo_step`: resume, the step loop with progress, evaluation on
held-out prompts (B13), checkpoints (B14), live health alerts (D3), and the final policy export.

Run directory: ``config.yaml``, ``metrics.jsonl`` (one row per step), ``samples/step_K.jsonl``,
``alerts.jsonl``, ``checkpoints/step_K/``, and ``policy/`` (the final policy as a plain Hugging Face
model directory, LoRA merged).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tether.checkpoint import atomic_dir, list_checkpoints, load_checkpoint, rng_state, save_checkpoint, \
    set_rng_state
from tether.config import save_config
from tether.errors import TetherError
from tether.kl import kl_penalty
from tether.ppo import rollout_batch, ppo_step, write_jsonl
from tether.prompts import collate_fields
from tether.rewards import call_rule, score_responses
from tether.rollout import forward_response


def evaluate_and_save(c, cfg, run_dir: Path, step: int) -> dict:
    """Evaluate on the main process and write ``samples/step_K.jsonl``; the eval metrics (empty elsewhere)."""
    eval_metrics, samples = evaluate(c, cfg, step) if c.is_main else ({}, [])
    if c.is_main and samples:
        path = run_dir / "samples" / f"step_{step}.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in samples[: cfg.eval.samples]), encoding="utf-8")
    return eval_metrics


@torch.no_grad()
def evaluate(c, cfg, step: int) -> tuple[dict, list[dict]]:
    """Mean reward and gold accuracy on held-out prompts (B13), with per-response samples."""
    rows = (c.eval_rows or [])[: cfg.eval.n]
    if not rows:
        return {}, []
    model = c.unwrapped_policy
    samples, scores_all, correct_all = [], [], []
    for start in range(0, len(rows), cfg.batch_size):
        chunk = rows[start:start + cfg.batch_size]
        prompts, fields = [r["prompt"] for r in chunk], collate_fields(chunk)
        batch, responses = rollout_batch(c, cfg, chunk, greedy=cfg.eval.greedy)
        logprobs, _, _ = forward_response(model, batch, cfg.generation.temperature)
        with c.policy.reference_model(model) as reference:
            logprobs_ref, _, _ = forward_response(reference, batch, cfg.generation.temperature)
        kl = (kl_penalty(logprobs, logprobs_ref, cfg.kl.estimator) * batch.response_mask).sum(dim=1)
        scores = score_responses(c.sources, prompts, responses, fields)
        correct = call_rule(c.gold, prompts, responses, fields) if c.gold is not None else None
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            sample = {"prompt": prompt, "response": response, "score": float(scores[i]), "kl": float(kl[i]),
                      "length": int(batch.response_mask[i].sum()), "truncated": not bool(batch.ended_with_eos[i])}
            if correct is not None:
                sample["correct"] = bool(correct[i] > 0.5)
            samples.append(sample)
        scores_all.append(scores)
        if correct is not None:
            correct_all.append(correct)
    metrics = {"eval/reward": float(torch.cat(scores_all).mean()), "eval/n": len(samples),
               "eval/kl_sequence": sum(s["kl"] for s in samples) / len(samples)}
    if correct_all:
        metrics["eval/accuracy"] = float((torch.cat(correct_all) > 0.5).float().mean())
    return metrics, samples


def trainer_state(c, step: int) -> dict:
    return {"step": step, "policy_optimizer": c.policy_optimizer.state_dict(),
            "critic_optimizer": c.critic_optimizer.state_dict(),
            "policy_scheduler": c.policy_scheduler.state_dict(), "critic_scheduler": c.critic_scheduler.state_dict(),
            "kl_controller": c.kl_controller.state_dict(), "running_scores": c.running_scores.state_dict(),
            "prompts": c.prompts.state_dict(), "rng": rng_state()}


def restore(c, run_dir: Path) -> int:
    """Load the newest complete checkpoint into ``c``; returns its step."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise TetherError(f"--resume: {run_dir} has no complete checkpoint")
    state = load_checkpoint(checkpoints[-1], c.unwrapped_policy, c.unwrapped_critic)
    c.policy_optimizer.load_state_dict(state["policy_optimizer"])
    c.critic_optimizer.load_state_dict(state["critic_optimizer"])
    c.policy_scheduler.load_state_dict(state["policy_scheduler"])
    c.critic_scheduler.load_state_dict(state["critic_scheduler"])
    c.kl_controller.load_state_dict(state["kl_controller"])
    c.running_scores.load_state_dict(state["running_scores"])
    c.prompts.load_state_dict(state["prompts"])
    set_rng_state(state["rng"])
    return int(state["step"])


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop rows written after ``last_step`` (they are redone after a resume)."""
    if path.is_file():
        rows = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= last_step]
        path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")


def export_policy(c, run_dir: Path) -> Path:
    """The final policy as a plain Hugging Face directory (LoRA merged into a copy), with its tokenizer."""
    model = c.unwrapped_policy

    def write(tmp: Path):
        if hasattr(model, "peft_config"):
            import copy

            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        c.tokenizer.save_pretrained(tmp)

    return atomic_dir(run_dir / "policy", write)


def train(cfg, resume: bool = False) -> Path:
    """Run (or resume) PPO as configured; returns the run directory."""
    from tqdm.auto import tqdm

    from tether.health import HealthMonitor
    from tether.ppo_setup import setup

    run_dir = Path(cfg.output_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not resume and (metrics_path.exists() or list_checkpoints(run_dir)):
        raise TetherError(f"--output-dir {run_dir}: already holds a run; use --resume to continue it "
                          f"or choose another directory")
    c = setup(cfg)
    start = 0
    if resume:
        start = restore(c, run_dir)
        if c.is_main:
            truncate_jsonl(metrics_path, start)
            truncate_jsonl(run_dir / "alerts.jsonl", start)
    if c.is_main:
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    monitor = HealthMonitor(cfg.health)
    tensorboard = open_tensorboard(run_dir) if cfg.tensorboard and c.is_main else None
    if resume and metrics_path.is_file():  # replay history so alerts fire only on new crossings
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            monitor.update(row["step"], row)
    healthy_checkpoints: list[tuple[int, Path]] = []  # saved while no band was in alarm
    bar = tqdm(range(start + 1, cfg.steps + 1), desc="ppo", initial=start, total=cfg.steps,
               disable=not (cfg.progress and c.is_main), dynamic_ncols=True)
    stopped_by_alarm = False
    if cfg.eval.every and cfg.eval.at_start and start == 0:
        baseline = evaluate_and_save(c, cfg, run_dir, 0)
        if c.is_main:
            write_jsonl(metrics_path, {"step": 0, **baseline})
    for step in bar:
        metrics = ppo_step(c, cfg, step)
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
            metrics.update(evaluate_and_save(c, cfg, run_dir, step))
        row = {"step": step, **metrics}
        alerts = monitor.update(step, row)
        if c.is_main:
            write_jsonl(metrics_path, row)
            if tensorboard is not None:
                for key, value in metrics.items():
                    tensorboard.add_scalar(key, value, step)
            for alert in alerts:
                tqdm.write(f"[health] {alert}", file=sys.stderr)
                write_jsonl(run_dir / "alerts.jsonl", {"step": step, "alert": str(alert)})
            bar.set_postfix(score=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.4f}",
                            beta=f"{row['objective/kl_coef']:.3g}")
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            if c.is_main:
                saved = save_checkpoint(run_dir, step, c.unwrapped_policy, c.unwrapped_critic,
                                        trainer_state(c, step), cfg.keep_checkpoints)
                if monitor.healthy:
                    healthy_checkpoints.append((step, saved))
            c.accelerator.wait_for_everyone()
        if alerts and (cfg.health.stop_on_alarm or cfg.health.rollback):
            stopped_by_alarm = True
            if c.is_main:
                tqdm.write(f"[health] stopping at step {step} (health alarm)", file=sys.stderr)
            break
    bar.close()
    if tensorboard is not None:
        tensorboard.close()
    if stopped_by_alarm and cfg.health.rollback:
        rollback(c, monitor, healthy_checkpoints)
    if c.world_size > 1:
        check_ranks_in_sync(c, run_dir)
    if c.is_main:
        export_policy(c, run_dir)
    c.accelerator.wait_for_everyone()
    return run_dir


def open_tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TetherError("--tensorboard: the tensorboard package is not installed (pip install tensorboard)") from None
    return SummaryWriter(str(run_dir / "tensorboard"))


def rollback(c, monitor, healthy_checkpoints: list[tuple[int, Path]]) -> None:
    """Restore the newest checkpoint saved before the first alarm's onset (a checkpoint saved between
    onset and alarm counts as healthy, but its metric was already drifting)."""
    onset = min(alert.onset_step for alert in monitor.alerts())
    candidates = [path for step, path in healthy_checkpoints if step < onset and path.is_dir()]
    if not candidates:
        print(f"[health] no checkpoint saved before step {onset}: nothing to roll back to", file=sys.stderr)
        return
    load_checkpoint(candidates[-1], c.unwrapped_policy, c.unwrapped_critic)
    if c.is_main:
        print(f"[health] rolled back to {candidates[-1].name}; policy/ holds its weights", file=sys.stderr)


def check_ranks_in_sync(c, run_dir: Path) -> bool:
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

    mine = {"policy": digest(c.unwrapped_policy), "critic": digest(c.unwrapped_critic)}
    gathered = [None] * c.world_size
    torch.distributed.all_gather_object(gathered, mine)
    in_sync = all(g == gathered[0] for g in gathered)
    if c.is_main:
        (run_dir / "ranks.json").write_text(json.dumps({"world_size": c.world_size, "in_sync": in_sync,
                                                        "digests": gathered}, indent=1), encoding="utf-8")
        if not in_sync:
            print("[ddp] warning: ranks hold different weights", file=sys.stderr)
    return in_sync
