"""The README's two fresh-machine commands stay true: CI runs exactly the test command, and every
`tether` subcommand the README names exists."""

import re
from pathlib import Path

from tether.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def readme_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    return blocks[0].strip(), blocks[1].strip()


def test_ci_runs_exactly_the_readme_test_command():
    _, test_command = readme_commands()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_main_job_runs_the_demo_and_installs_cpu_torch_first():
    main_command, test_command = readme_commands()
    for command in (main_command, test_command):
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")
    assert main_command.endswith("tether demo")


def test_readme_names_only_real_subcommands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for name in set(re.findall(r"`tether ([a-z-]+)", text)):
        assert name in COMMANDS, name
