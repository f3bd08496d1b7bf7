"""Command-line flags built from a stage's dataclass config: one flag per field, grouped by concern.

The name of a field's flag is set once, on the field (:func:`tether.config.option`'s ``flag``); its former
names (``old_flags``) still parse for one release, hidden from ``--help``, each use printing one line that names
the current flag. ``--help`` shows the flags a command names as common; ``--help-all`` shows every flag. An
unknown flag is answered with the flag meant: TRL's, OpenRLHF's or CleanRL's spelling of the same setting, the
same name with ``-`` for ``_``, or the closest name (difflib).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys

from tether.config import alias_flags, flag_of, leaf_fields

# Help groups, in the order --help prints them: (title, description).
GROUPS = {
    "run": ("run", "the run's length, batch, seed and where it is written"),
    "model": ("model", "the model trained (or sampled), its precision and LoRA"),
    "data": ("data", "training and held-out rows"),
    "generation": ("generation", "the sampling engine and its settings"),
    "reward": ("reward", "what scores a response, and the gold rule of evaluation"),
    "acceptance": ("acceptance", "which samples are kept"),
    "loss": ("loss", "the loss: the reward model's (train-rm), DPO's or IPO's (dpo)"),
    "KL": ("KL", "the KL tether to the reference: its coefficient beta and controller"),
    "PPO": ("PPO", "advantages, the clipped update and its epochs"),
    "critic": ("critic", "the value model"),
    "optimiser": ("optimiser", "AdamW, the learning-rate schedule and gradient clipping"),
    "evaluation": ("evaluation", "held-out evaluation: gold accuracy, reward, KL"),
    "health": ("health", "alarms on the run's metrics, and when a run stops"),
    "checkpoints": ("checkpoints", "when checkpoints are written and how many are kept"),
    "logging": ("logging", "progress bar and experiment trackers"),
    "distributed": ("distributed", "several processes and GPUs"),
    "performance": ("performance", "speed and memory; the results are the same"),
}
SECTIONS = {"model": "model", "lora": "model", "data": "data", "generation": "generation", "correction": "generation",
            "reward": "reward", "accept": "acceptance", "loss": "loss", "kl": "KL", "gae": "PPO", "advantage": "PPO",
            "difficulty": "PPO", "ppo": "PPO", "critic": "critic", "optim": "optimiser", "eval": "evaluation",
            "health": "health"}
KEYS = {
    "generation.rollout_processes": "distributed", "generation.async_rollout": "distributed",
    "model.gradient_checkpointing": "performance", "ppo.packing": "performance", "ppo.trim_padding": "performance",
    "optim.fused_adamw": "performance", "data.packing": "performance", "data.group_by_length": "performance",
    "optim.group_by_length": "performance", "optim.max_skipped_steps": "health",
    # top-level fields
    "save_every": "checkpoints", "save_every_minutes": "checkpoints", "keep_checkpoints": "checkpoints",
    "log_with": "logging", "tracker_project": "logging", "tensorboard": "logging", "progress": "logging",
    "collective_timeout_minutes": "distributed", "zero": "distributed", "gpus": "distributed",
    "gpu_memory": "distributed", "rollout_processes": "distributed", "engine": "generation", "engine_tp": "generation",
    "model": "model", "dtype": "model", "pooling": "model", "disable_dropout": "model", "process": "model",
    "device": "model", "lora_r": "model", "critic_lora_r": "critic", "lora_target_modules": "model",
    "critic": "critic", "value_head": "critic", "norm_sample": "evaluation", "eval_batch_size": "evaluation",
    "gradient_checkpointing": "performance", "attention": "performance", "offload_ref": "performance",
    "offload_rm": "performance",
}

# Why an old flag was renamed, where the new name alone would not say it.
NOTES = {"--target-kl": "it sets the KL controller's target, a KL to the reference; the PPO epoch early stop, "
                        "CleanRL's target_kl, is --ppo-early-stop-kl"}


def group_of(key: str) -> str:
    """The help group of dotted config key ``key``."""
    if key in KEYS:
        return KEYS[key]
    return SECTIONS.get(key.split(".")[0], "run") if "." in key else "run"


def _groups(parser: argparse.ArgumentParser) -> dict:
    """The parser's argument groups, made once and in :data:`GROUPS` order (empty ones are not printed)."""
    if not hasattr(parser, "tether_groups"):
        parser.tether_groups = {name: parser.add_argument_group(title, description)
                                for name, (title, description) in GROUPS.items()}
    return parser.tether_groups


