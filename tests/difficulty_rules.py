"""Rewards that make chosen groups flat, for the dynamic-sampling and curriculum tests (``difficulty_rules:NAME``).
The K samples of a prompt are adjacent rows of every call (one round's batch), so ``i % K`` is a sample's index."""

K = 4


def filter_cfg(tmp_path, files, reward="difficulty_rules:flat_for_even", **overrides):
    """A GRPO run with --filter-groups on the tiny models (``files``: policy dir, prompts file), K = 4, 4 groups a
    step. Rounds of exactly --batch-size prompts (difficulty.oversample 1), as the counts these tests assert were
    worked out for (the default); tests/test_oversample.py tests the sized rounds of --filter-oversample 0."""
    from tiny import tiny_config

    settings = dict(samples_per_prompt=K, advantage__estimator="grpo", batch_size=4, ppo__mini_batches=2,
                    difficulty__filter_groups=True, difficulty__oversample=1.0, reward__sources=[reward],
                    generation__max_new_tokens=4)
    return tiny_config(tmp_path, *files, **{**settings, **overrides})


def is_flat(prompt: str) -> bool:
    """The prompts whose groups get no spread: those starting with an even digit."""
    return int(prompt[0]) % 2 == 0


def flat_for_even(prompts, responses, **columns):
    """1.0 for every sample of a prompt starting with an even digit (a solved, flat group); the sample's index in
    its group (0, 1, 2, 3: spread) otherwise."""
    return [1.0 if is_flat(p) else float(i % K) for i, p in enumerate(prompts)]


def always_flat(prompts, responses, **columns):
    return [0.0 for _ in prompts]
