"""Comparing answers as text: the word-bag F1 that ``eval/reference_overlap`` and the doctor's shortcut evidence
use. Imports only the standard library."""

from __future__ import annotations

import re
from collections import Counter


def word_f1(answer: str, reference: str) -> float:
    """Bag-of-words F1 of two texts (SQuAD's token F1: lower-cased words and numbers, multiset overlap):
    2·|a ∩ r| / (|a| + |r|); 1 for two empty texts."""
    a, r = (Counter(re.findall(r"\w+", text.lower())) for text in (answer, reference))
    total = sum(a.values()) + sum(r.values())
    return 1.0 if total == 0 else 2.0 * sum((a & r).values()) / total
