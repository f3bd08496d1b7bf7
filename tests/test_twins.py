"""Held-out problems with a twin in training (tether/pipeline/twins.py) and `tether rlhf`'s twin-free gold
(tether/pipeline/results.py: twin_free), checked on problems written out by hand."""

import json

import pytest

from tether.core.stats import mcnemar_exact
from tether.pipeline.results import report_markdown, twin_free
from tether.pipeline.twins import select, twin_flags

TRAIN = [{"prompt": "What is 3 + 5?", "answer": "8"},
         {"prompt": "What is 3 - 5?", "answer": "-2"},
         {"prompt": [{"role": "user", "content": "Name 2 colours."}], "answer": "red, blue"}]
HELD = [{"prompt": "What is 5 + 3?", "answer": "8"},          # commuted: a twin
        {"prompt": "What is 5 - 3?", "answer": "2"},          # the same words, another answer: not a twin
        {"prompt": "what is 5 +3 ?", "answer": " 8 "},        # case, spacing: the same signature
        {"prompt": "What is 5 + 4?", "answer": "9"},          # another problem
        {"prompt": [{"role": "user", "content": "colours. 2 Name"}], "answer": "red, blue"}]


def test_twins_are_the_same_words_in_another_order_with_the_same_answer():
    assert twin_flags(TRAIN, HELD) == [True, False, True, False, True]
    assert twin_flags([], HELD) == [False] * 5
    assert twin_flags([{"prompt": "a b"}], [{"prompt": "b a"}, {"prompt": "b a", "answer": "x"}]) == [True, False]
    assert select("10110", [True, False, True, False, True]) == "110"


def test_twin_free_gold_pairs_each_arm_with_step_0_on_the_other_problems(tmp_path):
    for name, rows in (("train.jsonl", TRAIN), ("heldout.jsonl", HELD)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = "00100"           # step 0: right on problem 2 only (a twin)
    arms = {"beta0.04": {"0": {"evals": [{"step": 0, "correct": base}, {"step": 10, "correct": "11110"}]},
                         "1": {"evals": [{"step": 10, "correct": "11110"}, {"step": 20, "correct": "01011"}]}},
            "dpo": {"0": {"evals": [{"step": 91, "correct": "1111"}]}}}  # another length: not paired
    tf = twin_free(tmp_path, arms, base)
    assert (tf["n"], tf["twins"]) == (5, 3)
    # the two twin-free problems are 1 and 3: step 0 "00"; round 0 step 10 "11"; round 1 step 20 "11"
    assert tf["step0"]["accuracy"] == 0.0
    assert [(e["arm"], e["round"], e["step"], e["accuracy"], e["gained"], e["lost"]) for e in tf["evals"]] == \
        [("beta0.04", 0, 10, 1.0, 2, 0), ("beta0.04", 1, 20, 1.0, 2, 0)]
    assert tf["evals"][0]["p_vs_step0"] == pytest.approx(mcnemar_exact(2, 0)) == pytest.approx(0.5)
    results = {"arms": {}, "pairs": {}, "reward_models": {}, "twin_free": tf}
    assert "3 of the 5 held-out problems have a twin in training" in report_markdown(results)
    assert twin_free(tmp_path / "missing", arms, base) is None


def test_twins_apart_drops_the_training_problems_with_a_held_out_twin(tmp_path):
    """chain_sum of two one-digit terms (200 distinct problems): about a fifth of a random split's held-out additions
    have their commuted twin in training; --twins-apart drops exactly those training rows and no others."""
    from tether.pipeline.config import RLHFConfig
    from tether.pipeline.stages import prepare_task

    def split(apart: bool, d):
        cfg = RLHFConfig()
        cfg.task.prompts, cfg.ppo.eval_n, cfg.task.twins_apart = \
            "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1", 100, apart
        summary = prepare_task(cfg, d)
        return summary, [[json.loads(x) for x in (d / n).read_text().splitlines()] for n in ("train.jsonl",
                                                                                            "heldout.jsonl")]
    plain, (train, held) = split(False, tmp_path / "plain")
    apart, (train_apart, held_apart) = split(True, tmp_path / "apart")
    twins = plain["training_rows_with_a_held_out_twin"]
    # counted by hand: a training "a + b = " whose "b + a = " (a != b) is held out
    expressions = {json.loads(r["rg_metadata"])["expression"] for r in held}
    by_hand = sum(1 for r in train if (e := json.loads(r["rg_metadata"])["expression"]).count("+") == 1
                  and e.split(" + ")[0] != e.split(" + ")[1] and " + ".join(reversed(e.split(" + "))) in expressions)
    assert twins == by_hand > 5 and apart["training_rows_with_a_held_out_twin"] == twins
    assert apart["train"] == plain["train"] - twins and apart["twins_dropped"] and not plain["twins_dropped"]
    assert held_apart == held and len(train_apart) == len(train) - twins
    assert not any(twin_flags(train_apart, held_apart)) and [r for r in train if r in train_apart] == train_apart
