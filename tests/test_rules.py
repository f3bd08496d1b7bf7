"""The shipped math rules (SPEC B4): numbers parsed as people write them, which number is the answer, the
format bonus only for a final single statement, truncated replies never credited, and ``ended_with_eos``
threaded from the rollout to every rule call. Real GSM8K and SVAMP answers are read from ../shared/data."""

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tether.errors import TetherError
from tether.ppo.sources import RuleSource, call_rule, score_responses
from tether.rules import extract_answer, gold_integer, gold_number, math_answer, math_correct

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k").is_dir() or not (DATA / "svamp").is_dir(),
                                reason=f"real GSM8K/SVAMP data not found at {DATA} (CI has it)")


@pytest.mark.parametrize("text, expected", [
    ("The answer is $18.00", 18),            # the example: decimals equal to an integer
    ("It costs 18.00 dollars.", 18),
    ("Half: 0.5", Fraction(1, 2)),
    ("Half: .5", Fraction(1, 2)),
    ("She saved 1,234 coins", 1234),        # thousands separators
    ("A total of $1,600.50.", Fraction(3201, 2)),
    ("He pays $18", 18),                     # currency
    ("The change is -$5", -5),
    ("The change is $-5", -5),
    ("It fell to -7 degrees", -7),
    ("It fell to \u22127 degrees", -7),     # the Unicode minus sign
    ("Prices of \u20ac12 and \u00a33", 3),
    ("18 dollars.", 18),                     # trailing units and punctuation
    ("That is 18%.", 18),                   # a percentage reads as its number, as GSM8K gold answers do
    ("Read pages 10-12", 12),               # a hyphen after a digit is not a minus sign
    ("Let x-5", 5),
    ("We get 18,50", 50),                   # no decimal commas: 18 and 50
    ("It is 3/4", 4),                       # no fractions: 3 and 4
    ("A: 18", 18),                          # the last number, as the example model solutions end
    ("9 * 2 = <<9*2=18>>18 every day", 18),
    ("Eighteen", None),
    ("", None),
])
def test_numbers_parsed_as_people_write_them(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{18}", 18),
    ("3 + 15 = \\boxed{18}, so 20 minus 2", 18),           # the box beats the last number
    ("The answer is 20. \\boxed{18}", 18),                 # ... and "The answer is"
    ("\\boxed{17} then \\boxed{18}", 18),                  # the last box
    ("\\boxed{1{,}600}", 1600),                            # LaTeX thousands
    ("\\boxed{1\\,600}", 1600),
    ("\\boxed{\\$18.00}", 18),
    ("\\boxed{\\text{18 dollars}}", 18),                   # braces nested in the box
    ("\\boxed{6 \\times 3 = 18}", 18),                     # the last number in the box
    ("12 apples, \\boxed{x}", None),                       # a box with no number is no answer
    ("The answer is 18. Check: 3 * 6 = 18, plus 2 is 20", 18),  # first number after the marker
    ("The answer is 17. No: the answer is 18 apples", 18),      # the last marker
    ("The final answer is $18.00.", 18),
    ("Work: 5 + 13\n#### 18", 18),
    ("3 * 6 = 18. The answer is eighteen.", 18),           # no number after the marker: the last number
])
def test_which_number_is_the_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("gold, expected", [
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18", 18),
    ("#### 1,600", 1600), ("1,234", 1234), ("18.00", 18), (18.0, 18), (51, 51), ("-3", -3), (0.5, Fraction(1, 2)),
    (None, None), ("None", None), (float("nan"), None), (True, None),
])
def test_gold_number(gold, expected):
    assert gold_number(gold) == expected


def test_gold_integer_keeps_whole_numbers_only():
    assert gold_integer("#### 1,600") == 1600 and gold_integer(51.0) == 51 and gold_integer("2.5") is None


