"""``tether ppo ... --dry-run``: what ``tether plan`` says about *this* run, and the reference's launch
checklist (000 §D.7) walked item by item for this config — then exit without loading a model or training.

The plan is the planner's (docs/plan.md) for the policy's own ``config.json``, this run's dtype, LoRA rank,
critic, batch per process, prompt + response length and number of processes; its simplifications are
printed with it (the critic and reward model are counted at the policy's size; a rule reward has no model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tether.diagnostics.engine_plan import engine_plan, format_engine_plan
from tether.diagnostics.plan import PlanConfig, format_plan, levers, plan
from tether.diagnostics.shapes import config_shape
from tether.ppo.checks import held_out_fraction
from tether.ppo.config import LOGIT_CHUNK_TOKENS
from tether.presets import resolve_model_config


@dataclass
class CheckItem:
    """One line of the launch checklist: what this run does, what the reference recommends."""

    name: str
    setting: str          # this run's value, as the user would set it
    recommended: str      # the reference's recommendation
    ok: bool
    stars: str            # the reference's importance


def launch_checklist(cfg) -> list[CheckItem]:
    """000 §D.7, in its order, for the run config ``cfg`` (a :class:`~tether.ppo.config.RunConfig`)."""
    k, p, r = cfg.kl, cfg.ppo, cfg.reward
    save = f"every {cfg.save_every} steps" if cfg.save_every else "only at the end"
    critic_free = cfg.advantage.critic_free  # B17: no critic, so nothing to clip or warm up
    advantage = (f"{cfg.advantage.estimator}, K = {cfg.samples_per_prompt}" if critic_free
                 else "per-batch z-score" if p.whiten_advantages else "off")
    length = ", ".join(([f"alpha = {r.length_penalty:g} per token"] if r.length_penalty else [])
                       + ([f"soft overlong over the last {r.overlong_buffer} tokens"] if r.overlong_buffer else [])
                       ) or "off"
    norm = f"clip [-{r.clip:g}, {r.clip:g}]" if r.clip else "no clip"
    norm += f", normalize {r.normalize}"
    return [
        # beta > 0 is the safeguard; the adaptive controller is one way to hold it (docs/defaults.md)
        CheckItem("KL penalty", f"{k.controller}, beta {k.coef:g}" + ("" if k.controller == "fixed" else
                                                                      f", target {k.target:g}"),
                  "beta > 0 (fixed, or --kl-controller adaptive with --kl-target 0.01 on long runs)", k.coef > 0,
                  "***"),
        CheckItem("advantage normalisation", advantage, "per-batch z-score", p.whiten_advantages or critic_free,
                  "***"),
        CheckItem("value clipping", "no critic" if critic_free else
                  f"eps_v {p.clip_range_value:g}" if p.clip_range_value else "off",
                  "eps_v 0.2", p.clip_range_value > 0 or critic_free, "***"),
        CheckItem("early stop by KL",
                  f"{p.early_stop_factor:g} x --ppo-early-stop-kl {p.target_kl:g}, every epoch" if p.early_stop else "off",
                  "checked every epoch", p.early_stop, "***"),
        CheckItem("held-out evaluation", f"every {cfg.eval_every} steps on {held_out_source(cfg)}" if cfg.eval_every
                  else "off", "every N steps", cfg.eval_every > 0, "***"),
        CheckItem("old log-probs recomputed train-side", "always", "recomputed by the trainer", True, "***"),
        CheckItem("critic warm-up", "no critic" if critic_free else
                  f"{cfg.critic.warmup_steps} steps" if cfg.critic.warmup_steps else "off",
                  "a few critic-only steps first", cfg.critic.warmup_steps > 0 or critic_free, "**"),
        CheckItem("reward clip / normalisation", norm, "r in [-5, 5]", 0 < r.clip <= 5 or r.normalize != "none",
                  "**"),
        CheckItem("gradient clipping", f"max norm {cfg.optim.max_grad_norm:g}" if cfg.optim.max_grad_norm else "off",
                  "grad norm <= 1.0", 0 < cfg.optim.max_grad_norm <= 1.0, "**"),
        CheckItem("length penalty", length, "alpha * len (when the reward favours length)",
                  r.length_penalty > 0 or r.overlong_buffer > 0, "**"),
        CheckItem("frequent checkpoints", save, "every 50 steps",
                  0 < cfg.save_every <= 50 or cfg.steps <= 50, "**"),
    ]


def held_out_source(cfg) -> str:
    """Where the held-out prompts come from, in the checklist's words."""
    if cfg.data.eval_prompts:
        return cfg.data.eval_prompts
    if cfg.data.prompts.startswith("rg:"):
        return f"{cfg.data.task_eval} task problems"
    return f"{held_out_fraction(cfg):g} of the prompts"

