"""The ``tether dpo`` config: one dataclass, nested by concern, every field documented once.

Names match the other stages where the concept is the same: ``model.*`` is SFT's (the policy trained: ``--model``,
``--dtype``, ``--lora-r``, ``--export-lora``), ``data.*`` reads the pairs ``train-rm`` reads and renders them as
``tether sft`` renders its rows (chat template, ``--system-prompt``, ``--prompt-template``), ``optim.*`` as in SFT.
Defaults follow TRL's ``DPOConfig`` where it has the knob (``beta`` 0.1, ``loss_type`` sigmoid, dropout off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tether.config import check_fields, option
from tether.core.preference import LOSS_TYPES
from tether.errors import ConfigError
from tether.sft.config import AdamWConfig, TextFormatConfig
from tether.sft.config import ModelConfig as SFTModelConfig
from tether.trl_compat.keys import accepts_trl_keys


@dataclass
class ModelConfig(SFTModelConfig):
    # TRL's DPOConfig turns dropout off too: chosen, rejected and the reference then see one deterministic network.
    disable_dropout: bool = option(True, "set every dropout probability to 0 (as TRL's DPO does); false keeps the "
                                   "model's own", flag="--disable-dropout")


@dataclass
class DataConfig(TextFormatConfig):  # max length, chat template (and file), system prompt, prompt template: sft's
    files: list[str] = option([], "preference pairs, the files train-rm reads (JSONL, CSV, Parquet, a datasets "
                              "folder, hf:org/name[:config][:split]): prompt/chosen/rejected, HH transcripts or "
                              "TRL's conversational pairs; repeatable", flag="--data", repeat=True)
    eval_fraction: float = option(0.1, "share of the pairs held out by prompt for the held-out preference accuracy",
                                  low=0.0, low_open=True, high=0.9, flag="--eval-fraction")
    packing: bool = option(False, "padding-free packing: a batch's chosen and rejected sequences share rows, "
                           "attention kept within each (the same log-probs; docs/dpo.md)", flag="--packing")
    max_pairs: int = option(0, "use only the first N usable pairs (0 = all)", low=0, flag="--max-pairs")
    skip_invalid: bool = option(False, "skip (and count) bad data rows instead of stopping", flag="--skip-invalid")


@dataclass
class OptimConfig(AdamWConfig):  # AdamW, its schedule and the clip: as tether sft's (the same make_optimisation)
    lr: float = option(1e-6, "AdamW learning rate (TRL's DPO default)", low=0.0, low_open=True, flag="--lr")
    epochs: int = option(1, "passes over the training pairs", low=1, flag="--epochs")
    batch_size: int = option(8, "pairs per forward pass (2 x this many sequences)", low=1, flag="--batch-size")
    grad_accumulation: int = option(1, "forward passes per optimiser step", low=1, flag="--grad-accumulation")


@dataclass
class LossConfig:
    beta: float = option(0.1, "beta: the strength of the tether to the reference in the implicit reward "
                         "beta * (log pi - log pi_ref)", low=0.0, low_open=True, flag="--beta")
    loss_type: str = option("sigmoid", "sigmoid: DPO, -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2 on per-token "
                            "mean log-probs (docs/dpo.md)", choices=LOSS_TYPES, flag="--loss-type")
    label_smoothing: float = option(0.0, "cDPO: the share of labels assumed flipped (sigmoid only)", low=0.0,
                                    high=0.5, flag="--label-smoothing")


@accepts_trl_keys  # TRL's flat names (beta=..., learning_rate=...) accepted; other unknown keywords get a hint
@dataclass
class DPOConfig:
    """``tether dpo``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    output_dir: str = option("", "the run directory, and at the end the trained policy itself (a Hugging Face model "
                             "directory with its tokenizer, usable as --policy / --model)", flag="--output-dir")
    seed: int = option(0, "seed for the split, the batch order, LoRA's initialisation and dropout", flag="--seed")
    device: str = option("auto", "auto (cuda if available), cpu, cuda, cuda:N", flag="--device")
    precompute_ref_log_probs: bool = option(True, "compute the reference's log-probs of every pair once before "
                                            "training (no reference model in memory while training); false: a "
                                            "frozen copy (or, with LoRA, the adapter turned off) scores each batch",
                                            flag="--precompute-ref-log-probs")
    eval_every: int = option(0, "evaluate on the held-out pairs every N steps (and before the first and after the "
                             "last, always); 0 = start and end only", low=0, flag="--eval-every")
    eval_batch_size: int = option(16, "pairs per forward pass when scoring (reference, evaluation)", low=1,
                                  flag="--eval-batch-size")
    save_every: int = option(0, "checkpoint every N optimiser steps (DIR/checkpoints, for --resume; removed when the "
                             "finished policy is written); 0 = by time only", low=0, flag="--save-every")
    save_every_minutes: float = option(10.0, "checkpoint after a step when this many minutes have passed since the "
                                       "last one; 0 = off", low=0.0, flag="--save-every-minutes")
    progress: bool = option(True, "per-step progress on stderr: a bar on a terminal, one plain line a step otherwise")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def validate(self) -> None:
        check_fields(self)  # every field's type, choices and bounds, named by key and flag
        if not self.model.path:
            raise ConfigError("--model: required (the policy to train: a model directory or preset, e.g. the output "
                              "of tether sft)")
        if not self.data.files:
            raise ConfigError("--data: required (a preference pairs file; repeatable)")
        if not self.output_dir:
            raise ConfigError("--output-dir: required")
        self.data.check()
        self.model.check()
        if self.loss.label_smoothing and self.loss.loss_type != "sigmoid":
            raise ConfigError(f"--label-smoothing: applies to --loss-type sigmoid, not {self.loss.loss_type}")
        try:
            torch.device("cuda" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ConfigError(f"--device: {self.device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
