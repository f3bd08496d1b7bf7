"""The README stays true: CI runs exactly the fresh-machine test command, every `tether` subcommand the README
names exists, the "From Python" script runs (at tiny size), and the page stays a short first page (the
measurements it once carried are in docs/results.md; paths and commands of every page: test_docs_paths.py)."""

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


SECTIONS = ["## Try it", "## What you will see", "## Your model and your data", "## From Python",
            "## Coming from TRL", "## Documentation", "## Status"]


def test_readme_is_a_short_first_page_in_the_order_a_user_needs():
    """A first page, not a lab notebook: at most ~200 lines, the sections in order, the two fresh-machine commands
    first, and the figure the demo's report draws. Measurement tables live in docs/results.md."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 210
    positions = [text.index(s + "\n") for s in SECTIONS]
    assert positions == sorted(positions)
    assert text.index("```bash") > text.index("## Try it") and "](docs/img/demo-gold.png)" in text
    assert text.count("| seed |") == 0 and "| seed |" in (REPO / "docs" / "results.md").read_text(encoding="utf-8")


def test_readme_examples_need_nothing_beside_the_clone():
    """A clone has no ../shared/data: the README's examples name files a user writes, Hub ids, or the demo's."""
    assert "../shared" not in (REPO / "README.md").read_text(encoding="utf-8")


def test_user_docs_name_no_issue_numbers_or_commit_hashes():
    """"#42" and "c82fbb6" mean nothing to a user: the README and docs/ say what changed, and when."""
    pattern = re.compile(r"(?<![#\w&])#\d+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found = pattern.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.name}: {found}"
    assert pattern.findall("fixed in #42 (c82fbb6)") == ["#42", "c82fbb6"]
    assert not pattern.findall("a last line `#### 72`, 1.3000001, tether3f9a01c2")


def from_python_script() -> str:
    """The README's "From Python" script, verbatim."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## From Python\n"):]
    return re.search(r"```python\n(.*?)\n```", section, re.S).group(1)


def test_the_from_python_script_runs_at_tiny_size(tmp_path):
    """The script as the README prints it, with only its five settings pointed at a tiny chat model (built from a
    config, nothing downloaded), conversational pairs and message prompts written here, and 2 PPO steps."""
    import json
    import os
    import subprocess
    import sys

    from tiny import make_llama_chat_dir

    letters = "abcdefghij"
    pairs = [{"chosen": [{"role": "user", "content": f"say {c}"}, {"role": "assistant", "content": c * 3}],
              "rejected": [{"role": "user", "content": f"say {c}"}, {"role": "assistant", "content": "no"}]}
             for c in letters * 3]
    prompts = [{"prompt": [{"role": "user", "content": f"say {a}{b}"}], "letter": a} for a in letters for b in "xyz"]
    settings = {"POLICY": str(make_llama_chat_dir(tmp_path)), "PAIRS": str(tmp_path / "pairs.jsonl"),
                "PROMPTS": str(tmp_path / "prompts.jsonl"), "OUT": str(tmp_path / "runs"), "STEPS": 2}
    for name, rows in (("PAIRS", pairs), ("PROMPTS", prompts)):
        Path(settings[name]).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    script = from_python_script()
    for name, value in settings.items():
        script, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", script, count=1, flags=re.M)
        assert n == 1, f"the README script no longer sets {name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward model: " in done.stdout and "step 1: score " in done.stdout and "eval/reward" in done.stdout
    run = tmp_path / "runs" / "ppo"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("custom/minutes" in r for r in rows[1:])
    config = (run / "config.yaml").read_text()
    assert "python:finished_briefly" in config and "python:prompts (30 rows" in config
    assert (run / "policy" / "model.safetensors").is_file() and (tmp_path / "runs" / "rm" / "eval.json").is_file()
