"""The README and the docs name only what exists: every repository path they mention is a file or folder of this
checkout, every link between pages lands on a page, every `module:function` spec names a function that is
there, and every `tether ...` command line in a code block parses with the real CLI parser (nothing is run).

A command may elide what does not matter to it with `...` (`tether ppo ... --engine vllm`), so the parse here
does not insist on required flags; any flag the parser does not know, or a value it refuses, fails the test."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tether.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("tether", "tests", "bench", "examples", "docs", ".ci")
# a path in running text or code: starts at a top-level folder of the repository, ends at a name character
PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPEC = re.compile(r"\b(tether(?:\.\w+)+):(\w+)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
METAVAR = re.compile(r"^[A-Z][A-Z0-9_]*(?:[=:][A-Z0-9_]+)*$")  # N, FILE, NAME=LOW:HIGH
SHELL_ENDS = {"&&", "||", "|", ";", ">", ">>", "2>&1", "&"}


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def placeholder(path: str) -> bool:
    """Paths written as patterns, not names: `docs/*.md`, `runs/DIR/...`, `tether/<x>.py`."""
    return any(c in path for c in "*<>{}") or "..." in path or re.search(r"/[A-Z_]{3,}(/|$)", path) is not None


def named_paths(text: str) -> set[str]:
    return {m.rstrip("/.") or m for m in PATH.findall(text) if not placeholder(m)}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_named_path_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = sorted(p for p in named_paths(text) if not (REPO / p).exists())
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_link_lands(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor on the same page
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page_id(page)} links to pages that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_module_function_spec_exists(page):
    """`tether.rules:math_answer` as a reward or gold rule: the module's file holds that top-level name, or the module
    (a package such as ``tether.rules``, which imports its rules from ``tether.rules.library``) has it as a function,
    as ``load_rule`` resolves it."""
    import importlib

    bad = []
    for module, name in set(SPEC.findall(page.read_text(encoding="utf-8"))):
        base = REPO / Path(*module.split("."))
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not source.is_file():
            bad.append(f"{module}:{name}")
        elif not re.search(rf"^(def |class )?{name}\b", source.read_text(), re.M) and \
                not callable(getattr(importlib.import_module(module), name, None)):
            bad.append(f"{module}:{name}")
    assert not bad, f"{page_id(page)} names specs that do not exist: {sorted(bad)}"


def command_lines(text: str) -> list[str]:
    """Every `tether SUBCOMMAND ...` in the page's code blocks, continuation lines joined, as the words after
    `tether` up to the end of the command (a comment, `&&`, a pipe, a redirect)."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote in prose inside a block: not a command
                continue
            for i, word in enumerate(words[:-1]):
                starts = i == 0 or words[i - 1] in SHELL_ENDS | {"-m"} or words[i - 1].endswith("/bin/tether")
                if word == "tether" and starts and words[i + 1] in COMMANDS:
                    end = next((j for j in range(i + 1, len(words)) if words[j] in SHELL_ENDS), len(words))
                    found.append(words[i + 1:end])
    return found


def parses(words: list[str]) -> str | None:
    """None when the CLI's own parser accepts the words, else its one-line error."""
    words = [w.strip("[]") for w in words if w.strip("[]") not in ("", "...", "…")]
    if any(w in ("-h", "--help") for w in words):
        return None
    parser = build_parser(only=words[0])
    command = parser._subparsers._group_actions[0].choices[words[0]]
    for action in command._actions:
        action.required = False  # `tether ppo ... --engine vllm`: what is elided is not missing
    # a synopsis's metavariable as a flag's value (`--persistence N`): the flag must exist, the value is not parsed
    placeholders = [i for i in range(1, len(words)) if METAVAR.match(words[i]) and words[i - 1].startswith("-")]
    for i in placeholders:
        if words[i - 1] not in command._option_string_actions:
            return f"unrecognized argument: {words[i - 1]}"
    words = [w for i, w in enumerate(words) if i not in placeholders and i + 1 not in placeholders]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(words)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return None


def all_commands() -> list[tuple[str, list[str]]]:
    return [(page_id(page), words) for page in PAGES for words in command_lines(page.read_text(encoding="utf-8"))]


def test_the_pages_have_commands_to_check():
    """The extraction itself works: the README's three stages and the docs' examples are found."""
    found = all_commands()
    assert {words[0] for _, words in found} >= {"demo", "sft", "train-rm", "ppo", "doctor", "report"}
    assert len(found) > 30


@pytest.mark.parametrize("page, words", all_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_every_command_parses(page, words):
    error = parses(words)
    assert error is None, f"{page}: `tether {' '.join(words)}` does not parse: {error}"


def test_a_wrong_flag_or_path_is_caught():
    """The checks can fail: an unknown flag, a bad choice, a missing file and a missing spec are found."""
    assert parses(["ppo", "--no-such-flag", "1"]) is not None
    assert parses(["demo", "--advantage", "no-such-estimator"]) is not None
    assert parses(["ppo", "...", "--steps", "3"]) is None
    assert parses(["doctor", "RUN_DIR", "[--persistence", "N]"]) is None  # a synopsis
    assert parses(["doctor", "RUN_DIR", "--persistence", "x"]) is not None
    assert parses(["doctor", "RUN_DIR", "--no-such-flag", "N"]) is not None
    assert named_paths("see `tether/reward_model.py` and docs/README.md") == {"tether/reward_model.py",
                                                                              "docs/README.md"}
    assert not (REPO / "tether/reward_model.py").exists()
    assert command_lines("```bash\ntether ppo --steps 3 \\\n    --lr 1e-5  # a comment\nls && tether doctor runs/x\n```\n") \
        == [["ppo", "--steps", "3", "--lr", "1e-5"], ["doctor", "runs/x"]]


def architecture_tree() -> set[str]:
    """The package files docs/architecture.md's tree names: `  core/` opens a folder, `    gae.py` is in it."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = next(b for b in FENCE.findall(text) if b.startswith("tether/"))
    names, folder = set(), ""
    for line in block.splitlines()[1:]:
        if not line.startswith("  "):
            break  # tests/, bench/...: past the package
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        if depth == 1:
            folder = name if name.endswith("/") else ""
            if not folder:
                names.add(f"tether/{name}")
        elif folder:
            names.add(f"tether/{folder}{name}")
    return names


def test_the_architecture_page_has_a_line_for_every_package_file():
    """One line per file (the annotated tree that once was the README's): a file added to the package and not to the
    tree, or a line for a file that is gone, fails here."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "tether"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    files = {f for f in tracked if f.endswith(".py") and not f.endswith("/__init__.py") or f == "tether/__init__.py"}
    named = architecture_tree()
    assert not files - named, f"docs/architecture.md has no line for {sorted(files - named)}"
    assert not {n for n in named if not (REPO / n).exists()}, "docs/architecture.md names files that are gone"
