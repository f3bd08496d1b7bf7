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
from dataclasses import dataclass

import torch

from tether.core.stats import entropy_from_logits, logprobs_from_logits
from tether.hf import block_mask_for, transformers_model
from tether.ppo.config import LOGIT_CHUNK_TOKENS
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


@dataclass(frozen=True)
class ForwardOptions:
    """How the training-side forward computes; the same for every forward of a run (scoring, training,
    evaluation), so that the policy and the reference compute alike (KL exactly 0 before an update) and the first
    minibatch's ratio is 1. :func:`checked_forward_options` verifies them on the model at set-up.

    ``own_head``: log-probs from the last hidden state through the model's output embedding, only at the valid
    response tokens and ``chunk_tokens`` of them at a time (never the (B, T, V) logits; with gradients each chunk's
    logits are recomputed in backward); off: the model's own logits, (B, T, V), the only way for a model that
    post-processes its logits (soft-capping, scaling). ``packing`` (``ppo.packing``): each distinct prompt once,
    followed by its responses, in packed rows with a block attention mask (:mod:`tether.core.packing`)."""

    own_head: bool = False
    packing: bool = False
    chunk_tokens: int = 1024


def forward_response(model, batch: Rollout, temperature: float, need_hidden: bool = False,
                     entropy_grad: bool = True, need_entropy: bool = True,
                     options: ForwardOptions = ForwardOptions()):
    """Training-side forward over query+response (B2).

    Returns ``(logprobs (B, T), entropy (B, T) or None, hidden (B, T+1, H) or None)`` where log-probs and
    entropy are of softmax(logits / temperature) — with EOS out of reach before the rollout's
    ``min_new_tokens``, as it was sampled — and ``hidden`` holds the last-layer states s_0 … s_T (for values).
    ``entropy_grad=False``: the entropy is a detached metric, and its softmax is not kept for backward;
    ``need_entropy=False``: not computed at all (None). With ``options.own_head`` the log-probs and entropy are 0
    past each row's end (nothing reads them there); hidden states past the end repeat the row's last state."""
    T = batch.response.shape[1]
    need_states = need_hidden or options.own_head
    if options.packing:  # packed rows give hidden states only: the log-probs come through the output embedding
        options = ForwardOptions(own_head=True, packing=True, chunk_tokens=options.chunk_tokens)
        hidden = packed_hidden_states(model, batch)  # (B, T+1, H)
    else:
        input_ids, attention_mask, position_ids = sequence_inputs(batch.query, batch.query_mask,
                                                                  batch.response, batch.response_mask)
        keep = 1 if options.own_head else T + 1  # own_head: the model's lm-head on one position only
        kwargs = {"logits_to_keep": keep} if _accepts_logits_to_keep(model) else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    output_hidden_states=need_states, use_cache=False, **kwargs)
        hidden = out.hidden_states[-1][:, -(T + 1):] if need_states else None
    if options.own_head:
        head = transformers_model(model).get_output_embeddings()
        logprobs, entropy = head_logprobs(head, hidden[:, :-1], batch, temperature, options.chunk_tokens,
                                          need_entropy, entropy_grad)
        return logprobs, entropy, hidden if need_hidden else None
    # (B, T, V): logits at P-1 … P+T-2, in fp32 before the temperature, as generate processes them (B1; a no-op
    # for an fp32 forward, bf16/fp16 logits under autocast, C5)
    logits = out.logits[:, -(T + 1):-1].float() / temperature
    if batch.min_new_tokens and batch.eos_ids:
        logits = without_early_eos(logits, batch.eos_ids, batch.min_new_tokens)
    logprobs = logprobs_from_logits(logits, batch.response)
    entropy = None
    if need_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logprobs, entropy, hidden if need_hidden else None


