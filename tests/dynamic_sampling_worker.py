"""``python dynamic_sampling_worker.py POLICY PROMPTS OUT_DIR STEPS`` under ``accelerate launch --num_processes 2``:
PPO with ``--filter-groups`` and ``--curriculum`` on the tiny models, stepped one step at a time; each process writes
``OUT_DIR/rank_R.json``: the prompts it drew in every step (all rounds, one entry per group), the prompts of the
groups it trained on, the stream's prompts (the table's indices) and the curriculum's table at the end. Used by tests/test_dynamic_sampling_fixes.py."""

import json
import sys
from pathlib import Path

import dynamic_sampling_rules as rules
from difficulty_rules import K
from tiny import tiny_config

from tether.ppo.train import PPOTrainer


def main(policy: str, prompts: str, out: str, steps: str) -> None:
    cfg = tiny_config(Path(out), Path(policy), Path(prompts), steps=int(steps), save_every=0, batch_size=4,
                      samples_per_prompt=K, advantage__estimator="grpo", ppo__mini_batches=2,
                      generation__max_new_tokens=4, difficulty__filter_groups=True, difficulty__max_rounds=2,
                      difficulty__curriculum=True, difficulty__memory=10, eval__every=0, data__eval_fraction=0.0,
                      reward__sources=["dynamic_sampling_rules:logged_flat_for_even"])
    trainer = PPOTrainer(cfg)
    drawn, trained = [], []
    while trainer.steps_done < cfg.steps:
        before = len(rules.SEEN)  # the reward sees every round's rows: the step's draws
        trainer.step()
        drawn.append(rules.SEEN[before::K])
        trained.append(LAST_KEPT.pop())
    rank = trainer.run.processes.rank
    visits = trainer.run.data.prompts.curriculum.visits
    rows = [row["prompt"] for row in trainer.run.data.prompts.rows]  # the table's indices are into these
    Path(out, f"rank_{rank}.json").write_text(json.dumps({"drawn": drawn, "trained": trained, "rows": rows,
                                                          "visits": {str(k): v for k, v in visits.items()}}))
    trainer.finish()


LAST_KEPT: list[list[str]] = []


def _record_kept() -> None:
    """Wrap tether.ppo.step's draw so that the prompts of the groups a step trains on are kept."""
    import tether.ppo.step as step

    draw = step.draw_step_batch

    def recording(run, cfg, timer, sample):
        batch = draw(run, cfg, timer, sample)
        LAST_KEPT.append([row["prompt"] for row, kept in zip(batch.rows[::K], batch.kept[::K]) if kept])
        return batch

    step.draw_step_batch = recording


if __name__ == "__main__":
    _record_kept()
    main(*sys.argv[1:])
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP: no interpreter teardown (#32)
