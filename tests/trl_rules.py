"""A TRL-style reward function in an importable module, for ``--reward trl_rules:close_to:target=N`` in tests."""


def close_to(completions, target=20, **kwargs):
    """Minus the distance of each completion's length (characters) from ``target``."""
    return [-abs(int(target) - len(c)) for c in completions]