def deprecation_line(old: str, new: str) -> str:
    note = f" ({NOTES[old]})" if old in NOTES else ""
    return f"tether: {old} is deprecated and goes in the next release; use {new}{note}"


class DeprecatedFlag(argparse.Action):
    """A former flag name: stores as the current flag does, and says once on stderr which flag to use."""

    def __init__(self, option_strings, dest, new_flag: str = "", repeat: bool = False, **kwargs):
        self.new_flag, self.repeat = new_flag, repeat
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(deprecation_line(option_string, self.new_flag), file=sys.stderr)
        if self.repeat:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def add_config_flags(parser: argparse.ArgumentParser, cls, common: tuple[str, ...] | None = None) -> None:
    """One flag per leaf field of config ``cls`` in its help group. With ``parser.tether_full_help`` False (a
    short ``--help``) only the flags in ``common`` are shown; every flag parses either way."""
    full = getattr(parser, "tether_full_help", True) or common is None
    groups = _groups(parser)
    old_names = parser.__dict__.setdefault("tether_old_flags", set())
    hidden = 0
    for key, f, tp in leaf_fields(cls):
        flag = flag_of(key, f)
        help_ = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_ += f" ({'|'.join(map(str, f.metadata['choices']))})"
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None and default != "" and not isinstance(default, list):
            help_ += f" [default: {default}]"
        help_ = help_.replace("%", "%%")  # argparse formats help strings with %
        if not (full or flag in common):
            help_, hidden = argparse.SUPPRESS, hidden + 1
        repeat = bool(f.metadata.get("repeat"))
        if tp == (bool | None):  # a switch whose unset value means "decide from the run" (ppo.packing)
            tp = bool
        shape = (dict(nargs="?", const="true", metavar="BOOL") if tp is bool
                 else dict(metavar=key.split(".")[-1].upper()))
        group = groups[group_of(key)]
        group.add_argument(flag, *alias_flags(key, f), dest=key, default=None, help=help_,
                           action="append" if repeat and tp is not bool else "store", **shape)
        old = [o for o in f.metadata.get("old_flags", ()) if o not in parser._option_string_actions]
        if old:
            old_names.update(old)
            group.add_argument(*old, dest=key, default=None, help=argparse.SUPPRESS, action=DeprecatedFlag,
                               new_flag=flag, repeat=repeat and tp is not bool, **shape)
    for g in groups.values():  # a group with nothing to show is left out, title and all
        if all(x.help == argparse.SUPPRESS for x in g._group_actions) and g in parser._action_groups:
            parser._action_groups.remove(g)
    parser.usage = "%(prog)s [--config FILE] [--flag VALUE ...]"
    if hidden:
        command = parser.prog.split()[-1]
        parser.epilog = (f"{hidden} more flags (advanced): `tether {command} --help-all` lists every flag, grouped "
                         "by concern. Flags override the --config YAML, whose keys nest as the flags' sections.")


