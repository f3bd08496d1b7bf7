"""Reward-model training with each pair's prompt computed once: the chosen and the rejected text as two suffixes of
their common token prefix in one packed unit (:mod:`tether.core.packing`), each scored at its own last token.

For ``last_token`` pooling this is the padded computation without its waste. Padded, a batch of B pairs is 2B rows of
the longest text's width, and each pair's prompt is computed twice; packed, a pair is one unit

    prefix = the longest common token prefix of chosen and rejected (at most min(|c|, |r|) − 1 tokens)
    suffixes = chosen[|prefix|:], rejected[|prefix|:]

whose suffixes attend to the prefix and to themselves, with positions continuing from the prefix. Each suffix's last
state is then the state of its whole text, so r = w·h_last (+ b) equals the padded score to float rounding, and so
does its gradient (tests/test_rm_packing.py). On chat-formatted pairs the prompt is most of each text (chain_sum: ~45
of ~55 tokens), so a step computes close to half the tokens.

The start-up check (:func:`packing_fallback`) compares the packed scores with the padded ones on the first training
pairs; a model whose attention does not take the block mask (a custom attention, an encoder) trains padded, with one
line saying why.
"""

from __future__ import annotations

import torch

from tether.core.packing import Packed, pack_units

CHECK_TOLERANCE = 1e-3  # max |packed − padded| score on the check batch (fp32 scores of order 1: rounding is ~1e-6)


def shared_prefix_length(a: list[int], b: list[int]) -> int:
    """Tokens the two texts share from the start, leaving each at least one token of its own (its last state must be
    its own position)."""
    n = 0
    limit = min(len(a), len(b)) - 1
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def pack_pairs(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> tuple[Packed, torch.Tensor]:
    """The pairs as packed units (prefix, [chosen suffix, rejected suffix]), and the flat index (2B,) of every text's
    last token: chosen 0…B−1, then rejected B…2B−1 (the padded batch's row order). Two texts that share no first
    token are two units of their own (each its first token as the prefix)."""
    prefixes, suffixes, owner = [], [], []  # owner[u]: which texts (index into the 2B) unit u's suffixes are
    B = len(chosen)
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        n = shared_prefix_length(c, r)
        if n > 0:
            prefixes.append(torch.tensor(c[:n]))
            suffixes.append([torch.tensor(c[n:]), torch.tensor(r[n:])])
            owner.append([i, B + i])
        else:  # nothing shared: each text alone, its first token the prefix
            for text, j in ((c, i), (r, B + i)):
                prefixes.append(torch.tensor(text[:1]))
                suffixes.append([torch.tensor(text[1:])] if len(text) > 1 else [])
                owner.append([j])
    packed = pack_units(prefixes, suffixes, pad_id)
    last = torch.zeros(2 * B, dtype=torch.long)
    for u, texts in enumerate(owner):
        for k, j in enumerate(texts):
            index = packed.suffix_index[u][k] if suffixes[u] else packed.prefix_index[u]
            last[j] = index[-1]
    return packed, last


def packed_pair_scores(model, chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> torch.Tensor:
    """Raw scores (2B,) float32 of the pairs' texts (chosen, then rejected) from one packed forward of the backbone
    and the linear head: ``last_token`` pooling's scores (:func:`tether.rm.backbone.pooled_scores`)."""
    from tether.hf import transformers_model
    from tether.rm.backbone import linear_head

    hf = transformers_model(model)
    device = next(model.parameters()).device
    packed, last = pack_pairs(chosen, rejected, pad_id)
    mask = packed.attention_mask.to(device)
    if hf.config._attn_implementation == "eager":  # eager adds its mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    hidden = hf.base_model(input_ids=packed.input_ids.to(device), attention_mask=mask,
                           position_ids=packed.position_ids.to(device), use_cache=False).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N·L, H)
    return linear_head(model)(flat[last.to(device)])[:, 0].float()


@torch.no_grad()
def packing_fallback(model, encoded: list[tuple], pad_id: int, pooling: str) -> str:
    """'' when packed scores equal the padded ones on up to 4 of the training pairs, else why not (one line)."""
    from tether.rm.backbone import pad_batch, pooled_scores

    if pooling != "last_token":
        return f"{pooling} pooling reads every token, not one per text"
    sample = encoded[:4]
    chosen, rejected = [c.ids for c, _ in sample], [r.ids for _, r in sample]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids, mask = pad_batch(chosen + rejected, pad_id, "right")
        padded = pooled_scores(model, ids.to(device), mask.to(device), pooling)
        packed = packed_pair_scores(model, chosen, rejected, pad_id)
    except Exception as e:  # noqa: BLE001 - a model that refuses the packed call trains padded
        return f"the packed forward failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        model.train(was_training)
    gap = (packed - padded).abs().max().item()
    if not gap <= CHECK_TOLERANCE:
        return f"packed scores differ from padded ones by {gap:.2e} on the check pairs"
    return ""
