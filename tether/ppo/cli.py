"""``tether ppo``: flags and YAML for :class:`~tether.ppo.config.RunConfig`, then :func:`tether.ppo.train.train`
(:class:`~tether.ppo.train.PPOTrainer`, the Python API's code path)."""

from __future__ import annotations

import os

from tether.config import add_config_flags, resolve_config
from tether.ppo.config import RunConfig


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir from its newest complete checkpoint up to --steps")
    parser.add_argument("--dry-run", action="store_true",
                        help="print this run's memory plan and the launch checklist, then exit without training")
    add_config_flags(parser, RunConfig)


def run(args) -> int:
    from tether.ppo.train import train

    cfg = resolve_config(RunConfig, args, args.config)
    if args.dry_run:
        from tether.ppo.dryrun import dry_run

        print(dry_run(cfg))
        return 0
    run_dir = train(cfg, resume=args.resume)  # PPOTrainer(cfg, resume=...).train(), as from Python
    if os.environ.get("RANK", "0") == "0":  # one line, not one per process
        print(f"tether ppo: run written to {run_dir}")
    return 0