# Other libraries' spellings (TRL, OpenRLHF, CleanRL; '-' and '_' alike) -> tether's flags, the first one the
# command has wins; a value after the flag is the value it implies.
FOREIGN = {
    "learning_rate": ("--lr",), "actor_learning_rate": ("--lr",), "beta": ("--kl-coef",),
    "init_kl_coef": ("--kl-coef",), "kl_coef": ("--kl-coef",), "init_kl_coef_value": ("--kl-coef",),
    "kl_target": ("--kl-target",), "target": ("--kl-target",), "target_kl": ("--ppo-early-stop-kl",),
    "kl_penalty": ("--kl-estimator",), "kl_estimator": ("--kl-estimator",), "adaptive_kl_ctrl": ("--kl-controller",),
    "model_name_or_path": ("--policy", "--model"), "pretrain": ("--policy", "--model"),
    "sft_model_path": ("--policy",), "reward_model_path": ("--reward",), "reward_pretrain": ("--reward",),
    "reward_funcs": ("--reward",), "remote_rm_url": ("--reward",), "critic_pretrain": ("--critic-model",),
    "dataset_name": ("--prompts", "--data"), "dataset": ("--prompts", "--data"), "prompt_data": ("--prompts",),
    "train_file": ("--data", "--prompts"), "num_generations": ("--samples-per-prompt",),
    "n_samples_per_prompt": ("--samples-per-prompt",), "per_device_train_batch_size": ("--batch-size",),
    "train_batch_size": ("--batch-size",), "rollout_batch_size": ("--batch-size",),
    "micro_train_batch_size": ("--batch-size",), "per_device_eval_batch_size": ("--eval-batch-size",),
    "gradient_accumulation_steps": ("--grad-accumulation",), "num_train_epochs": ("--epochs",),
    "max_epochs": ("--epochs", "--ppo-epochs"), "num_ppo_epochs": ("--ppo-epochs",),
    "update_epochs": ("--ppo-epochs",), "num_mini_batches": ("--mini-batches",), "num_minibatches": ("--mini-batches",),
    "steps": ("--max-steps",), "total_steps": ("--max-steps",),
    "max_completion_length": ("--max-new-tokens",), "response_length": ("--max-new-tokens",),
    "generate_max_len": ("--max-new-tokens",), "max_prompt_length": ("--data-max-prompt-length",),
    "prompt_max_len": ("--data-max-prompt-length",), "max_len": ("--max-length",),
    "lr_scheduler_type": ("--lr-scheduler",), "lr_schedule": ("--lr-scheduler",),
    "cliprange": ("--clip-range",), "eps_clip": ("--clip-range",), "clip_coef": ("--clip-range",),
    "epsilon": ("--clip-range",), "epsilon_high": ("--clip-range-high",), "clip_ratio_high": ("--clip-range-high",),
    "clip_ratio_low": ("--clip-range",), "importance_sampling_level": ("--policy-loss",),
    "loss_mode": ("--policy-loss",), "policy_loss_mode": ("--policy-loss",), "cliprange_value": ("--ppo-clip-range-value",),
    "value_clip": ("--ppo-clip-range-value",), "vf_coef": ("--ppo-vf-coef",), "ent_coef": ("--ppo-entropy-coef",),
    "entropy_coef": ("--ppo-entropy-coef",), "lambd": ("--lam",), "gae_lambda": ("--lam",),
    "critic_learning_rate": ("--critic-lr",), "eval_steps": ("--eval-every",), "save_steps": ("--save-every",),
    "save_total_limit": ("--keep-checkpoints",), "report_to": ("--log-with",), "use_wandb": ("--log-with wandb",),
    "bf16": ("--dtype bf16",), "fp16": ("--dtype fp16",), "torch_dtype": ("--dtype",),
    "lora_rank": ("--lora-r",), "use_peft": ("--lora-r",), "target_modules": ("--lora-target-modules",),
    "vllm_tensor_parallel_size": ("--engine-tp",), "use_vllm": ("--engine vllm",),
    "vllm_num_engines": ("--rollout-processes",), "advantage_estimator": ("--advantage",),
    "adv_estimator": ("--advantage",), "adam_epsilon": ("--optim-adam-eps",), "chat_template_path": ("--chat-template-file",),
    "whiten_advantages": ("--ppo-whiten-advantages",), "num_sample_generations": ("--eval-samples",),
}


def suggest(parser: argparse.ArgumentParser, given: str) -> str:
    """The flag meant by unknown flag ``given`` (``--learning_rate`` -> ``--lr``), as a short clause; '' when none
    is close. Former names are left out: a suggestion is always a current flag."""
    old = getattr(parser, "tether_old_flags", set())
    known = [o for o in parser._option_string_actions if o.startswith("--") and o not in old]
    name = given.split("=", 1)[0].lstrip("-")
    plain = name.replace("-", "_").lower()
    for target in FOREIGN.get(plain, ()):
        if target.split()[0] in known:
            return f"tether's flag for {name} is {target}"
    hyphens = "--" + plain.replace("_", "-")
    if hyphens in known:
        return f"did you mean {hyphens}?"
    close = difflib.get_close_matches(hyphens, known, n=3, cutoff=0.6)
    return f"did you mean {' or '.join(close)}?" if close else ""


def unknown_flags_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line for the unknown arguments ``extras`` of subcommand ``parser``: the first flag among them and the
    flag meant."""
    flags = [e for e in extras if e.startswith("-")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    hint = suggest(parser, flags[0])
    more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
    return f"unrecognized argument {flags[0]}{more}" + (f"; {hint}" if hint else "")
