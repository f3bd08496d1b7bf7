"""Rewards for tests/test_dynamic_sampling_fixes.py (``dynamic_sampling_rules:NAME``). The K samples of a prompt are
adjacent rows of every call (one round's batch), so ``i % K`` is a sample's index in its group. ``SEEN`` keeps the
prompts of every call, for a worker that reads which prompts each step drew."""

from difficulty_rules import K, is_flat

SEEN: list[str] = []


def always_right(prompts, responses, **columns):
    """1.0 for every reply: every group flat on its raw scores."""
    return [1.0 for _ in prompts]


def six_to_nine(prompts, responses, **columns):
    """6, 7, 8, 9 in every group: spread on the raw scores, none after a clip to ±5."""
    return [6.0 + i % K for i in range(len(prompts))]


def logged_flat_for_even(prompts, responses, **columns):
    """difficulty_rules.flat_for_even, remembering the prompts of every call in ``SEEN``."""
    SEEN.extend(prompts)
    return [1.0 if is_flat(p) else float(i % K) for i, p in enumerate(prompts)]


def always_nan(prompts, responses, **columns):
    """NaN for every reply: a broken reward (every row non-finite, B16)."""
    return [float("nan") for _ in prompts]
