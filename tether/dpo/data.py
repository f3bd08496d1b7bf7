"""Preference pairs as the policy reads them, and their log-probabilities.

A pair's two sides are tokenised as ``tether sft`` tokenises a row (:func:`tether.sft.tokens.encode_rows`): the same
chat template or plain text, system turn and prompt template, and the same labels — the reply's tokens (up to and
including its stop token) are labelled, the prompt, template glue and padding are not. So a pair scored here is
scored on exactly the tokens SFT trained, and a DPO policy is prompted as PPO will prompt it.

A batch of B pairs is one forward of 2B sequences (chosen 0…B−1, then rejected B…2B−1), padded or packed
(:func:`tether.sft.batches.make_batch`); ``segments`` says which sequence each position belongs to, so that the
summed reply log-probs come out per sequence either way (:func:`tether.core.preference.sequence_logps`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tether.core.preference import sequence_logps
from tether.sft.batches import Batch, first_fit_rows, make_batch
from tether.sft.data import SFTRow
from tether.sft.tokens import Example, encode_rows


@dataclass(frozen=True)
class PairExample:
    """One preference pair as tokens."""

    chosen: Example    # prompt + chosen reply; labels on the reply
    rejected: Example  # prompt + rejected reply; labels on the reply

    @property
    def length(self) -> int:
        return max(len(self.chosen.ids), len(self.rejected.ids))


def encode_pairs(tokenizer, pairs: list, fmt) -> tuple[list[PairExample], dict]:
    """Every :class:`~tether.inputs.pairs.PreferencePair` as a :class:`PairExample` (``fmt``: SFT's
    :class:`~tether.sft.tokens.TextFormat`), and the counts a run reports."""
    chosen, c_info = encode_rows(tokenizer, [SFTRow(p.prompt, p.chosen, source=p.source) for p in pairs], fmt)
    rejected, r_info = encode_rows(tokenizer, [SFTRow(p.prompt, p.rejected, source=p.source) for p in pairs], fmt)
    info = {key: c_info[key] + r_info[key] for key in ("tokens", "trained_tokens", "prompt_truncated",
                                                       "response_truncated")}
    info["pairs"] = len(pairs)
    return [PairExample(c, r) for c, r in zip(chosen, rejected)], info


def segment_ids(examples: list[Example], packing: str | None, shape: torch.Size) -> torch.Tensor:
    """(N, L): the index of the sequence each position of :func:`~tether.sft.batches.make_batch`'s batch holds
    (0 on padding and packed filler, whose labels are never counted). Padded: one sequence per row; packed: the
    layout :func:`~tether.sft.batches.packed_batch` builds, laid out again from the same first-fit rows."""
    if packing is None:
        return torch.arange(len(examples)).unsqueeze(1).expand(shape).contiguous()
    lengths = [len(e.ids) for e in examples]
    rows = first_fit_rows(lengths, None if packing == "one_row" else max(lengths))
    segments = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            segments[r, at:at + lengths[i]] = i
            at += lengths[i]
    return segments


def pair_batch(items: list[PairExample], tokenizer, packing: str | None) -> tuple[Batch, torch.Tensor]:
    """``(batch, segments)`` of B pairs: 2B sequences, chosen first."""
    examples = [p.chosen for p in items] + [p.rejected for p in items]
    batch = make_batch(examples, tokenizer, packing)
    return batch, segment_ids(examples, packing, batch.input_ids.shape)


def forward_logps(model, batch: Batch, segments: torch.Tensor, n_sequences: int, device, precision,
                  average: bool) -> torch.Tensor:
    """(n_sequences,) reply log-probs of the batch's sequences under ``model``: summed over the reply tokens, or
    their per-token mean (``average``: IPO's)."""
    with precision.autocast():
        logits = model(**batch.model_inputs(device)).logits  # (N, L, V)
    sums, counts = sequence_logps(logits, batch.labels.to(device), segments.to(device), n_sequences)
    return sums / counts.clamp(min=1) if average else sums


@torch.no_grad()
def score_pairs(model, items: list[PairExample], tokenizer, packing: str | None, batch_size: int, device, precision,
                average: bool, adapter_off: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen (P,), rejected (P,))`` reply log-probs of every pair under ``model`` in eval mode, on the CPU in fp32;
    ``adapter_off``: with the LoRA adapter turned off (peft's ``disable_adapter``: the base model, the reference)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        with model.disable_adapter() if adapter_off else contextlib.nullcontext():
            for start in range(0, len(items), batch_size):
                part = items[start:start + batch_size]
                batch, segments = pair_batch(part, tokenizer, packing)
                logps = forward_logps(model, batch, segments, 2 * len(part), device, precision, average).float().cpu()
                chosen.append(logps[:len(part)])
                rejected.append(logps[len(part):2 * len(part)])
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)