@pytest.mark.parametrize("response, expected", [
    ("So she makes 9 * 2 = 18. The answer is 18.", 1.1),
    ("The answer is $18.00.", 1.1),
    ("The answer is 18 dollars.", 1.1),
    ("**The answer is 18.**", 1.1),
    ("The answer is: 18", 1.1),
    ("The final answer is 18!", 1.1),
    ("She makes 9 * 2 = $18 every day.\n#### 18", 1.1),
    ("\\boxed{18} The answer is 18.", 1.1),
    ("The answer is 17.", 0.1),                             # the bonus pays format, not correctness
    ("18", 1.0),                                            # right, but no statement
    ("The answer is 18.\nThe answer is 18.", 1.0),          # repeated: no bonus
    ("The answer is 18. The answer is 18. The answer is 18.", 1.0),
    ("The answer is 18. Because 3 * 6 = 18.", 1.0),         # not at the end
    ("The answer is 18 or 19.", 1.0),                       # hedged: the first number counts, no bonus
    ("The answer is 18 apples because 3 times 6", 1.0),
    ("Total: 18 #### 18", 1.0),                             # "####" only at the start of a line
    ("\\boxed{17} The answer is 18.", 0.0),                 # the statement contradicts the box
    ("The answer is", 0.0),
    ("", 0.0),
])
def test_format_bonus_only_for_one_final_statement(response, expected):
    assert math_answer([""], [response], ["18"], ended_with_eos=[True]) == [pytest.approx(expected)]


def test_truncated_replies_are_never_credited():
    responses = ["The answer is 18.", "9 * 2 = 18", "The answer is 18.", "9 * 2 = 18"]
    ended = [True, True, False, False]
    assert math_answer([""] * 4, responses, ["18"] * 4, ended_with_eos=ended) == pytest.approx([1.1, 1.0, 0, 0])
    assert math_correct([""] * 4, responses, ["18"] * 4, ended_with_eos=ended) == [1.0, 1.0, 0.0, 0.0]
    # the flags may come as the rollout's (B,) bool tensor
    assert math_correct([""] * 2, responses[:2], ["18"] * 2, ended_with_eos=torch.tensor([False, True])) == [0, 1]


def test_without_ended_with_eos_every_reply_counts_as_ended():
    assert math_answer([""], ["The answer is 18."], ["18"]) == [pytest.approx(1.1)]
    assert math_correct([""], ["18"], [18.0]) == [1.0]


def test_format_bonus_is_configurable():
    assert math_answer([""], ["The answer is 18."], ["18"], format_bonus=0.0) == [1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"answer": ["18"]}, "math_answer: 2 responses but 1 answers"),
    ({"answer": ["18", "18"], "ended_with_eos": [True]}, "math_answer: 2 responses but 1 ended_with_eos flags"),
    ({}, "math_answer: the prompt rows have no 'answer' column (GSM8K, SVAMP, or add one)"),
])
def test_mismatched_columns_are_one_line_errors(kwargs, message):
    with pytest.raises(TetherError, match=f"^{re.escape(message)}$"):
        math_answer(["", ""], ["18", "18"], **kwargs)


def test_call_rule_passes_ended_with_eos_only_to_rules_that_take_it():
    seen = {}

    def with_kwargs(prompts, responses, **fields):
        seen.update(fields)
        return [0.0] * len(responses)

    def without(prompts, responses, answer):  # an older rule: never sees the reserved keyword
        return [float(a == r) for a, r in zip(answer, responses)]

    fields = {"answer": ["18", "5"]}
    eos = torch.tensor([True, False])
    assert call_rule(without, ["", ""], ["18", "5"], fields, eos).tolist() == [1.0, 1.0]
    call_rule(with_kwargs, ["", ""], ["18", "5"], fields, eos)
    assert seen == {"answer": ["18", "5"], "ended_with_eos": [True, False]}
    seen.clear()
    call_rule(with_kwargs, ["", ""], ["18", "5"], fields)  # not given: not invented
    assert seen == {"answer": ["18", "5"]}
    scores = call_rule(math_answer, ["", ""], ["The answer is 18.", "The answer is 5."], {"answer": ["18", "5"]},
                       eos)
    assert scores.tolist() == pytest.approx([1.1, 0.0])


def test_score_responses_threads_ended_with_eos_through_rule_arguments():
    source = RuleSource("tether.rules:math_answer:format_bonus=0.5")  # the key=value wrapper passes it on
    responses = ["The answer is 18.", "The answer is 18."]
    scores = score_responses([source], ["", ""], responses, {"answer": ["18", "18"]}, torch.tensor([True, False]))
    assert scores.tolist() == [1.5, 0.0]


def test_a_prompt_column_named_ended_with_eos_is_refused():
    with pytest.raises(TetherError, match="^prompt rows have a column 'ended_with_eos': tether reserves"):
        call_rule(math_answer, [""], ["18"], {"answer": ["18"], "ended_with_eos": [True]}, [True])


# --- real data --------------------------------------------------------------------------------------------

SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


