"""``tether dpo``: flags and YAML for :class:`~tether.dpo.config.DPOConfig`, then :class:`tether.dpo.train.DPOTrainer`
(the Python API's code path)."""

from __future__ import annotations

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.dpo.config import DPOConfig

# What `tether dpo --help` shows; `--help-all` shows every flag.
COMMON = ("--model", "--data", "--output-dir", "--dtype", "--lora-r", "--eval-fraction", "--max-length", "--lr",
          "--epochs", "--batch-size", "--grad-accumulation", "--beta", "--loss-type", "--label-smoothing", "--seed",
          "--packing", "--device")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    parser.add_argument("--resume", action="store_true",
                        help="continue the unfinished run in --output-dir from its newest checkpoint")
    add_config_flags(parser, DPOConfig, COMMON)


def run(args) -> int:
    from tether.dpo.train import DPOTrainer

    result = DPOTrainer(resolve_config(DPOConfig, args, args.config), resume=args.resume).train()
    print(f"tether dpo: {result.steps} steps; the policy is {result.run_dir} (use it as --policy / --model)")
    return 0
