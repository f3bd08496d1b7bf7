"""A Python script that drives a disaggregated run (1 trainer + 1 rollout process) through ``PPOTrainer``, as a user's
script would, for tests/test_rollout_process.py:

  accelerate launch --num_processes 2 rollout_script_worker.py POLICY PROMPTS RUN_DIR MODE [ASYNC]

MODE ``pause``: train 2 steps with a callback that keeps trainer 0 busy for 15 s after step 1 (a slow checkpoint or
export, a script's own work between steps), longer than the 12 s collective timeout the run is given.
MODE ``step_and_exit``: take one ``step()``, evaluate on every trainer (``PPOTrainer.evaluate`` is collective with
rollout processes) and end the script without ``finish()``/``train()``.
ASYNC: ``--async-rollout`` (default 0).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import tiny_config  # noqa: E402

import tether  # noqa: E402


class Pause(tether.Callback):
    def on_step_end(self, record):
        if record.step == 1:
            time.sleep(15)


def main(policy: str, prompts: str, run_dir: str, mode: str, async_rollout: str = "0") -> None:
    overrides = dict(generation__rollout_processes=1, collective_timeout_minutes=0.2, steps=2, batch_size=4,
                     save_every_minutes=0.0, data__eval_fraction=0.25, eval__n=4)
    if async_rollout != "0":
        overrides["generation__async_rollout"] = int(async_rollout)
    cfg = tiny_config(Path(run_dir), Path(policy), Path(prompts), **overrides)
    cfg.output_dir = run_dir
    trainer = tether.PPOTrainer(cfg, callbacks=[Pause()] if mode == "pause" else ())
    if trainer.is_rollout_process:  # it served the trainer until it stopped: nothing of its own to do
        return
    if mode == "pause":
        trainer.train()
    else:
        trainer.step()
        metrics = trainer.evaluate()  # every trainer calls it: evaluation asks the rollout processes
        assert metrics["eval/n"] == 4 if trainer.run.processes.is_main else metrics == {}, metrics
        # and the script ends here, without finish()


if __name__ == "__main__":
    main(*sys.argv[1:])