def head_logprobs(head, states: torch.Tensor, batch: Rollout, temperature: float, chunk_tokens: int,
                  need_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens from the states that predict them, ``states`` (B, T, H)
    (s_t predicts token t), through the output embedding ``head``, at the valid tokens only, ``chunk_tokens`` at a
    time: per chunk (C, V) logits in fp32 / temperature, log p = z_token − logsumexp(z) (and H = logsumexp(z) −
    Σ softmax(z)·z), so no (B, T, V) tensor is ever made. With gradients each chunk runs under activation
    checkpointing: its logits are recomputed in backward instead of being kept. (B, T) each, 0 past the ends."""
    mask = batch.response_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)                       # (n,) the valid tokens
    picked_states = states[rows, cols]                             # (n, H)
    tokens = batch.response[rows, cols]                            # (n,)
    banned = (cols < batch.min_new_tokens) if (batch.min_new_tokens and batch.eos_ids) else None
    grad = torch.is_grad_enabled() and picked_states.requires_grad
    lp_chunks, ent_chunks = [], []
    for start in range(0, len(tokens), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (picked_states[part], tokens[part], None if banned is None else banned[part])

        def chunk(s, tok, ban, with_entropy=need_entropy):
            return _chunk_logprobs(head, s, tok, ban, batch.eos_ids, temperature, with_entropy)
        if grad:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(chunk, *args, use_reentrant=False)
        else:
            lp, ent = chunk(*args)
        lp_chunks.append(lp)
        if ent is not None:
            ent_chunks.append(ent if entropy_grad else ent.detach())
    logprobs = _scatter(mask, torch.cat(lp_chunks) if lp_chunks else states.new_zeros(0, dtype=torch.float32))
    entropy = None
    if need_entropy:
        entropy = _scatter(mask, torch.cat(ent_chunks) if ent_chunks else states.new_zeros(0, dtype=torch.float32))
    return logprobs, entropy


def _chunk_logprobs(head, states, tokens, banned, eos_ids, temperature: float, with_entropy: bool):
    """(C,) log p(token) and (C,) entropy (or None) of one chunk's (C, V) fp32 logits / temperature."""
    logits = head(states).float() / temperature  # (C, V)
    if banned is not None:
        eos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        eos[list(eos_ids)] = True
        logits = logits.masked_fill(banned[:, None] & eos[None, :], torch.finfo(logits.dtype).min)
    return logprobs_from_logits(logits, tokens), entropy_from_logits(logits) if with_entropy else None


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(n,) values of the True positions of ``mask`` (B, T), in row-major order, as a (B, T) tensor, 0 elsewhere
    (differentiable)."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask, values)


def packed_hidden_states(model, batch: Rollout) -> torch.Tensor:
    """The last-layer states s_0 … s_T of every row, (B, T+1, H), from one forward over packed rows: each distinct
    prompt once with all its rows' responses (their valid tokens) after it (:func:`tether.core.packing.pack_units`).
    s_0 is the prompt's last state; s_t (t ≥ 1) the state at response token t−1; past a row's end the last state
    repeats (s_T of a row of length L is its state at token L−1, the truncation bootstrap's V(s_T))."""
    packed, rows_of_unit = pack_rollout(batch)
    mask = block_mask_for(model, packed.attention_mask)
    out = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                output_hidden_states=True, use_cache=False,
                **({"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}))
    flat = out.hidden_states[-1].reshape(-1, out.hidden_states[-1].shape[-1])  # (N·L, H)
    T = batch.response.shape[1]
    index = torch.zeros((len(batch), T + 1), dtype=torch.long, device=flat.device)
    for u, rows in enumerate(rows_of_unit):
        last_prompt = packed.prefix_index[u][-1]
        for k, b in enumerate(rows):
            states = torch.cat([last_prompt.view(1), packed.suffix_index[u][k]])  # s_0 … s_L
            index[b, :len(states)] = states
            index[b, len(states):] = states[-1]
    return flat[index]


def pack_rollout(batch: Rollout):
    """The rollout's rows as units of :func:`tether.core.packing.pack_units`: rows with the same prompt tokens
    share a unit (their prompt stored once), each row's valid response tokens a suffix. Returns ``(packed,
    rows_of_unit)``, the rollout rows of each unit in suffix order."""
    from tether.core.packing import pack_units

    units: dict[tuple, int] = {}
    prefixes, suffixes, rows_of_unit = [], [], []
    lengths = batch.lengths.tolist()
    for b in range(len(batch)):
        prompt = batch.query[b][batch.query_mask[b].bool()]
        key = tuple(prompt.tolist())
        if key not in units:
            units[key] = len(prefixes)
            prefixes.append(prompt)
            suffixes.append([])
            rows_of_unit.append([])
        u = units[key]
        suffixes[u].append(batch.response[b, :lengths[b]])
        rows_of_unit[u].append(b)
    pad = int(batch.query[0][0]) if len(batch) else 0  # any id: padding positions are never read
    return pack_units(prefixes, suffixes, pad), rows_of_unit


@torch.no_grad()
def checked_forward_options(model, packing: bool, chunk_tokens: int = LOGIT_CHUNK_TOKENS) -> ForwardOptions:
    """The :class:`ForwardOptions` this model supports, checked once on a made-up batch (three rows, two sharing a
    prompt): the output-embedding path is used when its log-probs equal the model's own logits' (a model that
    post-processes logits is left on the logits path), and packing, when asked, only when the packed forward
    equals the padded one (a model that ignores a 4D attention mask or position ids is refused in one line).
    Tolerance: 1e-3 nats in fp32 (measured gaps are ~1e-5 on SmolLM2-135M), 5e-2 when the weights are in bf16/fp16."""
    from tether.errors import ConfigError

    base = transformers_model(model)
    vocab = base.get_output_embeddings().weight.shape[0] if base.get_output_embeddings() is not None else 0
    device = next(base.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(min(vocab, 1000), 4), (3, 6), generator=g).to(device)
    query = ids[:, :3].clone()
    query[1] = query[0]                      # rows 0 and 1 share their prompt
    query_mask = torch.ones_like(query)
    query_mask[2, 0] = 0                     # row 2 left-padded
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], device=device)
    batch = Rollout(query=query, query_mask=query_mask, response=ids[:, 3:] * response_mask,
                    response_mask=response_mask, ended_with_eos=torch.tensor([False, True, True], device=device))
    mask = response_mask.bool()
    tolerance = 1e-3 if next(base.parameters()).dtype == torch.float32 else 5e-2
    was_training = model.training
    model.eval()
    try:
        reference, _, _ = forward_response(model, batch, 1.0, need_entropy=False)
        own_ok = vocab > 0 and _close(forward_response(model, batch, 1.0, need_entropy=False,
                                                       options=ForwardOptions(own_head=True))[0], reference, mask,
                                      tolerance)
        if packing:
            packed = ForwardOptions(own_head=True, packing=True, chunk_tokens=chunk_tokens)
            if not own_ok or not _close(forward_response(model, batch, 1.0, need_entropy=False, options=packed)[0],
                                        reference, mask, tolerance):
                raise ConfigError(f"ppo.packing: {type(base).__name__} does not compute packed rows as it computes "
                                  "padded ones (it ignores a 4D attention mask or position ids, or post-processes "
                                  "its logits); set ppo.packing false")
    finally:
        model.train(was_training)
    return ForwardOptions(own_head=own_ok, packing=packing, chunk_tokens=chunk_tokens)


def resolved_forward_options(cfg, fsdp: bool, model) -> tuple[ForwardOptions, list[str]]:
    """``ppo.packing`` resolved for this run, and the start-up lines to print. True: packed rows, refused in one
    line under FSDP2 or where the self-check fails; null (the default): packed when K > 1 (``--samples-per-prompt``:
    a prompt shared by its K rows is computed once) and the self-check passes, else padded, saying why where K > 1;
    False (``--no-packing``): padded rows. Under FSDP2 always the model's own logits: its output embedding is
    sharded outside the model's forward."""
    from tether.errors import ConfigError, TetherError

    asked = cfg.ppo.packing
    if fsdp:
        if asked:
            raise TetherError("ppo.packing under FSDP2: not supported (the log-probs of packed rows come through the "
                              "output embedding, which FSDP2 holds sharded outside its own forward); use DDP")
        return ForwardOptions(), []
    if asked is None and cfg.samples_per_prompt > 1:
        try:
            return checked_forward_options(model, True), []
        except ConfigError as e:
            return checked_forward_options(model, False), [f"packing off (on by default for K > 1 where exact): {e}"]
    return checked_forward_options(model, bool(asked)), []


def _close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, tolerance: float) -> bool:
    return bool(((a - b).abs()[mask] <= tolerance).all())


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
