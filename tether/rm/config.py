"""The ``tether train-rm`` config (Stage A): one dataclass, nested by concern, every field documented once.

Names match the PPO config where the concept is the same (``dtype`` fp32/bf16/fp16,
``grad_accumulation``, ``lora.target_modules``); the older spellings (``float32``, ``grad_accum``) are
still accepted so saved configs load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tether.config import check_fields, option
from tether.errors import ConfigError
from tether.trl_compat.keys import accepts_trl_keys
from tether.hf import DTYPE_ALIASES, DTYPES


@dataclass
class DataConfig:
    files: list[str] = option([], "preference data file (JSONL, CSV, Parquet, dataset folder) or Hub dataset "
                              "hf:org/name[:config][:split]; repeatable",
                              flag="--data", repeat=True)
    eval_fraction: float = option(0.2, "share of pairs held out for evaluation (split by prompt)",
                                  low=0.0, low_open=True, high=0.9, flag="--eval-fraction")
    max_length: int = option(512, "max tokens per text; the prompt is cut from the left first", low=4,
                             flag="--max-length")
    packing: bool = option(True, "train on packed pairs: each pair's shared prompt computed once, chosen and "
                           "rejected after it (last-token pooling; checked against padded scores at start-up, "
                           "padded rows when the check fails); --no-packing = padded rows", flag="--packing")
    format: str = option("auto", "text format: chat template if the tokenizer has one (auto), or forced",
                         choices=("auto", "chat", "plain"), flag="--format")
    separator: str = option("", "text between prompt and reply in the plain format", flag="--separator")
    balance_length: bool = option(False, "train on a subset where chosen-longer and chosen-shorter pairs "
                                  "are equally frequent", flag="--balance-length")
    balance_replies: bool = option(False, "train on the largest subset where every reply text is chosen exactly as "
                                   "often as it is rejected (a reply alone then predicts nothing: for pairs of a "
                                   "policy's own samples, where a right answer's text is otherwise a favourite)",
                                   flag="--balance-replies")
    dev_fraction: float = option(0.0, "carve a dev split (by prompt) of this share from the train pairs, train on "
                                 "the rest and evaluate on it instead of the held-out pairs (to choose settings "
                                 "without looking at the held-out pairs); 0 = off", low=0.0, high=0.9,
                                 flag="--dev-fraction")
    max_pairs: int = option(0, "use only the first N usable pairs (0 = all)", low=0, flag="--max-pairs")
    step_separator: str = option("\\n", "--process: the text that ends every step (\\n and \\t are read as "
                                 "newline and tab)", flag="--step-separator")
    skip_invalid: bool = option(False, "skip (and count) bad data rows instead of stopping",
                                flag="--skip-invalid")


@dataclass
class OptimConfig:
    lr: float = option(2e-5, "AdamW learning rate", low=0.0, low_open=True, flag="--lr")
    epochs: int = option(1, "passes over the training pairs", low=1, flag="--epochs")
    batch_size: int = option(8, "pairs per forward pass", low=1, flag="--batch-size")
    grad_accumulation: int = option(1, "forward passes per optimiser step", low=1, flag="--grad-accumulation",
                                    aliases=("grad_accum",))
    weight_decay: float = option(0.0, "AdamW weight decay", low=0.0, flag="--weight-decay")
    warmup_ratio: float = option(0.05, "share of steps with linear warm-up (then linear decay to 0)",
                                 low=0.0, high=1.0, flag="--warmup-ratio")
    max_grad_norm: float = option(1.0, "gradient-norm clip", low=0.0, low_open=True, flag="--max-grad-norm")
    group_by_length: bool = option(False, "batch pairs of similar token length (less padding, same pairs; the "
                                   "batch order stays shuffled)", flag="--group-by-length")


@dataclass
class LoraConfig:
    r: int = option(0, "LoRA rank; 0 = full fine-tune", low=0, flag="--lora-r")
    alpha: float = option(16.0, "LoRA alpha (scale alpha/r)", low=0.0, low_open=True, flag="--lora-alpha")
    dropout: float = option(0.0, "LoRA dropout", low=0.0, high=0.9, flag="--lora-dropout")
    target_modules: str = option("", "comma list of modules, 'all-linear', or empty for peft's default",
                                 flag="--lora-target-modules")


@dataclass
class LossConfig:
    margin: float = option(0.0, "BT margin m in -log sigmoid(r_w - r_l - m)", low=0.0, flag="--margin")
    length_reg: float = option(0.0, "weight of corr(score, reply length)^2 per batch", low=0.0,
                               flag="--length-reg")
    length_expert: bool = option(False, "train on P(chosen) = sigmoid(r_c - r_r + w * (log len_c - log len_r)), "
                                 "w fitted on length alone first and frozen; scores are r alone: the "
                                 "length-controlled preference (keeps every pair, unlike --balance-length)",
                                 flag="--length-expert")


@accepts_trl_keys  # TRL's flat names (learning_rate=...) accepted; other unknown keywords get a hint
@dataclass
class RewardTrainingConfig:
    """``tether train-rm``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    model: str = option("", "backbone: a local Hugging Face model directory or Hub id (causal LM or encoder)",
                        flag="--model")
    output_dir: str = option("", "where the reward model is written (atomically)", flag="--output-dir")
    seed: int = option(0, "seed for the split, the head init and the batch order", flag="--seed")
    device: str = option("auto", "auto (cuda if available), cpu, cuda, cuda:N", flag="--device")
    dtype: str = option("fp32", "dtype of frozen weights and compute; trainable weights stay fp32",
                        choices=tuple(DTYPES), flag="--dtype", value_aliases=DTYPE_ALIASES)
    pooling: str = option("auto", "text -> one vector for the head: auto (last token for causal LMs, the model's "
                          "own head for encoders), last_token, mean (masked mean of the last hidden states, "
                          "what sentence encoders such as MiniLM were trained for), model",
                          choices=("auto", "last_token", "mean", "model"), flag="--pooling")
    disable_dropout: bool = option(True, "set every dropout probability to 0 during training (as TRL does), so "
                                   "chosen and rejected see the same network; false keeps the model's own",
                                   flag="--disable-dropout")
    process: bool = option(False, "train a process reward model: step-labelled data, one score per step, "
                           "per-step binary cross-entropy (see docs/process-reward.md)", flag="--process")
    norm_sample: int = option(1000, "train pairs added to the held-out ones for the score mean/std", low=0,
                              flag="--norm-sample")
    eval_batch_size: int = option(32, "texts per forward pass when scoring", low=1, flag="--eval-batch-size")
    save_every: int = option(0, "checkpoint every N optimiser steps (DIR/checkpoints, for --resume; removed when "
                             "the finished model is written); 0 = by time only", low=0, flag="--save-every")
    save_every_minutes: float = option(10.0, "checkpoint after a step when this many minutes have passed since the "
                                       "last one; 0 = off", low=0.0, flag="--save-every-minutes")
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    @property
    def step_separator(self) -> str:
        """``data.step_separator`` with ``\\n`` and ``\\t`` read as newline and tab."""
        from tether.rm.steps import unescape_separator

        return unescape_separator(self.data.step_separator)

    def validate(self) -> None:
        check_fields(self)  # every field's type, choices and bounds, named by key and flag
        if not self.model:
            raise ConfigError("--model is required (a local Hugging Face model directory or Hub id)")
        if not self.data.files:
            raise ConfigError("--data is required (a preference data file, or step-labelled data with --process; "
                              "repeatable)")
        if not self.output_dir:
            raise ConfigError("--output-dir is required")
        if self.process:
            if not self.step_separator:
                raise ConfigError("--step-separator must not be empty")
            if self.data.format == "chat":
                raise ConfigError("--process uses the plain format (prompt + separator + steps); --format chat "
                                  "is not supported for process reward models yet")
            if self.pooling not in ("auto", "last_token"):
                raise ConfigError(f"--process reads the head at each step's last token; --pooling {self.pooling} "
                                  f"does not apply")
            if self.loss.margin or self.loss.length_reg or self.loss.length_expert or self.data.balance_length:
                raise ConfigError("--margin, --length-reg, --length-expert and --balance-length are pairwise "
                                  "options; they do not apply to --process")
        try:
            torch.device("cuda" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ConfigError(f"--device: {self.device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