def format_checklist(items: list[CheckItem]) -> str:
    width = max(len(i.name) for i in items)
    set_width = max(len(i.setting) for i in items)
    lines = ["launch checklist (the usual PPO safeguards; *** matters most):"]
    for i in items:
        mark = "ok " if i.ok else "-- "
        advice = "" if i.ok else f"   recommended: {i.recommended}"
        lines.append(f"  {mark}{i.stars:<4}{i.name:<{width}}  {i.setting:<{set_width}}{advice}")
    return "\n".join(lines)


def run_plan_config(cfg, gpu_memory_gb: float) -> PlanConfig:
    """The planner's inputs for this run: one process = one device, ``WORLD_SIZE`` processes (of which the last
    ``--rollout-processes`` only generate: the trainers are the others), DDP (ZeRO-0), or ZeRO-3 when the launch
    config asks for FSDP2 (its full shard of weights, gradients and Adam state)."""
    from tether.sharding import fsdp_settings

    return PlanConfig(model=str(resolve_model_config(cfg.model.policy, what="policy")), dtype=cfg.model.dtype,
                      batch_size=cfg.rows_per_step, train_batch_size=cfg.minibatch_size // cfg.ppo.grad_accumulation,
                      logits_chunk=LOGIT_CHUNK_TOKENS, prompt_length=cfg.data.max_prompt_length,
                      response_length=cfg.generation.max_new_tokens, lora_r=cfg.model.lora_r, critic_lora_r=0,
                      lora_targets="all" if cfg.model.lora_target_modules == "all-linear" else "attn",
                      zero=3 if fsdp_settings() else 0,
                      gpus=max(1, int(os.environ.get("WORLD_SIZE", "1")) - cfg.generation.rollout_processes),
                      engine=cfg.generation.engine, engine_tp=cfg.generation.engine_tp,
                      rollout_processes=cfg.generation.rollout_processes,
                      gpu_memory=gpu_memory_gb,
                      gradient_checkpointing=cfg.model.gradient_checkpointing,
                      critic="none" if cfg.advantage.critic_free else cfg.critic.kind, value_head=cfg.critic.head)


def device_memory_gb() -> tuple[float, str]:
    """Memory of the device one process trains on: the GPU's, else this machine's RAM."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / 1e9, f"GPU {props.name}"
    import psutil

    return psutil.virtual_memory().total / 1e9, "CPU RAM"


def dry_run(cfg) -> str:
    """The text ``--dry-run`` prints."""
    gb, device = device_memory_gb()
    plan_cfg = run_plan_config(cfg, gb)
    shape = config_shape(plan_cfg.model)
    result = plan(shape, plan_cfg)
    has_rm = any(os.path.isdir(os.path.expanduser(s)) for s in cfg.reward.sources)
    notes = [f"dry run of `tether ppo` for {cfg.model.policy} on {device} ({gb:.1f} GB); nothing loaded or trained",
             "plan (the planner's model: " + ("no critic (--advantage " + cfg.advantage.estimator + "), three models; "
                                               if cfg.advantage.critic_free else "critic and ")
             + "reward model counted at the policy's size"
             + ("" if has_rm else "; this run's rewards are rules, so the RM row is memory it will not use") + "):"]
    levers_note = ("(levers are `tether plan` flags; in `tether ppo` today: --lora-r, --critic head, --critic none = "
                   "--advantage rloo|grpo|dr_grpo|reinforce_pp, --batch-size, "
                   "--gradient-checkpointing; ZeRO and offload are not there yet)")
    checklist = format_checklist(launch_checklist(cfg))
    checklist += "".join(f"\nwarning: {line}" for line in cfg.warnings())
    engines = format_engine_plan(engine_plan(shape, plan_cfg), plan_cfg)
    return "\n".join(notes) + "\n" + format_plan(shape, plan_cfg, result, levers(shape, plan_cfg, result["peak"])) \
        + "\n" + levers_note + "\n\n" + engines + "\n\n" + checklist
