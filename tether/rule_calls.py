"""Calling a rule — user code — so that a bad row costs the row and not the run (SPEC B4, B16).

A rule is any callable ``f(prompts, responses, **fields) -> list`` (the prompt rows' other columns as keyword
lists; from PPO training and evaluation also the reserved ``ended_with_eos``). :func:`call_rule` turns what it
returns into (B,) float32 scores: a number as it is (NaN/Inf kept, B16 drops the row), None as NaN and "does not
apply" (TRL's reward-function convention), anything else — a string, a list, an exception on the row — as NaN with
the reason. Only what cannot be a row's fault stops the run, in one line naming the rule: a result that is not a
list or has the wrong length, or a failure on every row. Used for reward rules (:mod:`tether.ppo.sources`) and the
gold rule of evaluation (:mod:`tether.ppo.evaluate`).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch

from tether.errors import TetherError
from tether.rules import load_rule

EOS_FIELD = "ended_with_eos"


def with_eos_field(fields: dict[str, list], ended_with_eos=None) -> dict[str, list]:
    """``fields`` plus the reserved ``ended_with_eos`` list (bools, from a (B,) tensor or a list); ``fields``
    itself when ``ended_with_eos`` is None."""
    if ended_with_eos is None:
        return fields
    if EOS_FIELD in fields:
        raise TetherError(f"prompt rows have a column {EOS_FIELD!r}: tether reserves that name for rules "
                          f"(whether each response ended with EOS); rename the column")
    flags = ended_with_eos.tolist() if hasattr(ended_with_eos, "tolist") else list(ended_with_eos)
    return {**fields, EOS_FIELD: [bool(f) for f in flags]}


def _rule_name(fn) -> str:
    return getattr(fn, "__name__", str(fn))


NOT_APPLICABLE = "returned None (does not apply)"  # TRL's reward functions return None for rows they do not judge


def _rule_output(fn, out, n: int) -> list:
    """The rule's result as a list of ``n`` values; one that is not a list or has the wrong length is a one-line
    error (a bug in the rule, not in one row)."""
    try:
        out = list(out)
    except TypeError:
        raise TetherError(f"rule {_rule_name(fn)}: returned {type(out).__name__}, not a list of numbers") from None
    if len(out) != n:
        raise TetherError(f"rule {_rule_name(fn)}: returned {len(out)} scores for {n} responses")
    return out


class _Raised:
    """What a rule raised on one row, as ``raised ExcType: message``."""

    def __init__(self, e: Exception):
        self.text = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _row_value(v) -> tuple[float, str | None]:
    """One row's score and what was wrong with it: a number as it is (NaN/Inf kept: B16 drops the row), None as
    NaN and :data:`NOT_APPLICABLE`, anything else (a string, a list, an exception) as NaN and its description."""
    if isinstance(v, _Raised):
        return math.nan, v.text
    if v is None:
        return math.nan, NOT_APPLICABLE
    if not isinstance(v, (str, bytes)):
        try:
            return float(v), None
        except (TypeError, ValueError):
            pass
    return math.nan, f"returned {v!r:.40} ({type(v).__name__}), not a number"


def call_rule(fn: Callable, prompts: list[str], responses: list[str], fields: dict[str, list],
              ended_with_eos=None, errors: dict | None = None, not_applicable: set | None = None) -> torch.Tensor:
    """Call a rule with the prompt rows' other columns as keyword lists, plus ``ended_with_eos`` when given
    (only the keywords it accepts, unless it takes ``**fields``); (B,) float32 scores, one per response.

    Bad rows cost the row, not the run (B16): a rule that raises on the batch is called again row by row; a row
    it still raises on, or whose value is not a number (a string, a list), scores NaN and goes into ``errors``
    (``{row: "raised ExcType: message"}``); None — TRL's "does not apply" — scores NaN and goes into
    ``not_applicable``; NaN/Inf are returned as they are. One-line errors, a bug in the rule: a result that is not
    a list or has the wrong length, or a failure on every row."""
    fields = with_eos_field(fields, ended_with_eos)
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    try:
        rows = _rule_output(fn, fn(prompts, responses, **fields), len(responses))
    except TetherError:
        raise
    except Exception:  # noqa: BLE001 - a rule is user code: isolate the rows it fails on
        rows = [_one_row(fn, prompts, responses, fields, i) for i in range(len(responses))]
    values, failed = [], {}
    for i, v in enumerate(rows):
        value, problem = _row_value(v)
        values.append(value)
        if problem == NOT_APPLICABLE:
            if not_applicable is not None:
                not_applicable.add(i)
        elif problem:
            failed[i] = problem
    if failed and len(failed) == len(responses):
        first = failed[0]
        raise TetherError(f"rule {_rule_name(fn)}: raised on every response ({first[len('raised '):]})"
                          if first.startswith("raised ") else f"rule {_rule_name(fn)}: {first} on every response")
    if errors is not None:
        errors.update(failed)
    return torch.tensor(values, dtype=torch.float32)


def _one_row(fn, prompts, responses, fields, i: int):
    """Row ``i``'s value from a call on that row alone, or :class:`_Raised` when the rule raises on it."""
    try:
        out = fn(prompts[i:i + 1], responses[i:i + 1], **{k: v[i:i + 1] for k, v in fields.items()})
    except TetherError:
        raise
    except Exception as e:  # noqa: BLE001
        return _Raised(e)
    return _rule_output(fn, out, 1)[0]


def gold_rule(spec: str, rows: list[dict], given=None, flag: str = "--gold"):
    """The eval/accuracy rule: explicit ``module:function``, ``none``, ``auto`` (a reasoning-gym task's own check
    when the rows come from one, else the math rule when they carry an ``answer``), or ``python:NAME``: the callable
    ``given`` from Python."""
    if given is not None:
        return given
    if spec == "none":
        return None
    if spec == "auto" and rows and all("rg_task" in r for r in rows):
        from tether.tasks import reasoning_gym_correct

        return reasoning_gym_correct
    if spec == "auto":
        if rows and all("answer" in r for r in rows):
            from tether.rules import math_correct

            return math_correct
        return None
    return load_rule(spec, flag=flag)
