"""`tether sft` and `tether train-rm` off a terminal: one plain line per logged step on stderr and no `\\r` (a tqdm
bar redraws itself with `\\r`, which a CI log keeps as one long line); on a terminal, the bar. The same rule as
`tether ppo` (tether.runlog.progress_mode)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from test_reward_model import save_tiny_gpt2
from test_sft import rows_file
from tiny import make_policy_dir

from tether.runlog import StepProgress, progress_mode

REPO = Path(__file__).resolve().parents[1]


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_mode_and_step_progress_on_a_terminal_and_off_it():
    assert progress_mode(Stream(True)) == "bar" and progress_mode(Stream(False)) == "lines"
    assert progress_mode(Stream(True), enabled=False) == "off" and progress_mode(object()) == "lines"  # no isatty
    for tty in (False, True):
        stream = Stream(tty)
        bar = StepProgress("sft", 3, initial=1, stream=stream)
        bar.update(loss="0.5000", lr="0.001")
        bar.update(loss="0.2500", lr="0.001")
        bar.close()
        text = stream.getvalue()
        if tty:  # tqdm's bar, redrawn with \r, ending at 3/3
            assert "\r" in text and "3/3" in text
        else:  # resumed at step 1: steps 2 and 3, one line each
            assert text == "sft step 2/3  loss 0.5000  lr 0.001\nsft step 3/3  loss 0.2500  lr 0.001\n"
    quiet = Stream(False)
    off = StepProgress("sft", 3, enabled=False, stream=quiet)
    off.update(loss="1")
    off.close()
    assert quiet.getvalue() == ""


def run_tether(*argv: str) -> subprocess.CompletedProcess:
    """``python -m tether ARGV`` with stderr to a pipe (not a terminal), as a CI job or a batch scheduler runs it."""
    proc = subprocess.run([sys.executable, "-m", "tether", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def step_lines(stderr: str, desc: str) -> list[int]:
    """The step numbers of ``DESC step N/TOTAL`` lines, after checking that stderr has no carriage return."""
    assert "\r" not in stderr
    return [int(m.group(1)) for m in re.finditer(rf"^{desc} step (\d+)/\d+  \S.*$", stderr, flags=re.M)]


def logged_steps(metrics: Path) -> list[int]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step"] for r in rows if r["step"] > 0]  # sft's step-0 evaluation row is not a step


def test_sft_off_a_terminal_prints_one_plain_line_per_step(tmp_path):
    out = tmp_path / "sft"
    proc = run_tether("sft", "--model", str(make_policy_dir(tmp_path)), "--data", str(rows_file(tmp_path)),
                      "--output-dir", str(out), "--max-steps", "3", "--batch-size", "4", "--lr", "3e-3")
    assert step_lines(proc.stderr, "sft") == logged_steps(out / "metrics.jsonl") == [1, 2, 3]
    assert "sft step 3/3  loss " in proc.stderr


def test_train_rm_off_a_terminal_prints_one_plain_line_per_step(tmp_path):
    out = tmp_path / "rm"
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
                            + "\n" for i in range(10, 40)), encoding="utf-8")
    proc = run_tether("train-rm", "--model", str(save_tiny_gpt2(tmp_path / "m")), "--data", str(data),
                      "--output-dir", str(out), "--epochs", "1", "--batch-size", "8", "--max-length", "16")
    steps = logged_steps(out / "metrics.jsonl")
    assert len(steps) >= 2 and step_lines(proc.stderr, "train-rm") == steps == list(range(1, len(steps) + 1))
