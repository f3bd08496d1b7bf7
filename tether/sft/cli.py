"""``tether sft``: flags and YAML for :class:`~tether.sft.config.SFTConfig`, then :class:`tether.sft.train.SFTTrainer`
(the Python API's code path)."""

from __future__ import annotations

import os

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.sft.config import SFTConfig

# What `tether sft --help` shows; `--help-all` shows every flag.
COMMON = ("--model", "--dtype", "--lora-r", "--data", "--eval-data", "--eval-fraction", "--max-length", "--lr",
          "--epochs", "--steps", "--batch-size", "--grad-accumulation", "--eval-every", "--output-dir", "--seed",
          "--packing", "--progress")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir from its newest checkpoint")
    add_config_flags(parser, SFTConfig, COMMON)


def run(args) -> int:
    from tether.sft.train import SFTTrainer

    result = SFTTrainer(resolve_config(SFTConfig, args, args.config), resume=args.resume).train()
    if os.environ.get("RANK", "0") == "0":  # one line, not one per process
        print(f"tether sft: {result.steps} steps; the policy is {result.run_dir} (use it as --policy / --model)")
    return 0
