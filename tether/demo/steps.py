"""The step task: running sums with every partial sum written out, a task whose steps a rule can check (A9).

A prompt is four 2-digit operands, ``"12+34+56+78="``; the response writes the running sum after each
addition, units digit first like the demo's task, steps separated by a space: 12 + 34 = 46, 46 + 56 = 102,
102 + 78 = 180 → ``"64 201 081"``. Step k is right iff it is the true partial sum of the first k + 1
operands (``step_labels``), so a wrong step stays visible even when a later one gets back on track — a
right final answer can hide a wrong step, the case Lightman et al. (2023) built process supervision for.
The gold rule (``gold_reward``) checks the whole response: every step right and nothing else.

The character tokenizer and tiny policy are the demo's (:mod:`tether.demo.task`); the space is already in
its vocabulary, so the step separator is a space.
"""

from __future__ import annotations

import random
from typing import Any

from tether.demo.task import answer_text

STEP_SEPARATOR = " "
N_OPERANDS, DIGITS = 4, 2


def chain_problem(operands: list[int]) -> dict[str, str]:
    """``{"prompt": "12+34+56+78=", "answer": "64 201 081"}``: the partial sums, units first, space-separated."""
    if len(operands) < 2:
        raise ValueError("a chain needs at least two operands")
    partial = [sum(operands[:k + 1]) for k in range(1, len(operands))]
    return {"prompt": "+".join(f"{x:0{DIGITS}d}" for x in operands) + "=",
            "answer": STEP_SEPARATOR.join(answer_text(s) for s in partial)}


def partial_sums(prompt: str) -> list[str]:
    """The right steps of a prompt ``"aa+bb+…="`` (units first); ``ValueError`` when it is not one."""
    body, eq, rest = prompt.partition("=")
    operands = body.split("+")
    if not eq or rest or len(operands) < 2 or not all(o.isascii() and o.isdigit() for o in operands):
        raise ValueError(f"not a step-task prompt (expected 'aa+bb+...='): {prompt!r}")
    return chain_problem([int(o) for o in operands])["answer"].split(STEP_SEPARATOR)


def make_chain_problems(n: int, seed: int | str, exclude: set[str] | None = None) -> list[dict[str, str]]:
    """``n`` distinct problems drawn uniformly (seeded) from all 100⁴, skipping ``exclude``."""
    rng, exclude, seen, out = random.Random(seed), exclude or set(), set(), []
    while len(out) < n:
        p = chain_problem([rng.randrange(10**DIGITS) for _ in range(N_OPERANDS)])
        if p["prompt"] in seen or p["prompt"] in exclude:
            continue
        seen.add(p["prompt"])
        out.append(p)
    return out


def split_chain_problems(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` from separate seeded streams, never sharing a prompt."""
    held_out = make_chain_problems(n_eval, f"tether-steps/{seed}/held-out")
    train = make_chain_problems(n_train, f"tether-steps/{seed}/train", exclude={p["prompt"] for p in held_out})
    return train, held_out


def step_labels(prompts: list[str], steps: list[list[str]], **fields: Any) -> list[list[bool]]:
    """A step rule for :func:`tether.rm.steps.label_with_rule`: step k is right iff it equals the partial sum
    of the first k + 1 operands (units first, exact text); steps past the last partial sum are wrong."""
    out = []
    for prompt, row in zip(prompts, steps):
        right = partial_sums(prompt)
        out.append([k < len(right) and s == right[k] for k, s in enumerate(row)])
    return out


def gold_reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    """The gold rule as a tether reward rule: 1.0 when the response is exactly every right step, else 0.0."""
    return [1.0 if r == STEP_SEPARATOR.join(partial_sums(p)) else 0.0 for p, r in zip(prompts, responses)]
