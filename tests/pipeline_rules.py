"""Gold rules for tests/test_pipeline.py: a random tiny policy passes them on some samples and fails on others, so
its own samples give preference pairs (the addition task's gold rule it never passes)."""


def has_one(prompts, responses, **columns):
    """1.0 when the reply holds the character '1' (about a quarter of a random 6-token reply does), else 0.0."""
    return [1.0 if "1" in r else 0.0 for r in responses]
