"""``tether train-rm``: flags and YAML for :class:`~tether.rm.config.RewardTrainingConfig`, then
:class:`tether.rm.trainer.RewardTrainer` (the Python API's code path)."""

from __future__ import annotations

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.rm.config import RewardTrainingConfig

# What `tether train-rm --help` shows; `--help-all` shows every flag.
COMMON = ("--model", "--data", "--output-dir", "--dtype", "--lora-r", "--eval-fraction", "--max-length", "--lr",
          "--epochs", "--batch-size", "--grad-accumulation", "--seed", "--process", "--device")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the unfinished training in --output-dir from its newest checkpoint")
    add_config_flags(parser, RewardTrainingConfig, COMMON)


def run(args) -> int:
    from tether.rm.trainer import RewardTrainer

    RewardTrainer(resolve_config(RewardTrainingConfig, args, args.config), resume=args.resume).train()
    return 0
