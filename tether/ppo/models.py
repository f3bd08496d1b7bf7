"""Load the PPO models: policy (optionally LoRA), reference, critic (value head or separate model).

B3: with LoRA the reference is the policy's own base with the adapter disabled (no second copy);
with a full fine-tune it is a frozen twin of the policy as loaded (:func:`frozen_twin`). B6: the critic is
either a value head on the policy's last hidden state (the backbone is shared and detached) or a separate
backbone with a value head.

C5, mixed precision: with ``--model-dtype bf16`` (or fp16) the checkpoint is loaded in that dtype, everything
that trains is held in fp32 (the masters: the policy, a separate critic, the value head, LoRA adapters), and
every forward of policy, reference and critic, generation included, runs under ``torch.autocast`` in that
dtype (:class:`Precision`). fp32 runs have autocast off and are unchanged.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from torch import nn

from tether.errors import TetherError
from tether.hf import (
    DTYPES,
    apply_lora,
    disable_dropout,
    load_causal_lm,
    load_errors,
    load_failed,
    load_tokenizer,
    quiet_transformers,
    upcast_trainable,
)
from tether.precision import autocast_cast_parameters
from tether.presets import resolve_model_path


def frozen_twin(model: nn.Module) -> nn.Module:
    """The full fine-tune's reference (B3, C5): a frozen copy of the policy as loaded (``model``, in the
    checkpoint's ``--model-dtype``, before :func:`upcast_trainable`), that computes exactly as the policy's fp32
    masters do under autocast. Two rules make it exact:

    - a parameter autocast casts to the compute dtype before use (:func:`autocast_cast_parameters`) stays in
      the loaded dtype: cast(fp32 master) = cast(loaded value) = the loaded value, bit for bit;
    - every other parameter (embeddings, norms, tied weights) is held in fp32 like the policy's, since its
      dtype sets the dtype of the ops that read it: a bf16 embedding would make a bf16 residual stream where
      the policy's is fp32 (a bf16-everywhere reference is 2e-3 off in log-prob on the tiny GPT-2).

    Memory: compute-dtype bytes for the matmul weights, 4 bytes for the rest (embeddings and norms, ~2% of a
    7B model's parameters). For fp32 it is a plain frozen copy."""
    twin = copy.deepcopy(model)
    cast = autocast_cast_parameters(twin)
    for p in twin.parameters():
        if id(p) not in cast and p.is_floating_point():
            p.data = p.data.float()
    return twin.requires_grad_(False).eval()


class Policy(nn.Module):
    """The trained policy and its frozen reference.

    ``reference_mode()`` is a context in which ``self.model`` computes π_ref: the adapter disabled for
    LoRA, or a separate frozen copy for a full fine-tune (``self.reference``)."""

    def __init__(self, model, reference=None):
        super().__init__()
        self.model = model
        self.reference = reference  # None with LoRA
        if reference is not None:
            reference.requires_grad_(False).eval()

    @property
    def is_lora(self) -> bool:
        return self.reference is None

    @contextlib.contextmanager
    def reference_model(self, model=None):
        """Yield the module that computes π_ref (``model`` is the possibly DDP-wrapped policy)."""
        model = model if model is not None else self.model
        if self.reference is not None:
            yield self.reference
        else:
            unwrapped = getattr(model, "module", model)
            with unwrapped.disable_adapter():
                yield model


def load_policy(cfg_model) -> tuple[Policy, object, Path]:
    """Policy (+ LoRA) and reference from ``cfg_model`` (a ``ModelConfig``); returns (policy, tokenizer, path).
    The checkpoint is loaded once, in ``--model-dtype``: LoRA trains fp32 adapters on that frozen base (the
    reference is the base, adapter disabled); a full fine-tune trains fp32 masters of the loaded values, next
    to their :func:`frozen_twin` (the reference), so both start from the same numbers."""
    path = resolve_model_path(cfg_model.policy, what="policy")
    tokenizer = load_tokenizer(path, cfg_model.trust_remote_code)
    model = load_causal_lm(path, cfg_model.dtype, cfg_model.trust_remote_code)
    reference = None
    if cfg_model.lora_r > 0:
        model = apply_lora(model, cfg_model.lora_r, cfg_model.lora_alpha, cfg_model.lora_dropout,
                           cfg_model.lora_target_modules, key="model.lora_target_modules")
    else:
        reference = frozen_twin(model)
        upcast_trainable(model)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg_model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return Policy(model, reference), tokenizer, path


class ValueHead(nn.Module):
    """V(s) from a hidden state: linear, or a 2-layer MLP (hidden → hidden → 1, tanh) as in reference 001."""

    def __init__(self, hidden_size: int, kind: str = "mlp"):
        super().__init__()
        if kind == "linear":
            self.net = nn.Linear(hidden_size, 1)
        else:
            self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))
        # A small last layer keeps the first values near 0, the scale of standardised rewards.
        last = self.net if kind == "linear" else self.net[-1]
        nn.init.normal_(last.weight, std=1.0 / (hidden_size + 1) ** 0.5 * 0.1)
        nn.init.zeros_(last.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S)
        # In fp32 even under autocast: the head is at most H² + 2H + 1 parameters, and bf16 would round a
        # value of 2.0 to a multiple of 2⁻⁶ (8 bits of mantissa), coarser than the advantages it feeds.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.net(hidden.float()).squeeze(-1)


