"""The ``tether sft`` config (Stage 0): one dataclass, nested by concern, every field documented once.

Names match the other stages where the concept is the same: ``model.dtype`` is ``--dtype`` (fp32/bf16/fp16
compute, fp32 masters), ``model.lora_*`` and ``--export-lora`` as in PPO, ``--system-prompt``/``--prompt-template``
with PPO's meaning (so the policy is fine-tuned on the context PPO will prompt it with), ``optim.*`` as in train-rm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.config import MAX_NEW_TOKENS, check_fields, option
from tether.errors import ConfigError
from tether.trl_compat.keys import accepts_trl_keys
from tether.hf import DTYPE_ALIASES, DTYPES

SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class ModelConfig:
    path: str = option("", "the model to fine-tune: a local Hugging Face causal-LM directory, a preset name or a "
                       "Hub id",
                       flag="--model")
    dtype: str = option("fp32", "compute dtype: bf16/fp16 run every forward under autocast with fp32 masters "
                        "for all that trains (fp16: a loss scaler); a LoRA base is loaded and kept in it; the "
                        "exported policy is written in it", choices=tuple(DTYPES), flag="--dtype",
                        value_aliases=DTYPE_ALIASES, old_flags=("--model-dtype",))
    lora_r: int = option(0, "LoRA rank; 0 = full fine-tune", low=0, flag="--lora-r")
    lora_alpha: int = option(16, "LoRA alpha", low=1, flag="--lora-alpha", old_flags=("--model-lora-alpha",))
    lora_dropout: float = option(0.0, "LoRA dropout", low=0, high=1, flag="--lora-dropout",
                                 old_flags=("--model-lora-dropout",))
    lora_target_modules: str = option("all-linear", "LoRA target modules: 'all-linear' or comma-separated module "
                                      "names", flag="--lora-target-modules", old_flags=("--model-lora-target-modules",))
    export_lora: str = option("merged", "the output of a LoRA run: 'merged' (a plain model) or 'adapter' (the "
                              "adapter alone, for peft over the base); in --dtype either way",
                              choices=("merged", "adapter"), flag="--export-lora")
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass",
                                          flag="--gradient-checkpointing", old_flags=("--model-gradient-checkpointing",))
    disable_dropout: bool = option(False, "set every dropout probability to 0 (the model's own settings otherwise)",
                                   flag="--disable-dropout")
    trust_remote_code: bool = option(False, "allow model code from the model directory (off unless asked)")

    def check(self) -> None:
        """The cross-field check of the policy's section (``validate()`` of sft and dpo)."""
        if self.export_lora == "adapter" and not self.lora_r:
            raise ConfigError("--export-lora adapter: needs --lora-r > 0 (a full fine-tune has no adapter)")


@dataclass
class TextFormatConfig:
    """How text becomes tokens for the policy: the fields :func:`tether.sft.tokens.text_format` and the tokenizer
    loader read, shared field for field by ``tether sft``'s and ``tether dpo``'s ``data`` (same keys, same flags)."""

    max_length: int = option(1024, "tokens per sequence: longer ones lose prompt tokens from the left first, then "
                             "reply tokens from the right (both counted and reported)", low=2, flag="--max-length")
    chat_template: str = option("auto", "render rows with the tokenizer's chat template (loss on the assistant's "
                                "reply only) or as plain text (prompt, then reply + EOS)",
                                choices=("auto", "on", "off"))
    chat_template_file: str = option("", "a Jinja chat template set on the tokenizer before anything is rendered, "
                                     "and saved with the trained policy (for a base model without one)",
                                     flag="--chat-template-file")
    system_prompt: str = option("", "system turn for the chat template ('' = the template's default), as in "
                                "tether ppo", flag="--system-prompt")
    prompt_template: str = option("{prompt}", "what the policy is asked: '{prompt}' is replaced by the prompt (the "
                                  "last user turn of a conversation), as in tether ppo", flag="--prompt-template")

    def check(self) -> None:
        """The cross-field check of the format (``validate()`` of sft and dpo)."""
        if "{prompt}" not in self.prompt_template:
            raise ConfigError(f"--prompt-template: {self.prompt_template!r} does not contain {{prompt}}")


@dataclass
class DataConfig(TextFormatConfig):
    files: list[str] = option([], "training rows (JSONL/CSV/Parquet/JSON, a datasets folder, "
                              "hf:org/name[:config][:split]): prompt + completion "
                              "(or response), TRL's conversational messages, GSM8K question + answer; repeatable",
                              flag="--data", repeat=True)
    eval_files: list[str] = option([], "held-out rows for eval/loss (same shapes); empty = split off "
                                   "--eval-fraction by prompt", flag="--eval-data", repeat=True)
    eval_fraction: float = option(0.05, "share of the rows held out by prompt when --eval-data is empty (0 = none)",
                                  low=0.0, high=0.5, flag="--eval-fraction")
    packing: bool = option(False, "padding-free packing: a micro-batch's sequences share rows, positions restarting "
                           "per sequence, attention kept within each (the same loss; docs/sft.md)", flag="--packing")
    group_by_length: bool = option(False, "micro-batches of sequences of similar length (less padding; which rows "
                                   "meet in a batch changes, the set per epoch does not)", flag="--group-by-length")
    max_rows: int = option(0, "use only the first N rows (0 = all)", low=0, flag="--max-rows")
    skip_invalid: bool = option(False, "skip (and count) bad rows instead of stopping", flag="--skip-invalid")


