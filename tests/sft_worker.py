"""An SFT run from Python under ``accelerate launch --num_processes 2``: ``python sft_worker.py MODEL DATA OUT
STOP_AT RESUME``. Only the main process's callback stops the run (at step STOP_AT; 0 = never): the main process's
decision must reach the other, and the checkpoint it writes must resume exactly (``RESUME`` 1). Used by
tests/test_sft_fsdp.py."""

import os
import sys
from pathlib import Path

import tether


class MainStops(tether.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, record):
        if record.step == self.step and os.environ.get("RANK", "0") == "0":
            raise tether.StopTraining(f"the main process stops at {self.step}")


if __name__ == "__main__":
    model, data, out = sys.argv[1:4]
    stop_at, resume = int(sys.argv[4]), sys.argv[5] == "1"
    config = {"model": {"path": model}, "data": {"files": [data], "eval_fraction": 0.0}, "output_dir": out,
              "progress": False, "save_every_minutes": 0,
              "optim": {"max_steps": 4, "batch_size": 3, "lr": 1e-3}}
    result = tether.SFTTrainer(config, callbacks=[MainStops(stop_at)] if stop_at else [], resume=resume).train()
    assert result.steps == (stop_at or 4), result
    from tether.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
