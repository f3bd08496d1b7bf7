"""Where rewards are called: the rules shipped with tether and everything that calls a rule (SPEC B4, B16).

- ``library``: the shipped rules, ``f(prompts, responses, **fields) -> list[float]`` (``math_answer``,
  ``math_correct``, ``math_verify_correct``, ``char_share``) and the answer parsing they share;
- ``loading``: :func:`load_rule`, ``module:function[:key=value,...]`` imported with one-line errors;
- ``calls``: calling a rule on a batch, TRL's reward functions by keyword or tether's ``f(prompts, responses)``,
  so that a bad row costs the row and not the run; several rules' scores summed; the gold rule of evaluation;
- ``task_gate``: a reward for the task beside its check (``--reward tether.rules.task_gate:gated:check=...``).

The shipped rules are imported here, so the spec ``tether.rules:math_correct`` (command lines, saved run configs,
recipes) names them; ``from tether.rules import load_rule`` works too. Nothing heavier loads with this package:
``calls`` (torch) only when imported.

May import: the standard library, torch, ``tether.errors`` and ``tether.tasks`` — not ``tether.inputs`` (which reads
gold answers with this package's parser), never a stage (``tether.rm``, ``tether.ppo``, ``tether.sft``,
``tether.demo``) or ``tether.diagnostics``.
"""

from tether.rules.library import (char_share, extract_answer, gold_integer, gold_number, has_final_statement,
                                  math_answer, math_correct, math_verify_correct, numbers)
from tether.rules.loading import load_rule

__all__ = ["char_share", "extract_answer", "gold_integer", "gold_number", "has_final_statement", "load_rule",
           "math_answer", "math_correct", "math_verify_correct", "numbers"]
