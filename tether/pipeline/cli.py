"""``tether rlhf``: flags and YAML for :class:`~tether.pipeline.config.RLHFConfig`, then
:class:`tether.pipeline.run.RLHFPipeline` (the Python API's code path)."""

from __future__ import annotations

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.pipeline.config import RLHFConfig

# What `tether rlhf --help` shows; `--help-all` shows every flag.
COMMON = ("--policy", "--task", "--gold", "--sft-data", "--pair-samples", "--pairs", "--steps", "--kl-coef",
          "--beta0", "--control", "--refresh-rounds", "--dpo", "--eval-n", "--output-dir", "--seed", "--engine",
          "--ppo-config", "--rm-config", "--parallel-arms")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    add_config_flags(parser, RLHFConfig, COMMON)


def run(args) -> int:
    from tether.pipeline.run import RLHFPipeline

    RLHFPipeline(resolve_config(RLHFConfig, args, args.config)).run()
    return 0
