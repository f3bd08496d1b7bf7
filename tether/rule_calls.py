"""Calling a rule (SPEC B4, B13): any Python callable ``f(prompts, responses, **columns) -> list[float]``, the
reward rules of PPO and the gold rules of evaluation (PPO's and SFT's) and of rejection sampling alike.

:func:`call_rule` passes the prompt rows' other columns as keyword lists (only those the rule names, unless it takes
``**fields``), plus the reserved keyword ``ended_with_eos`` (one bool per response: False when cut by
max_new_tokens) when the caller has it, checks one number per response, and isolates the rows a rule raises on.
:func:`gold_rule` resolves the ``--gold`` setting to the rule of ``eval/accuracy``.
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


def _numbers(fn, out, n: int) -> list[float]:
    """The rule's output as ``n`` floats (NaN/Inf kept: the PPO step drops those rows, B16); a wrong length
    or a value that is not a number is a one-line error (a bug in the rule, not in one row)."""
    try:
        out = list(out)
    except TypeError:
        raise TetherError(f"rule {_rule_name(fn)}: returned {type(out).__name__}, not a list of numbers") from None
    if len(out) != n:
        raise TetherError(f"rule {_rule_name(fn)}: returned {len(out)} scores for {n} responses")
    values = []
    for v in out:
        if isinstance(v, (str, bytes)) or v is None:
            raise TetherError(f"rule {_rule_name(fn)}: returned {v!r} ({type(v).__name__}), not a number")
        try:
            values.append(float(v))
        except (TypeError, ValueError):
            raise TetherError(f"rule {_rule_name(fn)}: returned {v!r} ({type(v).__name__}), not a number") from None
    return values


def call_rule(fn: Callable, prompts: list[str], responses: list[str], fields: dict[str, list],
              ended_with_eos=None, errors: dict | None = None) -> torch.Tensor:
    """Call a rule with the prompt rows' other columns as keyword lists, plus ``ended_with_eos`` when given
    (only the keywords it accepts, unless it takes ``**fields``); check it returned one number per response.

    A rule that raises on the batch is called again row by row: rows that still raise score NaN (the PPO
    step drops them, B16) and ``errors`` (when given) gets ``{row: "ExcType: message"}``; a rule that raises
    on every row is a one-line error. Non-finite scores are returned as they are."""
    fields = with_eos_field(fields, ended_with_eos)
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    try:
        return torch.tensor(_numbers(fn, fn(prompts, responses, **fields), len(responses)), dtype=torch.float32)
    except TetherError:
        raise
    except Exception:  # noqa: BLE001 - a rule is user code: isolate the rows it fails on
        pass
    values, failed = [], {}
    for i in range(len(responses)):
        try:
            out = fn(prompts[i:i + 1], responses[i:i + 1], **{k: v[i:i + 1] for k, v in fields.items()})
            values += _numbers(fn, out, 1)
        except TetherError:
            raise
        except Exception as e:  # noqa: BLE001
            values.append(math.nan)
            failed[i] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    if len(failed) == len(responses):
        raise TetherError(f"rule {_rule_name(fn)}: raised on every response ({failed[0]})")
    if errors is not None:
        errors.update(failed)
    return torch.tensor(values, dtype=torch.float32)


def gold_rule(spec: str, rows: list[dict], given=None, flag: str = "--gold"):
    """The eval/accuracy rule: explicit ``module:function``, ``none``, ``auto`` (the math rule when the prompt
    rows carry an ``answer``), or ``python:NAME``: the callable ``given`` from Python."""
    if given is not None:
        return given
    if spec == "none":
        return None
    if spec == "auto":
        if rows and all("answer" in r for r in rows):
            from tether.rules import math_correct

            return math_correct
        return None
    return load_rule(spec, flag=flag)
