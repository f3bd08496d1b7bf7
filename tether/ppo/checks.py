"""What a PPO run config resolves to and refuses beyond its fields' own checks: the held-out share and the
evaluation schedule the defaults give, the combinations that cannot work (refused in one line), and the ones that
are legal but do nothing here (one warning line each, printed once at start-up and by ``--dry-run``).

Functions of a :class:`~tether.ppo.config.RunConfig` (this module does not import it), called from its
``validate()``, its ``eval_every``/``warnings`` and the run's set-up.
"""

from __future__ import annotations

from pathlib import Path

from tether.errors import ConfigError

# The default held-out share of --prompts: the doctor's reward-hacking verdict compares the reward with the gold
# metric on prompts never trained on, so a run evaluates them unless told not to (--eval-fraction 0).
HELD_OUT_SHARE = 0.1
# The default share holds prompts out only from a file of at least this many distinct prompts (one in ten); a
# smaller one trains on all of them (an explicit --eval-fraction holds out at least one).
MIN_PROMPTS_FOR_SHARE = 10
# How often the default schedule evaluates: about ten times a run, and at the start (eval.at_start).
EVALUATIONS_PER_RUN = 10
# Where the reward model's own metadata lives (tether.rm.model.METADATA_FILE; not imported: it pulls in torch).
REWARD_METADATA = "tether_reward.json"


def held_out_fraction(cfg) -> float:
    """The share of ``--prompts`` held out: ``data.eval_fraction`` as set, or :data:`HELD_OUT_SHARE` by default;
    0 when the held-out prompts come from elsewhere (``--eval-prompts``, an ``rg:`` task's own split)."""
    if cfg.data.eval_prompts or cfg.data.prompts.startswith("rg:"):
        return 0.0
    return HELD_OUT_SHARE if cfg.data.eval_fraction is None else cfg.data.eval_fraction


def has_held_out(cfg) -> bool:
    """Whether the config gives held-out prompts (a file, a task's held-out problems or a share of --prompts)."""
    if cfg.data.eval_prompts:
        return True
    if cfg.data.prompts.startswith("rg:"):
        return cfg.data.task_eval > 0
    return held_out_fraction(cfg) > 0


