"""Held-out splits and epochs of batches, for any rows: the deterministic split **by prompt** (preference pairs, SFT
rows) and one epoch's shuffled batches, optionally grouped by length (reward-model training, SFT).

``split_by_prompt`` needs only an item's ``prompt`` (text or chat messages, keyed by
:func:`tether.inputs.conversations.prompt_key`); ``shuffled_batches`` only the items' lengths.
"""

from __future__ import annotations

import random

from tether.inputs.conversations import prompt_key


def split_by_prompt(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic ``(train, held_out)`` split **by prompt** of items with a ``prompt`` (text or messages): all
    items of one prompt land on the same side, so no held-out prompt is ever seen in training. Prompts are sorted,
    then shuffled with ``random.Random(seed)``; whole prompt groups go to held-out until it holds ≥
    ``eval_fraction`` of the items. The result does not depend on the order of the input rows."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(prompt_key(item.prompt), []).append(item)
    prompts = sorted(groups)
    random.Random(seed).shuffle(prompts)
    target = max(1, round(eval_fraction * len(items)))
    held_out_prompts: set[str] = set()
    n_held_out = 0
    for prompt in prompts:
        if n_held_out >= target or len(held_out_prompts) == len(prompts) - 1:
            break
        held_out_prompts.add(prompt)
        n_held_out += len(groups[prompt])
    train = [p for p in items if prompt_key(p.prompt) not in held_out_prompts]
    held_out = [p for p in items if prompt_key(p.prompt) in held_out_prompts]
    return train, held_out


def shuffled_batches(lengths: list[int], batch_size: int, generator, group_by_length: bool) -> list[list[int]]:
    """One epoch of batches (lists of item indices), every item exactly once, in shuffled order (a
    ``torch.Generator`` draws it: the same generator state, the same epoch).

    ``group_by_length``: shuffle, cut into chunks of 50 batches, sort each chunk by ``lengths`` (an item's
    length in tokens; a preference pair's longer text), cut into batches and shuffle the batches: padding shrinks
    to the spread inside a batch while which items meet stays random (Hugging Face's group_by_length does the
    same). Used by reward-model training (pairs) and SFT (sequences).
    """
    import torch

    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    chunk = 50 * batch_size
    order = [i for lo in range(0, len(order), chunk)
             for i in sorted(order[lo:lo + chunk], key=lambda j: -lengths[j])]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]
