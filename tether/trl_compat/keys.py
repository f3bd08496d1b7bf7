"""TRL's config key names in tether's terms — the one table — and the one-line answer to any unknown key.

 :data:`TRL_KEYS` maps, per tether config, the flat names of TRL's ``GRPOConfig``/``PPOConfig``,
``SFTConfig``, ``RewardConfig`` and ``DPOConfig`` (and of ``transformers.TrainingArguments``) to tether's dotted keys where the two
mean the same thing (``learning_rate`` -> ``optim.lr``, ``beta`` -> ``kl.coef``); such a key is accepted wherever a
config key is — a dict or YAML file given to a trainer, or a config's constructor (``RunConfig(learning_rate=1e-5)``).
:data:`TRL_HINTS` answers the TRL names with no exact equivalent with what to set instead, and any other unknown
key gets the tether keys it may mean (``lr`` -> "did you mean ``optim.lr`` (``--lr``)?"), in one line
(:func:`resolve_key`). docs/coming-from-trl.md is this table for readers. Imports nothing of tether but its
errors: :mod:`tether.config` and the stage configs use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing

from tether.errors import ConfigError

# TRL / transformers names shared by every stage, then each stage's own.
_COMMON = {"learning_rate": "optim.lr", "weight_decay": "optim.weight_decay", "adam_epsilon": "optim.adam_eps",
           "max_grad_norm": "optim.max_grad_norm", "report_to": "log_with", "save_total_limit": "keep_checkpoints",
           "save_steps": "save_every"}
TRL_KEYS: dict[str, dict[str, str]] = {
    "RunConfig": {**_COMMON, "beta": "kl.coef", "kl_coef": "kl.coef", "num_generations": "samples_per_prompt",
                  "max_completion_length": "generation.max_new_tokens", "response_length": "generation.max_new_tokens",
                  "max_prompt_length": "data.max_prompt_length", "temperature": "generation.temperature",
                  "top_p": "generation.top_p", "top_k": "generation.top_k", "epsilon": "ppo.clip_range",
                  "epsilon_high": "ppo.clip_range_high", "importance_sampling_level": "ppo.policy_loss",
                  "cliprange": "ppo.clip_range", "cliprange_value": "ppo.clip_range_value", "vf_coef": "ppo.vf_coef",
                  "num_ppo_epochs": "ppo.epochs", "num_iterations": "ppo.epochs",
                  "num_mini_batches": "ppo.mini_batches",
                  "gamma": "gae.gamma", "lam": "gae.lam", "max_steps": "steps", "warmup_steps": "optim.warmup_steps",
                  "lr_scheduler_type": "optim.schedule", "model_name_or_path": "model.policy",
                  "sft_model_path": "model.policy", "reward_model_path": "reward.sources",
                  "missing_eos_penalty": "reward.missing_eos_penalty", "eval_steps": "eval.every",
                  "mask_truncated_completions": "ppo.mask_truncated",
                  "gradient_checkpointing": "model.gradient_checkpointing"},
    "SFTConfig": {**_COMMON, "num_train_epochs": "optim.epochs", "max_steps": "optim.max_steps",
                  "per_device_train_batch_size": "optim.batch_size",
                  "gradient_accumulation_steps": "optim.grad_accumulation", "warmup_ratio": "optim.warmup_ratio",
                  "lr_scheduler_type": "optim.schedule", "max_length": "data.max_length",
                  "max_seq_length": "data.max_length", "packing": "data.packing",
                  "group_by_length": "data.group_by_length",
                  "model_name_or_path": "model.path", "per_device_eval_batch_size": "eval.batch_size",
                  "eval_steps": "eval.every", "gradient_checkpointing": "model.gradient_checkpointing",
                  "disable_dropout": "model.disable_dropout"},
    "RewardTrainingConfig": {"learning_rate": "optim.lr", "weight_decay": "optim.weight_decay",
                             "max_grad_norm": "optim.max_grad_norm", "save_steps": "save_every",
                             "num_train_epochs": "optim.epochs", "per_device_train_batch_size": "optim.batch_size",
                             "gradient_accumulation_steps": "optim.grad_accumulation",
                             "warmup_ratio": "optim.warmup_ratio", "max_length": "data.max_length",
                             "group_by_length": "optim.group_by_length", "model_name_or_path": "model",
                             "per_device_eval_batch_size": "eval_batch_size"},
    "DPOConfig": {"learning_rate": "optim.lr", "weight_decay": "optim.weight_decay", "adam_epsilon": "optim.adam_eps",
                  "max_grad_norm": "optim.max_grad_norm", "save_steps": "save_every",
                  "num_train_epochs": "optim.epochs", "per_device_train_batch_size": "optim.batch_size",
                  "gradient_accumulation_steps": "optim.grad_accumulation", "warmup_ratio": "optim.warmup_ratio",
                  "lr_scheduler_type": "optim.schedule", "max_length": "data.max_length",
                  "padding_free": "data.packing", "model_name_or_path": "model.path",
                  "per_device_eval_batch_size": "eval_batch_size", "eval_steps": "eval_every",
                  "gradient_checkpointing": "model.gradient_checkpointing", "disable_dropout": "model.disable_dropout",
                  "beta": "loss.beta", "loss_type": "loss.loss_type", "label_smoothing": "loss.label_smoothing",
                  "precompute_ref_log_probs": "precompute_ref_log_probs"},
}

# TRL names without an exact tether key: what to set instead.
TRL_HINTS: dict[str, str] = {
    "per_device_train_batch_size": "`batch_size` counts prompts per step and process (TRL counts completions: "
                                   "batch_size x samples_per_prompt)",
    "gradient_accumulation_steps": "`ppo.grad_accumulation` (micro-batches per minibatch) and `ppo.mini_batches`",
    "num_train_epochs": "`steps` (PPO steps of the run) and `ppo.epochs` (passes over each rollout)",
    "total_episodes": "`steps` x `batch_size` x `samples_per_prompt` responses are sampled in a run",
    "bf16": "`model.dtype: bf16` (reward model: `dtype`)", "fp16": "`model.dtype: fp16` (reward model: `dtype`)",
    "use_vllm": "`generation.engine: vllm`",
    "logging_steps": "every step is logged (metrics.jsonl)",
    "eval_strategy": "`eval.every` (0 = off)",
    "loss_type": "`ppo.policy_loss` (cispo: `cispo`; dapo, the token mean: the default `ppo`), "
                 "`advantage.estimator` (dr_grpo) and `kl.penalty_in` (docs/losses.md, docs/group-baselines.md)",
    "scale_rewards": "`advantage.estimator` (grpo z-scores a group; dr_grpo does not)",
    "peft_config": "`model.lora_r`, `model.lora_alpha`, `model.lora_target_modules` (reward model: `lora.r`, ...)",
    "completion_only_loss": "prompt/completion rows always train the completion only; `text` rows every token",
    "assistant_only_loss": "`messages` rows always train the assistant turns only",
    "dataset_text_field": "rows with a `text` field are read as text (docs/data-formats.md)",
    "center_rewards_coefficient": "tether standardises the scores on a reference sample (`norm_sample`) instead",
    "reward_funcs": "a trainer argument, not a config key: PPOTrainer(config, reward=...)",
    "load_best_model_at_end": "for PPO `eval.keep_best` (--keep-best): the best evaluation's checkpoint and model in "
                              "RUN_DIR/best beside the last step's policy/, which it does not replace",
    "metric_for_best_model": "`eval.keep_best` judges by held-out gold accuracy (eval/accuracy), else held-out "
                             "reward (eval/reward); not configurable",
}


def config_name(cls) -> str:
    return cls.__name__


@functools.lru_cache(maxsize=None)
def config_keys(cls, prefix: str = "") -> dict[str, str]:
    """``{dotted key: flag}`` of every field of config class ``cls``, older names (aliases) included; the flag as
    :func:`tether.config.flag_of` names it."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(config_keys(hints[f.name], key + "."))
            continue
        out[key] = f.metadata.get("flag") or "--" + key.replace(".", "-").replace("_", "-")
        out.update({prefix + alias: out[key] for alias in f.metadata.get("aliases", ())})
    return out