def eval_every(cfg) -> int:
    """Evaluate every N steps (and at the last): ``eval.every`` as set, else ``max(1, steps // 10)`` when the
    config gives held-out prompts; 0 = never."""
    if cfg.eval.every is not None:
        return cfg.eval.every
    return max(1, cfg.steps // EVALUATIONS_PER_RUN) if has_held_out(cfg) else 0


def check_defaults_apply(cfg) -> None:
    """The refusals of settings that can never do what they say (one line each)."""
    policy = Path(cfg.model.policy).expanduser()
    if (policy / REWARD_METADATA).is_file():
        raise ConfigError(f"--policy {cfg.model.policy}: a tether reward model ({REWARD_METADATA}), not a policy; "
                          "give it to --reward, and a causal LM (e.g. the SFT model) to --policy")
    if cfg.kl.controller != "fixed" and cfg.kl.coef == 0:
        raise ConfigError(f"--kl-controller {cfg.kl.controller} with --kl-coef 0: the controller multiplies beta, so "
                          "a beta of 0 never moves; start it above 0 (e.g. 0.05), or use --kl-controller fixed")
    if cfg.eval.every and not has_held_out(cfg):
        where = ("the task has no held-out problems (data.task_eval 0)" if cfg.data.prompts.startswith("rg:")
                 else "--eval-fraction 0 and no --eval-prompts")
        raise ConfigError(f"--eval-every {cfg.eval.every}: no held-out prompts to evaluate ({where}); give "
                          "--eval-prompts FILE or --eval-fraction F, or --eval-every 0")
    if cfg.health.hang_seconds is not None and cfg.health.hang_seconds >= cfg.collective_timeout_minutes * 60:
        # the collective would fail the run first
        raise ConfigError(f"--hang-timeout {cfg.health.hang_seconds:g}: not below the collective timeout "
                          f"({cfg.collective_timeout_minutes:g} min = {cfg.collective_timeout_minutes * 60:g} s), "
                          "so no hang alert could come before the run fails; lower it or raise "
                          "--collective-timeout-minutes")


def check_policy_loss(cfg) -> None:
    """The refusals of ``ppo.policy_loss`` (docs/losses.md): GSPO's loss is one per response, −min(s_i·A_i, ...),
    so it needs the row's advantage A_i; GAE's differs token by token, and GSPO-token is the form built for that."""
    if cfg.ppo.policy_loss == "gspo" and not cfg.advantage.critic_free:
        raise ConfigError(f"--policy-loss gspo: needs one advantage per response (a critic-free --advantage: rloo, "
                          f"grpo, dr_grpo, reinforce_pp), not --advantage {cfg.advantage.estimator}'s per-token ones; "
                          "use --policy-loss gspo_token")


def policy_loss_warnings(cfg) -> list[str]:
    """Clip ranges set for a policy loss that does not read them: one line each."""
    ppo, out = cfg.ppo, []
    defaults = type(ppo)()
    gspo = ppo.policy_loss in ("gspo", "gspo_token")
    unread = (("clip_range", "--clip-range"), ("clip_range_high", "--clip-range-high")) if gspo else (
        ("gspo_clip_range", "--gspo-clip-range"), ("gspo_clip_range_high", "--gspo-clip-range-high"))
    for key, flag in unread:
        if getattr(ppo, key) != getattr(defaults, key):
            out.append(f"{flag} {getattr(ppo, key):g}: ignored; --policy-loss {ppo.policy_loss} clips "
                       + ("the sequence ratio by --gspo-clip-range/--gspo-clip-range-high" if gspo
                          else "token ratios by --clip-range/--clip-range-high"))
    return out


def run_warnings(cfg) -> list[str]:
    """Settings that are legal but do nothing in this run: one line each."""
    out = policy_loss_warnings(cfg)
    if cfg.advantage.critic_free and (cfg.critic.kind != "head" or cfg.critic.model):
        setting = f"--critic {cfg.critic.kind}" + (f" --critic-model {cfg.critic.model}" if cfg.critic.model else "")
        out.append(f"{setting}: ignored; --advantage {cfg.advantage.estimator} builds no critic (its baseline is "
                   "the other samples of the prompt)")
    if cfg.correction.mode != "none" and cfg.generation.engine == "transformers" and not cfg.generation.rollout_processes:
        out.append(f"--rollout-correction {cfg.correction.mode}: the transformers engine samples with the trained "
                   "weights themselves, so its weights only correct the rounding gap between generation and the "
                   "training forward (near 1); it is for --engine vllm or --rollout-processes")
    r = cfg.reward
    if r.overlong_penalty_factor != 1.0 and not r.overlong_buffer:
        out.append(f"--overlong-penalty-factor {r.overlong_penalty_factor:g}: ignored; --overlong-buffer is 0 (off)")
    elif r.overlong_buffer and not r.overlong_penalty_factor:
        out.append(f"--overlong-buffer {r.overlong_buffer}: no effect with --overlong-penalty-factor 0")
    if cfg.data.eval_fraction and (cfg.data.eval_prompts or cfg.data.prompts.startswith("rg:")):
        given = (f"--eval-prompts {cfg.data.eval_prompts}" if cfg.data.eval_prompts
                 else "the task's own held-out problems (data.task_eval)")
        out.append(f"--eval-fraction {cfg.data.eval_fraction:g}: ignored; the held-out prompts are {given}")
    return out


def hang_seconds(cfg) -> float:
    """The hang watchdog's bound: ``health.hang_seconds``, or by default 300 s or half the collective timeout when
    that is shorter (an alert must come before the collective fails the run)."""
    if cfg.health.hang_seconds is not None:
        return cfg.health.hang_seconds
    return min(300.0, cfg.collective_timeout_minutes * 60 / 2)
