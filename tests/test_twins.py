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
