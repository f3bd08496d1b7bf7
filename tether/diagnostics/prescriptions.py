"""The doctor's prescriptions (reference §D, D.2–D.5): per failure mode, in priority order, what to do, its
config key (tether.ppo.config.RunConfig) and a suggested value given the run's current one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tether.diagnostics.drift import PRESCRIPTIONS as DRIFT_PRESCRIPTIONS
from tether.diagnostics.groups import flat_groups_prescriptions
from tether.diagnostics.headline import FLAT_REWARD
from tether.diagnostics.health import (COLLAPSE, KL_EXPLOSION, MODE_COLLAPSE, NO_SIGNAL, NOT_LEARNING, RATIO,
                                       REWARD_HACKING, SAMPLER_MISMATCH, SHORTCUT, TASK_DROPPED, VALUE_COLLAPSE)
from tether.diagnostics.noop import PRESCRIPTIONS as NOOP_PRESCRIPTIONS


def _scaled(lo: float, hi: float | None = None) -> Callable[[Any], str | None]:
    def suggest(current):
        if isinstance(current, bool) or not isinstance(current, (int, float)) or current == 0:
            return None
        return f"{current * lo:.3g}" + (f"–{current * hi:.3g}" if hi is not None else "")
    return suggest


def _fewer_epochs(current):
    return f"{max(1, int(current) // 2)}" if isinstance(current, int) and current > 1 else None


def _beta(current):
    if isinstance(current, (int, float)) and current == 0:
        return "0.05–0.2 (β = 0: the tether is off)"
    return _scaled(2, 4)(current)


def _set(current) -> bool:
    return bool(current) and current != "none"


def _is(*values) -> Callable[[Any], bool]:
    return lambda current: current in values


@dataclass(frozen=True)
class Rx:
    """One prescription: what to do, the config key, a suggested value given the current one, and whether the
    current value already does it (``done``: the doctor then lists it as in place, not as something to try)."""

    action: str
    key: str | None
    suggest: Callable[[Any], str | None] = lambda current: None
    done: Callable[[Any], bool] = lambda current: False


# Reference §D, in its priority order. Config keys are those of tether.ppo.config.RunConfig.
PRESCRIPTIONS: dict[str, list[Rx]] = {
    KL_EXPLOSION: [  # D.2
        Rx("raise β, the KL coefficient (reference: 0.05 → 0.1–0.2)", "kl.coef", _beta),
        Rx("lower the actor learning rate (reference: 1e-6 → 5e-7)", "optim.lr", _scaled(0.5)),
        Rx("fewer PPO epochs per batch (4 → 1–2)", "ppo.epochs", _fewer_epochs, _is(1)),
        Rx("smaller clip range ε (0.2 → 0.1)", "ppo.clip_range", _scaled(0.5)),
        Rx("adaptive KL controller: β doubles when KL > 1.5 × target", "kl.controller", lambda c: "adaptive",
           _is("adaptive", "proportional")),
        Rx("roll back to the last healthy checkpoint and rerun with the settings above "
           "(PPO rarely comes back once it diverges)", "health.rollback", lambda c: "true", _is(True)),
    ],
    RATIO: [  # D.5, and D.6: ratio.std abnormal in the first steps -> suspect the LR
        Rx("fewer PPO epochs per batch (4 → 2 → 1): the last epochs are the most off-policy", "ppo.epochs",
           _fewer_epochs, _is(1)),
        Rx("larger minibatches: fewer minibatches, so fewer gradient steps per epoch", "ppo.mini_batches",
           _fewer_epochs, _is(1)),
        Rx("early-stop the epoch loop when approx KL to π_old > early_stop_factor × ppo.target_kl",
           "ppo.early_stop", lambda c: "true", _is(True)),
        Rx("lower the actor learning rate", "optim.lr", _scaled(0.5)),
    ],
    VALUE_COLLAPSE: [  # D.4
        Rx("clip the value update (ε_v = 0.2)", "ppo.clip_range_value", lambda c: "0.2", _set),
        Rx("lower the critic learning rate", "optim.critic_lr", _scaled(0.5)),
        Rx("clip or normalise rewards: r ∈ [−5, 5] (reward.clip) or z-score (reward.normalize)", "reward.clip",
           lambda c: "5", lambda c: isinstance(c, (int, float)) and 0 < c <= 5),
        Rx("pre-train the critic for a few steps before PPO (critic warm-up)", "critic.warmup_steps",
           lambda c: "10", _set),
        # tether's, after the reference's: when the reward is sparse (value/returns_std small) no critic setting
        # helps, there is nothing to fit (docs/real-models.md, recipe 2)
        Rx("or drop the critic: a group baseline (B17) has no value model to collapse — sample several responses "
           "per prompt (samples_per_prompt 4–8) and baseline each by its group", "advantage.estimator",
           lambda c: "grpo or rloo, with samples_per_prompt 4–8", lambda c: c not in (None, "gae")),
    ],
    REWARD_HACKING: [  # D.3
        Rx("keep (or raise) the per-token KL penalty: the first line of defence", "kl.coef", _beta),
        Rx("length penalty r' = r − α·len", "reward.length_penalty", lambda c: "0.01", _set),
        Rx("use an ensemble of 3–5 reward models (several reward.sources), combined by min",
           "reward.ensemble", lambda c: "min", _is("min")),
        Rx("refresh the reward model on the policy's current outputs (online RM refresh, `tether train-rm`)",
           None),
        Rx("iterative / online DPO on fresh preference data", None),
    ],
    MODE_COLLAPSE: [  # D.2 (entropy collapse) and D.6 (end of the chain)
        Rx("raise β, the KL coefficient, to hold the policy near the reference", "kl.coef", _beta),
        Rx("lower the actor learning rate", "optim.lr", _scaled(0.5)),
        Rx("add an entropy bonus c2", "ppo.entropy_coef", lambda c: "0.01", _set),
        Rx("fewer PPO epochs per batch", "ppo.epochs", _fewer_epochs, _is(1)),
        Rx("roll back to the last healthy checkpoint", "health.rollback", lambda c: "true", _is(True)),
    ],
    COLLAPSE: [  # gold and reward fell together: the run broke down, whatever the reward model is
        Rx("roll back to the last healthy checkpoint (before the gold metric fell)", "health.rollback",
           lambda c: "true", _is(True)),
        Rx("lower the actor learning rate", "optim.lr", _scaled(0.5)),
        Rx("fewer PPO epochs per batch", "ppo.epochs", _fewer_epochs, _is(1)),
        Rx("raise β, the KL coefficient, to hold the policy near the reference", "kl.coef", _beta),
    ],
    NOT_LEARNING: [  # D.5: clip fraction < 5%
        Rx("raise the actor learning rate", "optim.lr", _scaled(2, 10)),
        Rx("check the advantage signal: do scores vary within a batch? (objective/scores, reward "
           "normalisation)", "reward.normalize", lambda c: "batch", _set),
        Rx("more PPO epochs per batch", "ppo.epochs", lambda c: f"{c + 1}" if isinstance(c, int) else None),
    ],
    # B17: the first line depends on which way the groups are flat (tether.diagnostics.groups); this is the usual one
    NO_SIGNAL: [Rx(*rx) for rx in flat_groups_prescriptions([])],
    SHORTCUT: [
        Rx("read the held-out answers beside the reference policy's (samples/step_K.jsonl: 'response' and "
           "'reference'; tether report): a reward that is its own check cannot tell a solved task from a satisfied "
           "check", None),
        Rx("reward the task as well as its check: a reward model trained on pairs of the policy's own answers "
           "labelled by the check (tether train-rm), or a rule that also scores the content", "reward.sources"),
        Rx("keep the policy nearer the reference: raise β", "kl.coef", _beta),
        Rx("roll back to the last checkpoint before the overlap fell", "health.rollback", lambda c: "true",
           lambda current: current is True),
    ],
    # #51: counted problem by problem (tether.diagnostics.shortcut); the answers are in the verdict
    TASK_DROPPED: [
        Rx("reward the task as well as its check: the checker times a relevance gate (tether.rules.task_gate:gated:"
           "check=YOUR_CHECKER; docs/real-models.md), or a reward model trained on the policy's own answers",
           "reward.sources"),
        Rx("a length floor: EOS not sampled before this many tokens (about half the step-0 held-out "
           "eval/response_length), so the phrase alone cannot be the answer", "generation.min_new_tokens",
           lambda c: "half the step-0 eval/response_length" if not c else None, lambda c: bool(c)),
        Rx("the curriculum: prompts passed in every sample (shortcut included) are drawn at difficulty.min_weight, "
           "so the gradient goes to prompts still failing; it slows the shortcut's spread, it does not unpay it",
           "difficulty.curriculum", lambda c: "true", _is(True)),
        Rx("keep the policy nearer the reference: raise β", "kl.coef", _beta),
    ],
    # issue 51: ranked above every band (tether.diagnostics.headline); the reward itself first, the learning rate never
    FLAT_REWARD: [
        Rx("the reward gives no signal: check the reward function and its answer column (score a few replies by hand, "
           "samples/step_K.jsonl 'score': a rule reading another column than the prompts carry, or expecting another "
           "answer format, scores every reply alike)", "reward.sources"),
        Rx("if the scores are right and every reply fails: the task is out of the policy's reach, easier prompts or "
           "SFT first (tether sample, tether sft)", "data.prompts"),
        Rx("a denser reward: partial credit, or a process reward model's step rewards", None),
    ],
    # B19, tether's: correct what the engine's distribution costs, then make it smaller (docs/sampling.md)
    SAMPLER_MISMATCH: [
        Rx("correct it: weight each token's policy loss by min(π_old/π_engine, C), truncated importance sampling",
           "correction.mode", lambda c: "tis", _is("tis", "mis")),
        Rx("and drop the sequences furthest off (masked importance sampling: weight 0 past correction.bound)",
           "correction.mode", lambda c: "mis", _is("mis")),
        Rx("check the weight sync: perf/seconds_weight_sync > 0 at every step (an engine that kept old weights, or "
           "served a stale prefix cache, samples the previous policy)", None),
        Rx("sample and score in fp32 if the run can afford it (bf16 engine kernels differ from the trainer's bf16 "
           "autocast: vLLM on CPU 0.04-0.15 nats a token on SmolLM2; fp32 ~1e-6)", "model.dtype",
           lambda c: "fp32", _is("fp32")),
    ],
}
# issue 54: the no-op and late-collapse modes keep their prescriptions beside their bands
PRESCRIPTIONS.update({mode: [Rx(*rx) for rx in rxs] for mode, rxs in {**NOOP_PRESCRIPTIONS, **DRIFT_PRESCRIPTIONS}.items()})
