"""Rollout engines (C3): what samples a step's responses. The PPO step asks its engine for a
:class:`~tether.ppo.records.Rollout` and, before sampling, to take the policy's current weights; log-probs
never come from an engine (B2: the training-side forward recomputes them).

``transformers`` (the default, any device) samples with the trained module itself, so it has nothing to
sync. An engine that holds its own copy of the policy (``vllm``, :mod:`tether.ppo.vllm_engine`) sets
``syncs_weights`` and copies the weights in ``sync_weights``; the step reports that time as
``perf/seconds_weight_sync``. Decisions and limits: docs/sampling.md.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.errors import ConfigError
from tether.hf import DTYPES, context_positions, transformers_model
from tether.ppo.records import Rollout
from tether.ppo.rollout import generate


class Engine(Protocol):
    """A rollout engine: samples exactly softmax(logits / temperature) (or greedy) from the policy's weights
    as of the last ``sync_weights`` (nothing the old weights computed, such as cached prefix K/V, outlives a
    sync), and returns the rollout with its masks and EOS flags (B1)."""

    name: str
    syncs_weights: bool  # False: it reads the trained weights directly and sync_weights does nothing

    def sync_weights(self, model) -> None: ...

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout: ...


class TransformersEngine:
    """``model.generate`` on the (unwrapped) policy being trained: :func:`tether.ppo.rollout.generate`."""

    name = "transformers"
    syncs_weights = False

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def sync_weights(self, model) -> None:
        """Nothing to copy: the engine samples with the trained module itself."""

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout:
        return generate(self.model, self.tokenizer, query, query_mask, max_new_tokens, temperature,
                        greedy=greedy, min_new_tokens=min_new_tokens)


ENGINES = ("transformers", "vllm")


def make_engine(cfg, model, tokenizer, world_size: int = 1) -> Engine:
    """The engine ``cfg.generation.engine`` (``--engine``) over the unwrapped policy ``model``; ``cfg`` is the
    run's :class:`~tether.ppo.config.RunConfig` (the vLLM engine sizes its context and cache from it)."""
    name = cfg.generation.engine
    if name == "transformers":
        return TransformersEngine(model, tokenizer)
    if name == "vllm":
        if world_size > 1:
            raise ConfigError(f"--engine vllm: runs with one process only (this launch has {world_size}); "
                              "use --engine transformers for multi-process runs (docs/sampling.md)")
        from tether.ppo.vllm_engine import VLLMEngine

        base = transformers_model(model)
        max_model_len = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
        max_model_len = min(max_model_len, context_positions(base.config) or max_model_len)
        return VLLMEngine(model, tokenizer, max_model_len, rows=cfg.rows_per_step, seed=cfg.seed,
                          dtype=DTYPES[cfg.model.dtype])
    raise ConfigError(f"--engine: unknown rollout engine {name!r}; available: {', '.join(ENGINES)}")
