"""The training-side forward pass (B2): log-probs and entropy of the sampled response tokens under
softmax(logits / temperature), the last-layer hidden states for a value head, and the critic's values — for the
old and reference log-probs of a step, every minibatch update, and evaluation's KL.

Positions: the query (prompt) has P tokens, left-padded; the response has T tokens, right-padded after
its first EOS. Logits at sequence position i predict token i+1, so response token t is scored by the
logits at position P−1+t, and the state s_t (query + response[:t]) is the hidden state at P−1+t; the
state after the last token, used for the truncation bootstrap, is the hidden state at P−1+T.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch

from tether.core.stats import entropy_from_logits, logprobs_from_logits
from tether.hf import transformers_model
from tether.ppo.models import ValueHead
from tether.rollout.records import Rollout


def sequence_inputs(query, query_mask, response, response_mask):
    """input_ids, attention_mask, position_ids of query+response, positions as ``generate`` makes them."""
    input_ids = torch.cat([query, response], dim=1)
    attention_mask = torch.cat([query_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(transformers_model(model).forward).parameters


def forward_response(model, batch: Rollout, temperature: float, need_hidden: bool = False,
                     entropy_grad: bool = True):
    """Training-side forward over query+response (B2).

    Returns ``(logprobs (B, T), entropy (B, T), hidden (B, T+1, H) or None)`` where log-probs and
    entropy are of softmax(logits / temperature) — with EOS out of reach before the rollout's
    ``min_new_tokens``, as it was sampled — and ``hidden`` holds the last-layer states s_0 … s_T (for values).
    ``entropy_grad=False``: the entropy is a detached metric, and its (B, T, V) softmax is not kept for backward
    (with a 32k vocabulary that softmax is the largest tensor a training forward saves)."""
    T = batch.response.shape[1]
    input_ids, attention_mask, position_ids = sequence_inputs(batch.query, batch.query_mask,
                                                              batch.response, batch.response_mask)
    kwargs = {"logits_to_keep": T + 1} if _accepts_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                output_hidden_states=need_hidden, use_cache=False, **kwargs)
    # (B, T, V): logits at P-1 … P+T-2, in fp32 before the temperature, as generate processes them (B1; a no-op
    # for an fp32 forward, bf16/fp16 logits under autocast, C5)
    logits = out.logits[:, -(T + 1):-1].float() / temperature
    if batch.min_new_tokens and batch.eos_ids:
        logits = without_early_eos(logits, batch.eos_ids, batch.min_new_tokens)
    logprobs = logprobs_from_logits(logits, batch.response)
    with nullcontext() if entropy_grad else torch.no_grad():
        entropy = entropy_from_logits(logits)
    hidden = out.hidden_states[-1][:, -(T + 1):] if need_hidden else None
    return logprobs, entropy, hidden


def without_early_eos(logits: torch.Tensor, eos_ids: tuple[int, ...], min_new_tokens: int) -> torch.Tensor:
    """(B, T, V) logits with every EOS id out of reach at response positions t < min_new_tokens: the
    distribution ``generate`` samples from under ``min_new_tokens`` (its MinNewTokensLengthLogitsProcessor
    sets them to −inf). The dtype's lowest finite value instead of −inf gives the same softmax (exp underflows
    to exactly 0) and keeps the entropy's p·z term at 0 rather than 0·(−inf) = NaN."""
    banned = torch.zeros(logits.shape[-2:], dtype=torch.bool, device=logits.device)  # (T, V)
    banned[:min_new_tokens, list(eos_ids)] = True
    return logits.masked_fill(banned, torch.finfo(logits.dtype).min)


def critic_values(critic, batch: Rollout, hidden: torch.Tensor | None) -> torch.Tensor | None:
    """V(s_0) … V(s_T), (B, T+1): from the policy's (detached) hidden states for a value head, or from
    a separate critic's own forward; None when the run has no critic (a critic-free estimator, B17)."""
    if critic is None:
        return None
    head = getattr(critic, "module", critic)
    if isinstance(head, ValueHead):
        return critic(hidden.detach())
    T = batch.response.shape[1]
    input_ids, attention_mask, position_ids = sequence_inputs(batch.query, batch.query_mask,
                                                              batch.response, batch.response_mask)
    return critic(input_ids, attention_mask, position_ids)[:, -(T + 1):]
