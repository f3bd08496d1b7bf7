"""Rule rewards shipped with tether (SPEC B4), in the rule signature
``f(prompts, responses, **fields) -> list[float]``.

``math_answer``: +1 when the last integer in the response equals the gold ``answer`` (GSM8K / SVAMP:
commas stripped, ``#### N`` answers reduced to N), plus ``format_bonus`` when the response states its
final answer in the expected format (a final line ``#### N`` or "The answer is N").
Use it as ``--reward tether.rules:math_answer`` (``tether.rules:math_answer:format_bonus=0.2``).
``math_correct`` is the 0/1 gold check used for ``eval/accuracy``.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")
_FORMAT = re.compile(r"(####\s*-?[\d,]+\s*$)|(answer is\s*:?\s*\$?-?[\d,]+)", re.IGNORECASE)


def gold_integer(answer) -> int | None:
    """The gold integer of an answer field: ``42``, ``"42"``, ``"1,234"``, ``"...\\n#### 42"``, ``42.0``."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        found = _INT.findall(text)
        return int(found[-1]) if found else None
    return int(value) if value.is_integer() else None


def last_integer(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def math_correct(prompts: list[str], responses: list[str], answer: list, **_) -> list[float]:
    """1.0 when the response's last integer equals the gold answer, else 0.0."""
    out = []
    for response, gold in zip(responses, answer):
        g = gold_integer(gold)
        out.append(1.0 if g is not None and last_integer(response) == g else 0.0)
    return out


def math_answer(prompts: list[str], responses: list[str], answer: list, format_bonus: float = 0.1,
                **_) -> list[float]:
    """:func:`math_correct` plus ``format_bonus`` for an answer stated in the expected format."""
    correct = math_correct(prompts, responses, answer)
    return [c + (format_bonus if _FORMAT.search(r.strip()) else 0.0) for c, r in zip(correct, responses)]


def char_share(prompts: list[str], responses: list[str], char: str = "7", **_) -> list[float]:
    """Share of the response's characters equal to ``char`` (0 for an empty response): a toy reward
    that any policy can climb, for smoke tests and for watching PPO work."""
    char = str(char)  # `:char=7` arrives as the integer 7
    return [sum(ch == char for ch in r) / len(r) if r else 0.0 for r in responses]
