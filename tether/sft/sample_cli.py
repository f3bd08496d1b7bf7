"""``tether sample``: flags and YAML for :class:`~tether.sft.sample.SampleConfig`, then
:func:`tether.sft.sample.rejection_sample` (the Python API's code path)."""

from __future__ import annotations

from tether.cli_flags import add_config_flags
from tether.config import resolve_config
from tether.sft.sample import SampleConfig

# What `tether sample --help` shows; `--help-all` shows every flag.
COMMON = ("--policy", "--dtype", "--prompts", "--reward", "--min-score", "--keep", "--samples-per-prompt",
          "--max-new-tokens", "--temperature", "--batch-size", "--output", "--seed", "--engine")


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (nested like the keys below); flags override it")
    add_config_flags(parser, SampleConfig, COMMON)


def run(args) -> int:
    from tether.sft.sample import rejection_sample

    result = rejection_sample(resolve_config(SampleConfig, args, args.config))
    c = result.counts
    print(f"tether sample: {c['prompts']} prompts x {c['samples'] // max(c['prompts'], 1)} samples: "
          f"{c['ended_with_eos']} ended with EOS, {c['accepted']} accepted, {c['kept']} rows kept "
          f"({100 * c['kept_fraction']:.1f}% of the samples); {c['prompts_with_kept']} of {c['prompts']} prompts "
          f"({100 * c['prompts_with_kept_fraction']:.1f}%) have a kept row -> {result.output}")
    return 0
