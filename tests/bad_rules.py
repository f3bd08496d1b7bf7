"""Rules that misbehave, for the B16 and bad-input tests (named ``bad_rules:NAME`` as --reward)."""

import math


def _index(prompts):
    # Deterministic per prompt text, so a straight run and a resumed one see the same bad rows.
    return [sum(map(ord, p)) for p in prompts]


def nan_some(prompts, responses):
    return [math.nan if i % 3 == 0 else len(r) / 10 for i, r in zip(_index(prompts), responses)]


def inf_some(prompts, responses):
    return [(math.inf if i % 2 else -math.inf) if i % 3 == 0 else len(r) / 10
            for i, r in zip(_index(prompts), responses)]


def raises_some(prompts, responses):
    if any(i % 3 == 0 for i in _index(prompts)):
        raise ValueError("cannot parse this reply")
    return [len(r) / 10 for r in responses]


def none_some(prompts, completions, **kwargs):
    """A TRL-style reward function (TRL's signature): None for the rows it does not apply to."""
    return [None if i % 3 == 0 else len(c) / 10 for i, c in zip(_index(prompts), completions)]


def garbage_some(prompts, responses):
    """A verifier that misbehaves on some rows: raises on one kind, returns a string or a list on others."""
    index = _index(prompts)
    if any(i % 5 == 1 for i in index):
        raise ValueError("cannot parse this reply")
    return ["n/a" if i % 5 == 2 else [1.0] if i % 5 == 3 else len(r) / 10 for i, r in zip(index, responses)]


def gold_some(prompts, responses):
    """A gold rule (verifier) that fails on some rows: raises on one kind, returns None, a string or +Inf on others,
    1.0 (correct) on the rest."""
    index = _index(prompts)
    if any(i % 5 == 0 for i in index):
        raise ValueError("cannot verify this reply")
    return [{1: math.inf, 2: "yes", 3: None}.get(i % 5, 1.0) for i in index]


_calls = {"n": 0}


def fails_from_step_2(prompts, responses):
    """Scores every row on its first two calls (the setup's probe, then step 1), raises on every row after: a run
    that logged a step and then stops with an error."""
    _calls["n"] += 1
    if _calls["n"] > 2:
        raise KeyError("answer")
    return [len(r) / 10 for r in responses]


def all_nan(prompts, responses):
    return [math.nan] * len(responses)


def raises_always(prompts, responses):
    raise KeyError("answer")


def strings(prompts, responses):
    return ["good"] * len(responses)


def wrong_length(prompts, responses):
    return [1.0] * (len(responses) + 1)


def not_a_list(prompts, responses):
    return 3.0


not_callable = 3


def constant(prompts, responses):
    """The same score for every reply: no group of samples ever has a spread (a planted 'no signal' run)."""
    return [1.0] * len(responses)
