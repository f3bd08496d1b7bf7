"""Calling a rule — user code — so that a bad row costs the row and not the run (SPEC B4, B16).

Two signatures are understood, told apart by the rule's own parameters (:func:`calls_by_keyword`):

- **TRL's reward functions**, called by keyword exactly as TRL's ``GRPOTrainer`` calls them, so that one written for
  TRL runs unchanged: ``f(prompts=..., completions=..., completion_ids=..., **columns)``. A rule is called this way
  when it names a parameter ``completions`` (or ``completion_ids``), or cannot take two positional arguments
  (``def f(**kwargs)``). ``completions`` are texts, or — where the prompt is a list of chat messages (TRL's
  conversational form) — one assistant message each, ``[{"role": "assistant", "content": text}]``, as TRL gives
  them. ``completion_ids`` are the reply's token ids (up to and including EOS), passed where the caller has them.
  tether's extras ``responses`` (the texts) and ``ended_with_eos`` are there too, by keyword.
- **tether's rules**, ``f(prompts, responses, **columns)``: the two lists positionally, then the columns (and
  ``ended_with_eos``) by keyword. Every other rule is called this way, as before.

Either way the prompt rows' other columns arrive as keyword lists, and a rule that takes no ``**kwargs`` gets only
the keywords it names. :func:`call_rule` turns what the rule returns into (B,) float32 scores: a number as it is
(NaN/Inf kept, B16 drops the row), None as NaN and "does not apply" (TRL's reward-function convention), anything
else — a string, a list, an exception on the row — as NaN with the reason. Only what cannot be a row's fault stops
the run, in one line naming the rule: a result that is not a list or has the wrong length, or a failure on every
row. Used for reward rules (:mod:`tether.ppo.sources`), the gold rule of evaluation (:mod:`tether.ppo.evaluate`,
:mod:`tether.sft.evaluate`) and rejection sampling (:mod:`tether.sft.sample`). Several rules' scores are summed by
:func:`judged_sum`, each counting only on the rows it judged (PPO's reward sources and ``tether sample`` alike).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch

from tether.errors import TetherError
from tether.rules.loading import load_rule

EOS_FIELD = "ended_with_eos"   # reserved keyword: one bool per response, False when cut by max_new_tokens
IDS_FIELD = "completion_ids"   # reserved keyword: one list of token ids per response (TRL's name)
TRL_NAMES = ("prompts", "completions", "responses")  # what a keyword call passes beside the columns
_ASKS_TRL = ("completions", IDS_FIELD, "completions_ids")  # parameter names that mark a TRL reward function


def _reserved(fields: dict[str, list], name: str, values: list, what: str) -> dict[str, list]:
    if name in fields:
        raise TetherError(f"prompt rows have a column {name!r}: tether reserves that name for rules ({what}); "
                          f"rename the column")
    return {**fields, name: values}


def with_eos_field(fields: dict[str, list], ended_with_eos=None) -> dict[str, list]:
    """``fields`` plus the reserved ``ended_with_eos`` list (bools, from a (B,) tensor or a list); ``fields``
    itself when ``ended_with_eos`` is None."""
    if ended_with_eos is None:
        return fields
    flags = ended_with_eos.tolist() if hasattr(ended_with_eos, "tolist") else list(ended_with_eos)
    return _reserved(fields, EOS_FIELD, [bool(f) for f in flags], "whether each response ended with EOS")


def with_completion_ids(fields: dict[str, list], ids: list[list[int]] | None) -> dict[str, list]:
    """``fields`` plus the reserved ``completion_ids`` (each response's token ids); ``fields`` when ``ids`` is None."""
    if ids is None:
        return fields
    return _reserved(fields, IDS_FIELD, [list(map(int, row)) for row in ids], "each response's token ids")


def completion_ids(rollout) -> list[list[int]]:
    """Each response's token ids: ``rollout.response`` under ``response_mask`` (up to and including EOS, as TRL
    passes them)."""
    response, mask = rollout.response.cpu(), rollout.response_mask.cpu().bool()
    return [row[keep].tolist() for row, keep in zip(response, mask)]


def rollout_fields(fields: dict[str, list], rollout) -> dict[str, list]:
    """``fields`` plus what a rollout tells a rule: ``ended_with_eos`` and ``completion_ids``."""
    return with_completion_ids(with_eos_field(fields, rollout.ended_with_eos), completion_ids(rollout))


def _rule_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or str(fn)


def _parameters(fn):
    """The rule's parameters, or None where Python cannot tell (a builtin: called tether's way, every column)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def calls_by_keyword(fn) -> bool:
    """Whether ``fn`` is called as TRL calls a reward function, all by keyword: it names ``completions`` (or
    ``completion_ids``), or cannot take two positional arguments. Otherwise tether's ``f(prompts, responses, ...)``."""
    params = _parameters(fn)
    if params is None:
        return False
    if any(name in params for name in _ASKS_TRL):
        return True
    kinds = [p.kind for p in params.values()]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    return positional < 2 and inspect.Parameter.VAR_POSITIONAL not in kinds


def completions_of(prompts: list, responses: list[str]) -> list:
    """TRL's ``completions``: the text, or one assistant message where the prompt is a list of messages."""
    return [[{"role": "assistant", "content": r}] if isinstance(p, (list, tuple)) else r
            for p, r in zip(prompts, responses)]


def rule_arguments(fn, prompts: list, responses: list[str], fields: dict[str, list]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of rule ``fn`` on the whole batch (module docstring): every value a list of one
    entry per response. A rule that takes no ``**kwargs`` gets only the keywords it names; arguments bound in the
    rule's spec (``module:function:key=value``) win over columns of the same name. A required parameter that
    nothing fills is a one-line error naming the rule and the columns there are."""
    params = _parameters(fn)
    fields = dict(fields)
    ids = fields.pop(IDS_FIELD, None)
    if calls_by_keyword(fn):
        clash = next((name for name in TRL_NAMES if name in fields), None)
        if clash:
            raise TetherError(f"prompt rows have a column {clash!r}: TRL-style rules get that keyword from tether "
                              f"(rename the column)")
        args = ()
        kwargs = {**fields, "prompts": list(prompts), "completions": completions_of(prompts, responses),
                  "responses": list(responses)}
        if ids is not None:
            kwargs[IDS_FIELD] = ids
            if params is not None and "completions_ids" in params:
                kwargs["completions_ids"] = ids  # the spelling of TRL's own docs' example
    else:
        args, kwargs = (list(prompts), list(responses)), fields
        if ids is not None and params is not None and IDS_FIELD in params:
            kwargs[IDS_FIELD] = ids
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    bound = getattr(fn, "keywords", None) or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in bound}
    if params is not None:
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            given = ", ".join(sorted(k for k in fields if k != EOS_FIELD)) or "none"
            asks = "" if ids is not None else f"; {IDS_FIELD} is not known here"
            raise TetherError(f"rule {_rule_name(fn)}: cannot be called with what it is given ({e}; the prompt rows' "
                              f"columns: {given}{asks})") from None
    return args, kwargs


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


def call_rule(fn: Callable, prompts: list, responses: list[str], fields: dict[str, list],
              ended_with_eos=None, errors: dict | None = None, not_applicable: set | None = None) -> torch.Tensor:
    """Call a rule on a batch — TRL's way or tether's (:func:`rule_arguments`) — with the prompt rows' other
    columns as keyword lists, plus ``ended_with_eos`` when given and ``completion_ids`` when ``fields`` holds them
    (:func:`rollout_fields`); (B,) float32 scores, one per response.

    Bad rows cost the row, not the run (B16): a rule that raises on the batch is called again row by row; a row
    it still raises on, or whose value is not a number (a string, a list), scores NaN and goes into ``errors``
    (``{row: "raised ExcType: message"}``); None — TRL's "does not apply" — scores NaN and goes into
    ``not_applicable``; NaN/Inf are returned as they are. One-line errors, a bug in the rule: a result that is not
    a list or has the wrong length, or a failure on every row."""
    args, kwargs = rule_arguments(fn, prompts, responses, with_eos_field(fields, ended_with_eos))
    try:
        rows = _rule_output(fn, fn(*args, **kwargs), len(responses))
    except TetherError:
        raise
    except Exception:  # noqa: BLE001 - a rule is user code: isolate the rows it fails on
        rows = [_one_row(fn, args, kwargs, i) for i in range(len(responses))]
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


def _one_row(fn, args: tuple, kwargs: dict, i: int):
    """Row ``i``'s value from a call on that row alone, or :class:`_Raised` when the rule raises on it."""
    try:
        out = fn(*(a[i:i + 1] for a in args), **{k: v[i:i + 1] for k, v in kwargs.items()})
    except TetherError:
        raise
    except Exception as e:  # noqa: BLE001
        return _Raised(e)
    return _rule_output(fn, out, 1)[0]


def judged_sum(parts: list[tuple[torch.Tensor, set[int]]], n: int, all_judged: bool = False) -> torch.Tensor:
    """(n,) float32 Σ of the sources' (n,) scores, each counting only on the rows it judged (not in its set of
    rows it returned None for): TRL sums reward functions with ``nansum`` so that one that does not apply to a row
    leaves the others' score. A row that no source judged is NaN (dropped, B16) unless ``all_judged`` (a source
    outside ``parts``, a per-step PRM, judged every row)."""
    total = torch.zeros(n, dtype=torch.float32)
    judged = torch.full((n,), all_judged or not parts)
    for scores, not_applicable in parts:
        skip = torch.zeros(n, dtype=torch.bool)
        skip[list(not_applicable)] = True
        total += torch.where(skip, 0.0, scores.float().cpu())
        judged |= ~skip
    return torch.where(judged, total, math.nan)


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
            from tether.rules.library import math_correct

            return math_correct
        return None
    return load_rule(spec, flag=flag)
