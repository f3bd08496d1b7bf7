"""Rollout engines (C3): what samples a step's responses. The PPO step asks its engine for a
:class:`~tether.rollout.records.Rollout` and, before sampling, to take the policy's current weights. PPO's old
log-probs never come from an engine (B2: the training-side forward recomputes them); an engine's own log-probs of
its samples (``Rollout.logprobs_sampler``) are kept beside them, for the mismatch metrics and the off-policy
correction (B19).

``transformers`` (the default, any device) samples with the trained module itself, so it has nothing to
sync. An engine that holds its own copy of the policy sets ``syncs_weights`` and copies the weights in
``sync_weights``, block by block (:mod:`tether.rollout.weights`): ``vllm`` in each process (:mod:`tether.rollout.vllm_engine`,
the colocated layout; ``--engine-tp K``: one engine per K processes), or the rollout processes of the
disaggregated layout (``--rollout-processes R``: :mod:`tether.rollout.remote`, the same seam on the trainers). The step
reports that time as ``perf/seconds_weight_sync`` = gather + transfer. Decisions and limits: docs/sampling.md.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.errors import ConfigError
from tether.hf import DTYPES, context_positions, transformers_model
from tether.rollout.records import Rollout
from tether.rollout.sampling import generate
from tether.rollout.weights import SyncSeconds
from tether.sharding import gathered


class Engine(Protocol):
    """A rollout engine: samples exactly softmax(logits / temperature) (or greedy) from the policy's weights
    as of the last ``sync_weights`` (nothing the old weights computed, such as cached prefix K/V, outlives a
    sync), and returns the rollout with its masks and EOS flags (B1)."""

    name: str
    syncs_weights: bool  # False: it reads the trained weights directly and sync_weights does nothing
    collective: bool     # True: every process calls generate together (evaluation then runs on every process)
    sync_seconds: SyncSeconds  # the last sync's gather / transfer split (zeros when nothing is synced)

    def sync_weights(self, model) -> None: ...

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout: ...

    def close(self) -> None: ...  # the end of the run, before the process group goes


class TransformersEngine:
    """``model.generate`` on the (unwrapped) policy being trained: :func:`tether.rollout.sampling.generate`. Under FSDP2
    (``fsdp`` set) the policy is gathered once for the whole generation (:func:`tether.sharding.gathered`:
    the full policy on every process meanwhile), which makes generate collective."""

    name = "transformers"
    syncs_weights = False

    def __init__(self, model, tokenizer, fsdp=None, sampler_logprobs: bool = False):
        """``sampler_logprobs``: also report the sampler's own log-probs (a rollout process's engine, for the gap
        metric; it holds the (B, V) processed scores of every sampled position meanwhile)."""
        self.model, self.tokenizer, self.fsdp, self.sampler_logprobs = model, tokenizer, fsdp, sampler_logprobs
        self.collective = fsdp is not None
        self.sync_seconds = SyncSeconds()

    def sync_weights(self, model) -> None:
        """Nothing to copy: the engine samples with the trained module itself."""

    def load_weights(self, weights) -> None:
        """Take (checkpoint name, tensor) pairs as the module's own tensors (a rollout process's copy of the policy:
        the tensors arrive in the trainer's dtypes and are used as they are, no cast)."""
        from tether.errors import TetherError

        own = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(self.model.named_buffers(remove_duplicate=False))
        for name, tensor in weights:
            if name not in own or own[name].shape != tensor.shape:
                raise TetherError(f"weight sync: {name} {tuple(tensor.shape)} does not match the rollout process's "
                                  f"policy ({tuple(own[name].shape) if name in own else 'no such tensor'})")
            own[name].data = tensor.to(own[name].device)

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout:
        with gathered(self.model, self.fsdp):
            return generate(self.model, self.tokenizer, query, query_mask, max_new_tokens, temperature,
                            greedy=greedy, min_new_tokens=min_new_tokens, sampler_logprobs=self.sampler_logprobs)

    def close(self) -> None:
        """Nothing held."""


ENGINES = ("transformers", "vllm")


def make_engine(cfg, model, tokenizer, processes=None) -> Engine:
    """The rollout engine of this trainer process over the unwrapped policy ``model``: ``cfg.generation.engine``
    (``--engine``) here, or the rollout processes (``--rollout-processes``, :class:`~tether.rollout.remote.RemoteEngine`
    over ``processes.link``). ``cfg`` is the run's :class:`~tether.ppo.config.RunConfig` (the vLLM engine sizes
    its context and cache from it); ``processes`` the :class:`~tether.ppo.processes.Processes` (one process when
    None)."""
    name = cfg.generation.engine
    world, fsdp = (processes.world_size, processes.fsdp) if processes is not None else (1, None)
    if getattr(processes, "link", None) is not None:
        from tether.rollout.remote import RemoteEngine

        return RemoteEngine(processes.link, model, tokenizer, sharded=fsdp is not None, dtype=DTYPES[cfg.model.dtype])
    if name == "transformers":  # its own log-probs only where the off-policy correction reads them (B19)
        correction = getattr(cfg, "correction", None)  # PPO's; SFT's evaluation and tether sample have none
        return TransformersEngine(model, tokenizer, fsdp,
                                  sampler_logprobs=correction is not None and correction.mode != "none")
    if name == "vllm":
        tp = cfg.generation.engine_tp
        if world % tp:
            raise ConfigError(f"--engine-tp {tp}: does not divide this launch's {world} training process(es); each "
                              "engine takes --engine-tp consecutive processes")
        from tether.rollout.vllm_engine import VLLMEngine

        base = transformers_model(model)
        max_model_len = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
        max_model_len = min(max_model_len, context_positions(base.config) or max_model_len)
        return VLLMEngine(model, tokenizer, max_model_len, rows=cfg.rows_per_step, seed=cfg.seed,
                          dtype=DTYPES[cfg.model.dtype], tp=tp)
    raise ConfigError(f"--engine: unknown rollout engine {name!r}; available: {', '.join(ENGINES)}")
