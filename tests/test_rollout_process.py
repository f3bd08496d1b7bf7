"""The rollout process's life (issue 41, SPEC C3/C7) under scripts that drive the trainers as users do: trainer 0 busy
between steps for longer than the collective timeout (a slow checkpoint or export, the script's own work), and a
script that ends after ``step()`` without finishing the run. 1 trainer + 1 rollout process, CPU processes (gloo),
the transformers engine; tests/rollout_script_worker.py is the script."""

from pathlib import Path

import pytest
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file

WORKER = str(Path(__file__).resolve().parent / "rollout_script_worker.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-process")
    return make_policy_dir(root), make_prompts_file(root)


def rows(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("async_rollout", ["0", "1"])
def test_rollout_process_waits_out_a_busy_trainer(files, tmp_path, async_rollout):
    """Trainer 0 spends 15 s between steps, the run's collective timeout is 12 s: the rollout process waits for its
    next command as long as trainer 0 lives (it ended the run at 12 s before), the run finishes, both exit 0 — with
    a batch in flight meanwhile too (async)."""
    policy, prompts = files
    run = tmp_path / "run"
    accelerate_launch([WORKER, str(policy), str(prompts), str(run), "pause", async_rollout], tmp_path / "logs",
                      processes=2, timeout=600)
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert (run / "policy" / "model.safetensors").is_file()


@pytest.mark.parametrize("async_rollout", ["0", "1"])
def test_script_that_ends_after_step_stops_the_rollout_processes(files, tmp_path, async_rollout):
    """A script takes one ``step()`` and ends without ``finish()``: trainer 0 tells the rollout process to stop as
    its interpreter exits (the rollout process failed on the closed connection before, and the launch with it);
    the launch exits 0. Async: the batch requested for step 2 is collected first, so every message is matched."""
    policy, prompts = files
    run = tmp_path / "run"
    accelerate_launch([WORKER, str(policy), str(prompts), str(run), "step_and_exit", async_rollout],
                      tmp_path / "logs", processes=2, timeout=600)
    assert [r["step"] for r in rows(run)] == [1]