class SeparateCritic(nn.Module):
    """A separate backbone (``AutoModel``) + value head; it reads the policy's token ids, so it must share
    the policy's tokenizer."""

    def __init__(self, backbone, head: ValueHead):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:  # (B, S)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(out.last_hidden_state)


def same_vocabulary(tokenizer_a, tokenizer_b) -> bool:
    return tokenizer_a.get_vocab() == tokenizer_b.get_vocab()


def load_critic(cfg_critic, policy: Policy, tokenizer, default_backbone: Path | None,
                cfg_model=None) -> nn.Module:
    """The critic: a :class:`ValueHead` (kind ``head``) or a :class:`SeparateCritic` (kind ``separate``).
    With ``critic.lora_r`` > 0 the separate critic's backbone is frozen (in ``model.dtype``) under a LoRA
    adapter (the policy's alpha, dropout and target modules); adapter and value head train in fp32."""
    trust_remote_code = bool(cfg_model and cfg_model.trust_remote_code)
    hidden = policy.model.config.get_text_config().hidden_size
    if cfg_critic.kind == "head":
        return ValueHead(hidden, cfg_critic.head)
    from transformers import AutoModel

    source = cfg_critic.model or (str(default_backbone) if default_backbone else "")
    path = resolve_model_path(source, what="critic") if source else None
    if path is None:
        raise TetherError("--critic separate: give --critic-model (no reward model to start from)")
    critic_tokenizer = load_tokenizer(path, trust_remote_code)
    if not same_vocabulary(critic_tokenizer, tokenizer):
        raise TetherError(f"--critic-model {source}: its tokenizer differs from the policy's; a separate "
                          f"critic reads the policy's tokens, so it must share the policy's tokenizer "
                          f"(use --critic head, or a critic built on the policy's tokenizer)")
    lora_r = cfg_critic.lora_r
    dtype = DTYPES[cfg_model.dtype] if lora_r and cfg_model is not None else torch.float32
    try:
        with quiet_transformers():  # a reward-model directory has a score head AutoModel leaves out: expected
            backbone = AutoModel.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    except load_errors() as e:
        raise load_failed(path, "critic model", e) from None
    disable_dropout(backbone)
    hidden_size = backbone.config.get_text_config().hidden_size
    if lora_r:
        m = cfg_model
        backbone = apply_lora(backbone, lora_r, m.lora_alpha if m else 16, m.lora_dropout if m else 0.0,
                              m.lora_target_modules if m else "all-linear", task_type=None,
                              key="model.lora_target_modules")
    return SeparateCritic(backbone, ValueHead(hidden_size, cfg_critic.head))
