"""``tether ppo``: flags and YAML for :class:`~tether.ppo.config.RunConfig`, then :func:`tether.ppo.train.train`
(:class:`~tether.ppo.train.PPOTrainer`, the Python API's code path)."""

from __future__ import annotations

import os

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.ppo.config import RunConfig

# What `tether ppo --help` shows; `--help-all` shows every flag.
COMMON = ("--policy", "--dtype", "--lora-r", "--prompts", "--eval-prompts", "--eval-fraction", "--reward", "--gold",
          "--kl-coef", "--kl-controller", "--kl-target", "--advantage", "--samples-per-prompt", "--max-new-tokens",
          "--temperature", "--steps", "--batch-size", "--mini-batches", "--ppo-epochs", "--lr", "--eval-every",
          "--eval-n", "--eval-at-start", "--output-dir", "--seed", "--engine", "--log-with", "--progress")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir from its newest complete checkpoint up to --steps")
    parser.add_argument("--dry-run", action="store_true",
                        help="print this run's memory plan and the launch checklist, then exit without training")
    add_config_flags(parser, RunConfig, COMMON)
    parser.add_argument("--no-packing", dest="ppo.packing", action="store_const", const="false", default=None,
                        help="padded rows in every policy and reference forward (ppo.packing false); packing is on "
                             "by default when --samples-per-prompt > 1 and the start-up check passes")


def run(args) -> int:
    from tether.ppo.runlog import end_line
    from tether.ppo.train import PPOTrainer

    cfg = resolve_config(RunConfig, args, args.config)
    if args.dry_run:
        from tether.ppo.dryrun import dry_run

        print(dry_run(cfg))
        return 0
    result = PPOTrainer(cfg, resume=args.resume).train()  # as from Python (tether.ppo.train.train)
    if os.environ.get("RANK", "0") == "0":  # once, not once per process
        print(end_line(result.run_dir, result.steps, result.stopped))
    return 0
