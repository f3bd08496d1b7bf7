"""``tether train-rm``: flags and YAML for :class:`~tether.rm.config.RewardTrainingConfig`, then
:func:`tether.rm.train.train_reward_model`."""

from __future__ import annotations

from tether.config import add_config_flags, resolve_config
from tether.rm.config import RewardTrainingConfig


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    add_config_flags(parser, RewardTrainingConfig)


def run(args) -> int:
    from tether.rm.train import train_reward_model

    cfg = resolve_config(RewardTrainingConfig, args, args.config)
    train_reward_model(cfg)
    return 0
