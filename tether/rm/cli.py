"""``tether train-rm``: flags and YAML for :class:`~tether.rm.config.RewardTrainingConfig`, then
:func:`tether.rm.train.train_reward_model`."""

from __future__ import annotations

from tether.config import add_config_flags, resolve_config
from tether.rm.config import RewardTrainingConfig


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    add_config_flags(parser, RewardTrainingConfig)


def run(args) -> int:
    cfg = resolve_config(RewardTrainingConfig, args, args.config)
    if cfg.process:
        from tether.rm.train_process import train_process_reward_model

        train_process_reward_model(cfg)
    else:
        from tether.rm.train import train_reward_model

        train_reward_model(cfg)
    return 0