@dataclass
class AdamWConfig:
    """AdamW and its LR schedule: the fields :func:`tether.sft.setup.make_optimisation` and the clip read, shared
    field for field by ``tether sft``'s and ``tether dpo``'s ``optim`` (same keys, same flags)."""

    lr: float = option(2e-5, "AdamW learning rate", low=0.0, low_open=True, flag="--lr")
    weight_decay: float = option(0.0, "AdamW weight decay (every trainable parameter)", low=0.0,
                                 flag="--weight-decay")
    adam_eps: float = option(1e-8, "AdamW epsilon", low=0.0, low_open=True)
    warmup_ratio: float = option(0.0, "share of the steps with linear warm-up", low=0.0, high=1.0,
                                 flag="--warmup-ratio")
    schedule: str = option("linear", "LR schedule after warm-up (to 0 at the last step: linear, cosine)",
                           choices=SCHEDULES, flag="--lr-scheduler", old_flags=("--lr-schedule",))
    max_grad_norm: float = option(1.0, "gradient-norm clip; 0 = off", low=0.0, flag="--max-grad-norm")


@dataclass
class OptimConfig(AdamWConfig):
    epochs: int = option(1, "passes over the training rows (when --steps is 0)", low=1, flag="--epochs")
    max_steps: int = option(0, "optimiser steps of the run, epochs continuing as needed; 0 = --epochs passes",
                            low=0, flag="--steps", old_flags=("--max-steps",))
    batch_size: int = option(8, "sequences per micro-batch (one forward pass), per process", low=1,
                             flag="--batch-size")
    grad_accumulation: int = option(1, "micro-batches per optimiser step, per process", low=1,
                                    flag="--grad-accumulation")
    drop_last: bool = option(False, "leave out each epoch's last micro-batch when it is short")
    max_skipped_steps: int = option(3, "consecutive steps with a non-finite loss or gradient (update skipped) that "
                                    "stop the run", low=1, flag="--max-skipped-steps",
                                    old_flags=("--optim-max-skipped-steps",))


@dataclass
class EvalConfig:
    every: int = option(0, "evaluate every N steps (and at the end, always); 0 = at the end only", low=0,
                        flag="--eval-every")
    at_start: bool = option(False, "also evaluate before the first step (a step-0 row)", flag="--eval-at-start")
    batch_size: int = option(16, "sequences per forward pass for eval/loss, prompts per generate call", low=1,
                             flag="--eval-batch-size")
    prompts: str = option("", "held-out prompt file for gold accuracy (tether ppo's --eval-prompts shapes); empty = "
                          "the held-out rows' prompts", flag="--eval-prompts")
    gold: str = option("auto", "rule of eval/accuracy (greedy answers): module:function, 'auto' (the math rule when "
                       "the prompts carry an answer) or 'none'", flag="--gold")
    n: int = option(64, "held-out prompts answered per gold evaluation", low=1, flag="--eval-n")
    max_new_tokens: int = option(MAX_NEW_TOKENS, "answer length cap of the gold evaluation (the same default as "
                                 "tether ppo's and tether sample's --max-new-tokens)", low=1, flag="--max-new-tokens")
    max_prompt_length: int = option(512, "gold evaluation prompts longer than this (tokens) are cut from the left",
                                    low=1)
    samples: int = option(16, "greedy answers written to samples/step_K.jsonl", low=0)


@accepts_trl_keys  # TRL's flat names (learning_rate=...) accepted; other unknown keywords get a hint
@dataclass
class SFTConfig:
    """``tether sft``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    output_dir: str = option("", "the run directory, and at the end the fine-tuned policy itself (a Hugging Face "
                             "model directory with its tokenizer, usable as --policy / --model)",
                             flag="--output-dir")
    seed: int = option(0, "seed for the split, the batch order, LoRA's initialisation and dropout", flag="--seed")
    save_every: int = option(0, "also checkpoint every N steps; 0 = by time only (--save-every-minutes)", low=0,
                             flag="--save-every")
    save_every_minutes: float = option(10.0, "checkpoint after a step when this many minutes have passed since the "
                                       "last one; 0 = off", low=0.0, flag="--save-every-minutes")
    keep_checkpoints: int = option(1, "newest checkpoints kept", low=1)
    log_with: list[str] = option([], "experiment trackers through accelerate (tensorboard, wandb, mlflow, ...); "
                                 "repeatable or a comma list", flag="--log-with", repeat=True)
    tracker_project: str = option("tether", "project name for the trackers (TensorBoard writes DIR/PROJECT/)")
    tensorboard: bool = option(False, "the same as --log-with tensorboard")
    progress: bool = option(True, "per-step progress on stderr: a bar on a terminal, one plain line a step otherwise")
    collective_timeout_minutes: float = option(60.0, "how long a process waits in a collective for the others "
                                               "(several processes) before the run fails", low=0.0, low_open=True)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        check_fields(self)  # every field's type, choices and bounds, named by key and flag
        if not self.model.path:
            raise ConfigError("--model: required (a model directory or preset)")
        if not self.data.files:
            raise ConfigError("--data: required (a file of training rows; repeatable)")
        if not self.output_dir:
            raise ConfigError("--output-dir: required")
        self.data.check()
        self.model.check()
        if self.data.packing and self.data.group_by_length:
            raise ConfigError("--packing with --group-by-length: choose one (packing leaves no padding to group away)")
