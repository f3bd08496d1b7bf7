"""Load the PPO models: policy (optionally LoRA), reference, critic (value head or separate model).

B3: with LoRA the reference is the policy's own base with the adapter disabled (no second copy);
with a full fine-tune it is a frozen copy loaded from the same directory. B6: the critic is either a
value head on the policy's last hidden state (the backbone is shared and detached) or a separate
backbone with a value head. C5: trainable weights are kept in fp32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from tether.errors import TetherError
from tether.hf import DTYPES, check_tokenizer_files, disable_dropout, load_errors, load_failed, quiet_transformers
from tether.presets import resolve_model_path


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer of ``path`` with a pad token (EOS when it has none: safe, since every mask is
    built from attention masks and the first EOS, never by searching for the pad id)."""
    from transformers import AutoTokenizer

    check_tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except load_errors() as e:
        raise load_failed(path, "tokenizer", e) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise TetherError(f"{path}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str | Path, dtype: str = "fp32", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
    except ValueError as e:  # e.g. an encoder or a sequence-classification checkpoint
        if "Unrecognized configuration class" in str(e) or "Unrecognized model" in str(e):
            raise TetherError(f"{path}: not a causal language model ({str(e).splitlines()[0][:200]})") from None
        raise load_failed(path, "model", e) from None
    except load_errors() as e:  # missing or corrupt weights, a config.json that is not JSON
        raise load_failed(path, "model", e) from None
    disable_dropout(model)
    return model


def apply_lora(model, r: int, alpha: int, dropout: float, target: str, task_type: str | None = "CAUSAL_LM"):
    """Wrap ``model`` with a peft LoRA adapter; adapter weights in fp32. ``task_type`` None for a bare
    backbone (a critic's ``AutoModel``)."""
    from peft import LoraConfig, get_peft_model

    targets = "all-linear" if target == "all-linear" else [t.strip() for t in target.split(",") if t.strip()]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type=task_type)
    model = get_peft_model(model, config)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


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
    """Policy (+ LoRA) and reference from ``cfg_model`` (a ``ModelConfig``); returns (policy, tokenizer, path)."""
    path = resolve_model_path(cfg_model.policy, what="policy")
    tokenizer = load_tokenizer(path, cfg_model.trust_remote_code)
    model = load_causal_lm(path, "fp32" if cfg_model.lora_r == 0 else cfg_model.dtype,
                           cfg_model.trust_remote_code)
    reference = None
    if cfg_model.lora_r > 0:
        model = apply_lora(model, cfg_model.lora_r, cfg_model.lora_alpha, cfg_model.lora_dropout,
                           cfg_model.lora_target_modules)
    else:
        reference = load_causal_lm(path, cfg_model.dtype, cfg_model.trust_remote_code)
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
                              m.lora_target_modules if m else "all-linear", task_type=None)
    return SeparateCritic(backbone, ValueHead(hidden_size, cfg_critic.head))
