"""Reward-model forwards with a prompt computed once for all the texts that share it: a training pair's chosen and
rejected reply, or the K replies of one prompt that PPO scores, as suffixes of their common token prefix in one
packed unit (:mod:`tether.core.packing`), each text scored at its own last token.

For ``last_token`` pooling this is the padded computation without its waste. Padded, every text is a row of the
longest text's width and the prompt is computed once per text; packed, a group of texts is one unit

    prefix = the longest token prefix all the group's texts share (leaving each text at least one token of its own)
    suffixes = each text after the prefix

whose suffixes attend to the prefix and to themselves, with positions continuing from the prefix. Each suffix's last
state is then the state of its whole text, so r = w·h_last (+ b) equals the padded score to float rounding, and so
does its gradient (tests/test_rm_packing.py). On chat-formatted chain_sum texts the prompt is ~45 of ~55 tokens: a
training pair computes ~0.57 of its padded tokens, and a PPO group of 8 replies ~0.3.

The check (:func:`packing_fallback`) compares packed scores with padded ones on a few texts; a model whose attention
does not take the block mask (a custom attention, an encoder) is scored padded, with one line saying why.
"""

from __future__ import annotations

import torch

from tether.core.packing import Packed, pack_units

CHECK_TOLERANCE = 1e-3  # max |packed − padded| score on the check texts (fp32 scores of order 1: rounding is ~1e-6)


def common_prefix_length(texts: list[list[int]]) -> int:
    """Tokens every text shares from the start, leaving each at least one token of its own (its last state must be
    its own position)."""
    n, limit = 0, min(len(t) for t in texts) - 1
    first = texts[0]
    while n < limit and all(t[n] == first[n] for t in texts[1:]):
        n += 1
    return n


def pack_groups(groups: list[list[list[int]]], pad_id: int) -> tuple[Packed, list[list[int]]]:
    """The groups as packed units (their common prefix, then each text's rest), and per group the flat index of each
    of its texts' last token. A group whose texts share no first token becomes one unit per text (its first token
    the prefix)."""
    prefixes, suffixes, owner = [], [], []  # owner[u]: (group, text) of unit u's suffixes, in order
    for g, texts in enumerate(groups):
        n = common_prefix_length(texts) if len(texts) > 1 else len(texts[0]) - 1
        if n > 0:
            prefixes.append(torch.tensor(texts[0][:n]))
            suffixes.append([torch.tensor(t[n:]) for t in texts])
            owner.append([(g, k) for k in range(len(texts))])
        else:
            for k, t in enumerate(texts):
                prefixes.append(torch.tensor(t[:1]))
                suffixes.append([torch.tensor(t[1:])] if len(t) > 1 else [])
                owner.append([(g, k)])
    packed = pack_units(prefixes, suffixes, pad_id)
    last = [[0] * len(texts) for texts in groups]
    for u, texts in enumerate(owner):
        if not suffixes[u]:  # a one-token text: its prefix is all of it
            g, k = texts[0]
            last[g][k] = int(packed.prefix_index[u][-1])
        for s, (g, k) in enumerate(texts if suffixes[u] else []):
            last[g][k] = int(packed.suffix_index[u][s][-1])
    return packed, last


def packed_scores(model, groups: list[list[list[int]]], pad_id: int) -> torch.Tensor:
    """Raw scores float32 of every text, in group order (group 0's texts, then group 1's, …), from one packed
    forward of the backbone and the linear head: ``last_token`` pooling's scores
    (:func:`tether.rm.backbone.pooled_scores`)."""
    from tether.hf import block_mask_for, transformers_model
    from tether.rm.backbone import linear_head

    hf = transformers_model(model)
    device = next(model.parameters()).device
    packed, last = pack_groups(groups, pad_id)
    mask = block_mask_for(model, packed.attention_mask.to(device))
    hidden = hf.base_model(input_ids=packed.input_ids.to(device), attention_mask=mask,
                           position_ids=packed.position_ids.to(device), use_cache=False).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N·L, H)
    index = torch.tensor([i for g in last for i in g], device=device)
    return linear_head(model)(flat[index])[:, 0].float()


def pack_pairs(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> tuple[Packed, torch.Tensor]:
    """The pairs as groups of two, and the flat index (2B,) of every text's last token: chosen 0…B−1, then rejected
    B…2B−1 (the padded batch's row order)."""
    packed, last = pack_groups([[c, r] for c, r in zip(chosen, rejected)], pad_id)
    return packed, torch.tensor([g[0] for g in last] + [g[1] for g in last])


def packed_pair_scores(model, chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> torch.Tensor:
    """Raw scores (2B,) of the pairs' texts, chosen then rejected, each pair's prompt computed once."""
    scores = packed_scores(model, [[c, r] for c, r in zip(chosen, rejected)], pad_id)  # (c0, r0, c1, r1, …)
    return torch.cat([scores[0::2], scores[1::2]])


@torch.no_grad()
def packing_fallback(model, groups: list[list[list[int]]], pad_id: int, pooling: str) -> str:
    """'' when packed scores equal the padded ones on up to 4 ``groups`` (the token ids of texts sharing a prompt,
    e.g. pairs), else why not (one line)."""
    from tether.rm.backbone import pad_batch, pooled_scores

    if pooling != "last_token":
        return f"{pooling} pooling reads every token, not one per text"
    groups = groups[:4]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids, mask = pad_batch([t for g in groups for t in g], pad_id, "right")
        padded = pooled_scores(model, ids.to(device), mask.to(device), pooling)
        packed = packed_scores(model, groups, pad_id)
    except Exception as e:  # noqa: BLE001 - a model that refuses the packed call is scored padded
        return f"the packed forward failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        model.train(was_training)
    gap = (packed - padded).abs().max().item()
    if not gap <= CHECK_TOLERANCE:
        return f"packed scores differ from padded ones by {gap:.2e} on the check texts"
    return ""
