"""The ``tether`` command: demo, rlhf, sft, sample, train-rm, dpo, label-steps, ppo, plan, doctor, report.

Each subcommand lives in its own module, imported only when used, exposing
``add_arguments(parser)`` and ``run(args) -> int``. Bad input (a :class:`~tether.errors.TetherError`)
is printed as one line and exits with code 2; argparse errors are one line too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tether.errors import TetherError

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("tether.demo.pipeline", "run the built-in task end to end: SFT -> reward model -> PPO (beta > 0 and beta = 0)"),
    "rlhf": ("tether.pipeline.cli", "the classic pipeline in one command: pairs from the policy's samples -> reward "
             "model -> PPO (beta > 0, beta = 0, refresh rounds, control, DPO) -> paired report"),
    "sft": ("tether.sft.cli", "supervised fine-tuning: the policy (and reference) for train-rm and ppo"),
    "sample": ("tether.sft.sample_cli", "K samples per prompt from a policy, kept when a rule or reward model "
               "accepts them: SFT rows (rejection sampling, Best-of-N)"),
    "train-rm": ("tether.rm.cli", "train a Bradley-Terry reward model from preference pairs"),
    "dpo": ("tether.dpo.cli", "direct preference optimisation: the policy trained on preference pairs, no reward "
            "model"),
    "label-steps": ("tether.rm.label_cli", "label every step of (prompt, response) rows with a step rule, for "
                    "train-rm --process"),
    "ppo": ("tether.ppo.cli", "optimise a policy against rewards with PPO and a KL tether"),
    "plan": ("tether.diagnostics.plan", "will this RLHF run fit? memory of the four models per phase"),
    "doctor": ("tether.diagnostics.doctor", "diagnose a PPO run from its metrics"),
    "report": ("tether.diagnostics.report", "write a self-contained HTML report of one or more runs"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def version() -> str:
    """The installed package's version (read without importing torch), else the source tree's."""
    from importlib import metadata

    try:
        return metadata.version("tether")
    except metadata.PackageNotFoundError:
        from tether import __version__

        return __version__


def build_parser(only: str | None = None, full_help: bool = True) -> argparse.ArgumentParser:
    """The ``tether`` parser; ``only``: the one subcommand whose flags are added (all when None); ``full_help``
    False: a subcommand's ``--help`` lists its common flags only (``--help-all``: every flag)."""
    parser = OneLineParser(prog="tether", description="Classic RLHF: SFT, reward models and PPO with a KL tether.")
    parser.add_argument("--version", action="version", version=f"tether {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            p.tether_full_help = full_help
            p.add_argument("--help-all", action="store_true", help="show every flag, grouped by concern, and exit")
            importlib.import_module(module).add_arguments(p)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown flag answered by the flag meant (one line, exit 2)."""
    from tether.cli_flags import unknown_flags_message

    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command", None)
        sub = parser._subparsers._group_actions[0].choices[command] if command else parser
        sub.error(unknown_flags_message(sub, extras))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen subcommand's module is imported (keeps `tether plan` and `--help` fast).
    only = next((a for a in argv if a in COMMANDS), None)
    full_help = "--help-all" in argv
    if full_help:
        argv = [("--help" if a == "--help-all" else a) for a in argv]
    parser = build_parser(only, full_help=full_help)
    args = parse(parser, argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        code = int(module.run(args) or 0)
    except TetherError as e:
        print(f"tether {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"tether {args.command}: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `tether doctor RUN | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # as a shell reports a pipe writer ended by SIGPIPE
    if args.command in ("ppo", "sft") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a process of `accelerate launch`: its gloo threads must not meet the interpreter's teardown (#32)
        from tether.ppo.processes import leave_without_teardown

        leave_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
