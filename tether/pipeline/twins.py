"""Held-out problems with a twin in training: the same words in another order and the same answer ("3 + 5" held
out, "5 + 3" trained on). A policy that memorises a training answer gets its twin right without learning the task,
so ``tether rlhf`` reports every arm's gold on the held-out problems *without* a twin beside the whole split.

On small generated tasks twins are common: chain_sum with two one-digit terms has 200 distinct problems, and a
random 100/100 split leaves about a fifth of the held-out additions with their commuted twin in training
(docs/real-models.md). The rule needs no task-specific code: a prompt's signature is the sorted multiset of its
lower-cased words and symbols; a twin also has the same gold answer (so "4 - 1" and "1 - 4" are not twins). Rows
without an ``answer`` match on the signature alone.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"\w+|[^\w\s]")


def prompt_text(row: dict) -> str:
    """A row's prompt as text: the string, or a chat's message contents joined."""
    prompt = row.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    return " ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))


def signature(row: dict) -> tuple:
    """(sorted words and symbols of the prompt, the answer): equal for a problem and its reordered twin."""
    return tuple(sorted(TOKEN.findall(prompt_text(row).lower()))), str(row.get("answer", "")).strip()


def twin_flags(train_rows: list[dict], held_rows: list[dict]) -> list[bool]:
    """For each held-out row, whether some training row has its signature (:func:`signature`)."""
    seen = {signature(r) for r in train_rows}
    return [signature(r) in seen for r in held_rows]


def select(correct: str, keep: list[bool]) -> str:
    """The characters of an ``eval/correct`` string at the problems ``keep`` marks (problem i = character i)."""
    return "".join(c for c, k in zip(correct, keep) if k)