@needs_data
def test_agrees_with_the_is_correct_flags_of_real_model_solutions():
    """OpenAI's 4 × 1,319 GSM8K test solutions end "A: N" and carry ``is_correct``. Measured: our verdict
    agrees on all 5,276. The last-integer rule this replaced agreed on 5,265: its 11 disagreements were all
    decimal answers read by their last digits ("A: 7.5" credited for gold 5, "A: 4.32" for 32, "A: 3.8"
    for 8), which this rule reads as 7.5, 4.32 and 3.8."""
    gold = {}
    for line in (DATA / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        gold[row["question"]] = row["answer"]  # the raw "… #### N" field, commas included
    agree = total = decimal_wrong = 0
    for line in (DATA / "gsm8k" / "example_model_solutions.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for solver in SOLVERS:
            solution, is_correct = row[solver]["solution"], row[solver]["is_correct"]
            verdict = math_correct([row["question"]], [solution], [gold[row["question"]]])[0] == 1.0
            agree += verdict == is_correct
            total += 1
            answer = extract_answer(solution)
            decimal_wrong += answer is not None and answer.denominator != 1 and not is_correct
    assert total == 5276
    assert agree == total
    assert decimal_wrong >= 11  # the cases that tell this rule from the last-integer one are in the data


@needs_data
def test_gsm8k_worked_solutions_earn_the_point_and_the_bonus():
    from tether.ppo.prompts import load_prompts

    rows = load_prompts(str(DATA / "gsm8k" / "test.jsonl")) + load_prompts(str(DATA / "gsm8k" / "train.jsonl"))
    solutions, answers = [r["solution"] for r in rows], [r["answer"] for r in rows]
    assert sum("," in s.rsplit("####", 1)[1] for s in solutions) > 50  # "#### 1,600" answers are among them
    scores = math_answer(None, solutions, answers, ended_with_eos=[True] * len(rows))
    # every one is right; 4 of the 8,792 also say "the answer is N" above their "#### N": stated twice, no bonus
    twice = ["the answer is" in s.lower() or "the final answer is" in s.lower() for s in solutions]
    assert sum(twice) == 4
    assert scores == [pytest.approx(1.0 if t else 1.1) for t in twice]
    # the same solutions cut before their "#### N" line, as max_new_tokens would: the last number of most
    # already equals the gold answer (measured: 1,283 of the 1,319 test ones), yet a cut reply earns nothing
    cut = [s.rsplit("####", 1)[0] for s in solutions]
    assert sum(math_correct(None, cut, answers)) > 0.9 * len(rows)
    assert set(math_answer(None, cut, answers, ended_with_eos=[False] * len(rows))) == {0.0}


@needs_data
def test_svamp_answers_and_equations():
    from tether.ppo.prompts import load_prompts

    raw = json.loads((DATA / "svamp" / "SVAMP.json").read_text(encoding="utf-8"))
    rows = load_prompts(str(DATA / "svamp" / "SVAMP.json"))
    assert len(rows) == len(raw) == 1000
    assert [gold_number(item["Answer"]) for item in raw] == [Fraction(r["answer"]) for r in rows]
    # a reply in the data's own notation: "( 76.0 - 25.0 ) = 51.0. The answer is 51.0."
    replies = [f"{item['Equation'].strip()} = {item['Answer']}. The answer is {item['Answer']}." for item in raw]
    answers = [r["answer"] for r in rows]
    assert math_answer(None, replies, answers, ended_with_eos=[True] * 1000) == [pytest.approx(1.1)] * 1000
    wrong = [f"The answer is {item['Answer'] + 0.5}." for item in raw]  # 51.5 is not 51
    assert math_answer(None, wrong, answers, ended_with_eos=[True] * 1000) == [pytest.approx(0.1)] * 1000
    money = [f"The answer is ${item['Answer']:,.2f}." for item in raw]  # "$1,234.00"
    assert math_correct(None, money, answers) == [1.0] * 1000


# --- ended_with_eos from the rollout ----------------------------------------------------------------------

def test_training_and_evaluation_pass_the_rollouts_eos_flags_to_rules(tmp_path, monkeypatch):
    """ppo_step (step 5) and evaluate hand every rule the flags of the rollout they score; evaluate's
    eval/accuracy and per-sample "correct" come from the gold rule called with them."""
    from tiny import make_policy_dir, make_prompts_file, tiny_config

    import tether.ppo.evaluate as evaluate_module
    import tether.ppo.step as ppo_module
    from tether.ppo.evaluate import evaluate
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    cfg = tiny_config(tmp_path, make_policy_dir(tmp_path), make_prompts_file(tmp_path), steps=1, eval__n=8,
                      eval__greedy=False, data__eval_fraction=0.25, generation__max_new_tokens=4)
    c = setup(cfg)
    rollouts, rule_flags = [], []

    original = ppo_module.rollout_batch

    def recording_rollout(*args, **kwargs):
        batch, texts = original(*args, **kwargs)
        rollouts.append(batch.ended_with_eos.tolist())
        return batch, texts

    monkeypatch.setattr(ppo_module, "rollout_batch", recording_rollout)
    monkeypatch.setattr(evaluate_module, "rollout_batch", recording_rollout)

    def rule(prompts, responses, **fields):
        rule_flags.append(fields["ended_with_eos"])
        return [float(e) for e in fields["ended_with_eos"]]  # "correct" exactly when ended

    c.data.sources, c.data.gold = [RuleSource("tether.rules:char_share")], rule
    c.data.sources[0].fn = rule
    metrics, samples = evaluate(c, cfg, 0)
    assert rule_flags == [rollouts[0], rollouts[0]]  # the reward source, then the gold rule
    assert [s["correct"] for s in samples] == [not s["truncated"] for s in samples] == rollouts[0]
    assert metrics["eval/accuracy"] == pytest.approx(sum(rollouts[0]) / len(rollouts[0]))
    assert metrics["eval/correct"] == "".join("1" if e else "0" for e in rollouts[0])  # per problem, in order
    ppo_step(c, cfg, 1)
    assert rule_flags[2] == rollouts[1] and len(rule_flags) == 3
    assert {True, False} <= set(rollouts[0] + rollouts[1])  # seeded: both kinds of reply occur


# --- math-verify as a backend (#42 item 7) -----------------------------------------------------------------

def test_math_verify_correct_by_hand():
    pytest.importorskip("math_verify", reason="pip install 'tether[math-verify]' (the [test] extra has it)")
    from tether.rules import math_verify_correct

    responses = ["The answer is 18.", "So \\boxed{1,600} in all.", "The answer is 17.", "18", "The answer is 18.",
                 "The answer is 18."]
    answers = ["18", "1600", "18", "#### 18", "n/a", "18"]
    eos = [True, True, True, True, True, False]
    # right, right (boxed, LaTeX thousands), wrong, right (a GSM8K "#### N" gold), no verdict (the gold does not
    # parse: TRL's None), truncated (0, as math_correct)
    assert math_verify_correct(None, responses, answers, ended_with_eos=eos) == [1.0, 1.0, 0.0, 1.0, None, 0.0]
    assert math_correct(None, responses, answers, ended_with_eos=eos) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_math_verify_reads_the_word_answer_as_its_anchor_and_tether_does_not():
    """The disagreement measured on GSM8K's own solutions (docs/real-models.md): math-verify takes the number after
    any "answer…" — "answered 200 calls" — as the reply's answer; tether reads the final "#### N"."""
    pytest.importorskip("math_verify", reason="pip install 'tether[math-verify]' (the [test] extra has it)")
    from tether.rules import math_verify_correct

    reply = "She answered 200 calls over 5 days, so 200/5 = <<200/5=40>>40 calls a day\n#### 40"
    assert math_correct(None, [reply], ["40"]) == [1.0]
    assert math_verify_correct(None, [reply], ["40"]) == [0.0]


def test_math_verify_missing_is_one_line_saying_how_to_install(monkeypatch):
    import sys

    from tether.rules import math_verify_correct

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(TetherError, match=r"^tether.rules:math_verify_correct needs Hugging Face's math-verify, "
                                          r"which is not installed: pip install 'tether\[math-verify\]'"):
        math_verify_correct(None, ["18"], ["18"])


def test_a_gold_rule_that_cannot_run_stops_the_run_at_setup_naming_gold(tmp_path, monkeypatch):
    """A shipped rule on an optional package is checked when loaded, before any file is written: math-verify
    missing is one line naming --gold at setup, not an error at the first evaluation."""
    import sys

    from tiny import make_policy_dir, make_prompts_file, tiny_config

    from tether.ppo.setup import setup

    monkeypatch.setitem(sys.modules, "math_verify", None)
    cfg = tiny_config(tmp_path, make_policy_dir(tmp_path), make_prompts_file(tmp_path),
                      reward__gold="tether.rules:math_verify_correct")
    with pytest.raises(TetherError, match=r"^--gold tether.rules:math_verify_correct: tether.rules:math_verify_correct "
                                          r"needs Hugging Face's math-verify"):
        setup(cfg)
    assert not (tmp_path / "run").exists()
