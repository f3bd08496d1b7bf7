"""Calling user rules (SPEC B4, B16; #38 item 5, #42 item 3): a bad row costs the row, never the run. A number is
the score; TRL's None ("does not apply") is NaN and leaves the row to the other sources; a string, a list or an
exception on one row is NaN with its reason; a wrong-length result, a result that is not a list, or a failure on
every row is a one-line error naming the rule."""

import math

import pytest
import torch

from tether.errors import TetherError
from tether.rules.calls import call_rule
from tether.ppo.sources import RuleSource, judged_sum, score_responses


def trl_style(prompts, completions, **kwargs):
    """A TRL reward function: None for the prompts it does not judge (here, those not about apples)."""
    return [None if "apple" not in p else float(len(c)) for p, c in zip(prompts, completions)]


def test_none_is_nan_and_not_applicable_not_an_error():
    errors, not_applicable = {}, set()
    scores = call_rule(trl_style, ["2 apples", "a pear", "apple pie"], ["abc", "de", ""], {}, errors=errors,
                       not_applicable=not_applicable)
    assert scores[0].item() == 3.0 and math.isnan(scores[1].item()) and scores[2].item() == 0.0
    assert not_applicable == {1} and errors == {}


def test_a_rule_that_returns_none_on_every_row_is_not_a_bug_of_the_rule():
    not_applicable = set()
    scores = call_rule(trl_style, ["a pear", "a fig"], ["x", "y"], {}, not_applicable=not_applicable)
    assert torch.isnan(scores).all() and not_applicable == {0, 1}  # the step drops the rows; no error here


def messy(prompts, responses):
    """Row kinds by prompt: 'raise' raises, 'str' returns a string, 'list' a list, 'nan' NaN, 'bool' True."""
    if "raise" in prompts:
        raise ValueError("cannot parse this reply")
    return [{"str": "n/a", "list": [1.0], "nan": math.nan, "bool": True}.get(p, 0.5) for p in prompts]


def test_garbage_on_a_row_is_nan_with_its_reason_and_the_other_rows_are_scored():
    errors, not_applicable = {}, set()
    scores = call_rule(messy, ["ok", "raise", "str", "list", "nan", "bool"], [""] * 6, {}, errors=errors,
                       not_applicable=not_applicable)
    assert scores[0].item() == 0.5 and scores[5].item() == 1.0
    assert all(math.isnan(scores[i].item()) for i in (1, 2, 3, 4))
    assert errors == {1: "raised ValueError: cannot parse this reply", 2: "returned 'n/a' (str), not a number",
                      3: "returned [1.0] (list), not a number"}  # NaN itself is a value: B16 drops it, no reason
    assert not_applicable == set()


@pytest.mark.parametrize("fn, message", [
    (lambda p, r: [1.0] * (len(r) + 1), "rule <lambda>: returned 3 scores for 2 responses"),
    (lambda p, r: 3.0, "rule <lambda>: returned float, not a list of numbers"),
    (lambda p, r: ["x"] * len(r), "rule <lambda>: returned 'x' (str), not a number on every response"),
    (lambda p, r: 1 / 0, "rule <lambda>: raised on every response (ZeroDivisionError: division by zero)"),
])
def test_what_cannot_be_one_rows_fault_is_a_one_line_error_naming_the_rule(fn, message):
    with pytest.raises(TetherError) as raised:
        call_rule(fn, ["a", "b"], ["", ""], {})
    assert str(raised.value) == message


def test_a_wrong_length_on_a_row_by_row_call_is_the_same_one_line_error():
    def breaks_on_batches_and_rows(prompts, responses):
        if len(prompts) > 1:
            raise RuntimeError("batch")
        return []

    with pytest.raises(TetherError, match="^rule breaks_on_batches_and_rows: returned 0 scores for 1 responses$"):
        call_rule(breaks_on_batches_and_rows, ["a", "b"], ["", ""], {})


def test_sources_sum_as_trl_nansum_a_row_no_source_judged_is_nan():
    """By hand: row 0 (apples) 2.0 + 0.5 = 2.5; row 1 (pear) only the constant 0.5; with the TRL-style rule alone,
    row 1 is NaN (no source judged it: dropped, B16)."""
    constant = RuleSource("python:constant", lambda prompts, responses: [0.5] * len(responses))
    apples = RuleSource("python:apples", trl_style)
    both = score_responses([apples, constant], ["2 apples", "a pear"], ["ab", "cde"], {})
    assert both.tolist() == [2.5, 0.5]
    alone = score_responses([apples], ["2 apples", "a pear"], ["ab", "cde"], {})
    assert alone[0].item() == 2.0 and math.isnan(alone[1].item())


def test_judged_sum_by_hand():
    a, b = torch.tensor([1.0, math.nan, 3.0]), torch.tensor([10.0, 20.0, math.nan])
    out = judged_sum([(a, {1}), (b, {2})], 3)
    assert out.tolist() == [11.0, 20.0, 3.0]
    out = judged_sum([(a, {1}), (b, {1, 2})], 3)
    assert out[0].item() == 11.0 and math.isnan(out[1].item()) and out[2].item() == 3.0
    assert judged_sum([(a, {1})], 3, all_judged=True)[1].item() == 0.0  # a per-step PRM judged the row
    assert math.isnan(judged_sum([(torch.tensor([math.nan]), set())], 1)[0].item())  # a real NaN stays NaN
