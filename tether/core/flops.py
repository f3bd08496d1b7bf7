"""Model FLOPs of decoder forwards and backwards, counted from the model's shapes (for ``perf/mfu``, C6).

A multiply-add is 2 FLOPs. For one token of a decoder with L layers of width d:

  weights:    2·N        every weight matrix is used once per token (N = parameters of the matmuls:
                         the layers, and the LM head's d·V when logits are computed; not the embeddings,
                         which are looked up, not multiplied)
  attention:  4·L·d·c    QKᵀ and A·V over c keys

A forward over a sequence of S tokens computes the full S×S scores (c = S, the causal mask is applied
after the matmul): 2·N·S + 4·L·d·S² — PaLM's model-FLOPs convention (Chowdhery et al. 2022, App. B:
6N + 12·L·d·S per trained token). Generating with a KV cache, each new token attends to the c positions
cached so far. A backward is twice its forward (Narayanan et al. 2021). These are *model* FLOPs: padding
and recomputation are not counted, so work spent on them shows as a lower MFU (see ``perf/padding_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopShape:
    """What the count needs of a model: matmul parameters (without / with the LM head), layers, width."""

    matmul_params: int     # weights multiplied per token in the body (embeddings excluded)
    head_params: int       # the LM head's d·V (0 for a backbone with a scalar/value head: counted in matmul)
    layers: int
    width: int


def forward_flops(shape: FlopShape, length: int, with_head: bool = True) -> float:
    """Forward over ``length`` tokens: 2·N·S + 4·L·d·S², N with the head when ``with_head``."""
    n = shape.matmul_params + (shape.head_params if with_head else 0)
    return 2.0 * n * length + 4.0 * shape.layers * shape.width * length * length


def generation_flops(shape: FlopShape, prompt_length: int, new_tokens: int) -> float:
    """Sampling ``new_tokens`` after ``prompt_length`` with a KV cache: the prompt's forward (prefill, logits at
    its last position only) plus one single-token step per new token after the first, each attending to
    every cached position. Σ over steps of 2·N + 4·L·d·c."""
    if new_tokens <= 0:
        return 0.0
    prefill = forward_flops(shape, prompt_length, with_head=False) + 2.0 * shape.head_params
    n = shape.matmul_params + shape.head_params
    steps = new_tokens - 1  # the first new token comes from the prefill's logits
    # keys attended at step t (t = 1 … steps): prompt_length + t
    keys = steps * prompt_length + steps * (steps + 1) / 2
    return prefill + 2.0 * n * steps + 4.0 * shape.layers * shape.width * keys


def train_flops(forward: float) -> float:
    """Forward + backward (backward = 2 × forward)."""
    return 3.0 * forward
