"""A PPO run from Python under ``accelerate launch --num_processes 2``: ``python trainer_worker.py POLICY PROMPTS OUT``.

Only the main process's callback stops the run (at step 2 of 4), and every process adds a custom metric: the main
process's decision must reach the other (a broadcast), or it would wait in a collective the main one has left.
Used by tests/test_trainers.py.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import tiny_config  # noqa: E402

import tether  # noqa: E402


class MainStops(tether.Callback):
    def on_step_end(self, record):
        if record.step == 2 and os.environ.get("RANK", "0") == "0":
            raise tether.StopTraining("the main process says stop")
        return {"custom/rank_seen": float(os.environ.get("RANK", "0"))}


if __name__ == "__main__":
    policy, prompts, out = (Path(a) for a in sys.argv[1:4])
    cfg = tiny_config(out, policy, prompts, steps=4, batch_size=4)
    result = tether.PPOTrainer(cfg, reward=lambda prompts, responses, **_: [float(len(r)) for r in responses],
                               callbacks=MainStops()).train()
    assert result.steps == 2 and result.stopped == "the main process says stop", result
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