def suggestions(cls, key: str) -> list[str]:
    """Tether keys that ``key`` may mean: those whose last part is ``key``, else the closest spellings."""
    keys = config_keys(cls)
    same = [k for k in keys if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    if same:
        return same[:3]
    last = {k.rsplit(".", 1)[-1]: k for k in keys}
    near = difflib.get_close_matches(key, list(keys), n=3, cutoff=0.75)
    near += [last[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(last), n=3, cutoff=0.75)]
    return list(dict.fromkeys(near))[:3]


def resolve_key(cls, key: str, where: str) -> str:
    """``key`` as a dotted key of ``cls``: itself when it is one, tether's name of a TRL key (:data:`TRL_KEYS`), or
    a one-line ConfigError naming ``where`` and what to set instead (:data:`TRL_HINTS`, or the keys it may mean)."""
    keys = config_keys(cls)
    if key in keys:
        return key
    mapped = TRL_KEYS.get(config_name(cls), {}).get(key)
    if mapped is not None and mapped in keys:
        return mapped
    if key in TRL_HINTS:
        raise ConfigError(f"{where}: unknown key '{key}' (TRL's name); in tether: {TRL_HINTS[key]}")
    found = suggestions(cls, key)
    hint = ("; did you mean " + " or ".join(f"`{k}` ({keys[k]})" for k in found) + "?") if found else ""
    raise ConfigError(f"{where}: unknown key '{key}'{hint}")


def set_dotted(cfg, key: str, value) -> None:
    obj = cfg
    *path, last = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    for f in dataclasses.fields(obj):
        if f.name == last or last in f.metadata.get("aliases", ()):
            last = f.name
    if typing.get_origin(typing.get_type_hints(type(obj))[last]) is list and isinstance(value, str):
        value = [value]  # reward_model_path: one directory
    setattr(obj, last, value)


def accepts_trl_keys(cls):
    """Class decorator (on a top-level config dataclass): its constructor takes TRL's flat names as well
    (``RunConfig(learning_rate=1e-5)`` sets ``optim.lr``), and answers any other unknown keyword with one line
    saying which key it may mean instead of a bare TypeError. Values are checked when the config is."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
        targets = {k: resolve_key(cls, k, f"{cls.__name__}({k}=...)") for k in extra}
        init(self, *args, **kwargs)
        for k, value in extra.items():
            set_dotted(self, targets[k], value)

    cls.__init__ = __init__
    return cls
