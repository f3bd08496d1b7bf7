"""Tasks from reasoning-gym (tether.tasks): the final answer read out of free-text replies, task names, the
package's own verifier as reward and gold rule, held-out rows never trained on."""

import pytest

from tether.errors import ConfigError
from tether.tasks import final_answer, parse_task, reasoning_gym_correct, reasoning_gym_score, split_rows, task_rows

TASK = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1"


@pytest.mark.parametrize("reply, answer", [
    ("3 + 4 = 7. The answer is 7.", "7"),
    ("The answer is -5", "-5"),
    ("The answer to the given arithmetic problem is 4.", "4"),
    ("The answer. It is 4, so the answer is 5.", "5"),
    ("This is hard. Answer: 3", "3"),
    ("First, 2+2=4.\nSo the answer is **12**.", "12"),
    ("<answer> nus </answer>", "nus"),
    ("blah <answer>1</answer> then <answer>2</answer>", "2"),
    ("Answer: cat, dog", "cat, dog"),
    ("Let me think.\n\n42", "42"),
    ("", ""),
])
def test_final_answer_by_hand(reply, answer):
    assert final_answer(reply) == answer


def test_task_names():
    assert parse_task(TASK) == ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    assert parse_task("rg:word_sorting") == ("word_sorting", {})
    for bad in ("chain_sum", "rg:", "rg:x:min_terms"):
        with pytest.raises(ConfigError, match="task"):
            parse_task(bad)
    with pytest.raises(ConfigError, match="reasoning-gym refused it"):
        task_rows("rg:chain_sum:no_such_knob=3", 2, 0)


def test_the_package_verifier_scores_the_final_answer():
    rows = task_rows(TASK, 4, seed=0)
    cols = {k: [r[k] for r in rows] for k in ("answer", "rg_task", "rg_metadata")}
    prompts = [r["prompt"] for r in rows]
    right = [f"Let me add. The answer is {r['answer']}." for r in rows]
    wrong = [f"The answer is {int(r['answer']) + 1}." for r in rows]
    assert reasoning_gym_score(prompts, right, **cols) == [1.0] * 4
    assert reasoning_gym_score(prompts, wrong, **cols) == [0.0] * 4
    assert reasoning_gym_score(prompts, right, ended_with_eos=[True, False, True, True], **cols) == [1, 0, 1, 1]
    assert reasoning_gym_correct(prompts, right, **cols) == [1.0] * 4
    # the package's partial credit (the gold inside a longer answer) is a reward, never "correct"
    padded = [f"The answer is {r['answer']}0000" for r in rows]
    scores = reasoning_gym_score(prompts, padded, **cols)
    assert all(0 < s < 1 for s in scores) and reasoning_gym_correct(prompts, padded, **cols) == [0.0] * 4


def test_held_out_rows_are_never_training_rows():
    train, held_out = split_rows(TASK, 200, 60, seed=3)  # ~190 distinct problems in all: training gets the rest
    assert len(held_out) == 60 and 60 <= len(train) < 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in held_out}) == 60 and len({r["prompt"] for r in train}) == len(train)
    assert split_rows(TASK, 200, 60, seed=3) == (train, held_out)  # seeded
    big_train, big_held_out = split_rows("rg:chain_sum:min_terms=3,max_terms=3,min_digits=2,max_digits=2", 300, 50)
    assert len(big_train) == 300 and len(big_held_out) == 50


def test_a_task_as_prompts_gives_its_held_out_split_and_its_own_gold_rule():
    """--prompts rg:DATASET: the run's training and held-out rows are the task's distinct split (the same held-out
    problems for any run seed), and --gold auto is the task's own check, not the math rule."""
    from tether.ppo.config import RunConfig
    from tether.ppo.setup import load_prompt_sets, resolve_gold

    name = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1"
    rows = {}
    for seed in (0, 1):
        cfg = RunConfig()
        cfg.seed, cfg.data.prompts, cfg.data.task_train, cfg.data.task_eval = seed, name, 40, 30
        rows[seed] = load_prompt_sets(cfg)
    train, held_out = rows[0]
    assert len(held_out) == 30 and 0 < len(train) <= 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert [r["prompt"] for r in rows[1][1]] == [r["prompt"] for r in held_out]  # not the run seed's
    gold = resolve_gold("auto", held_out)
    assert gold is reasoning_gym_correct
    first = held_out[0]
    verdicts = gold([first["prompt"]] * 2, [f"The answer is {first['answer']}.", "The answer is -1."],
                    **{k: [first[k]] * 2 for k in ("answer", "rg_task", "rg_metadata")})
    assert verdicts == [1.0, 0.0]
