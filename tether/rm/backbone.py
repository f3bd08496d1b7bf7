"""The reward model's backbone, shared by outcome (:mod:`tether.rm.model`) and process (:mod:`tether.rm.process`)
reward models: padding, the hidden states and the one-output head, pooling, loading a sequence classifier.

- **Pooling.** Causal LMs: score = head(h_last), h_last the last hidden state at the last position whose
  attention mask is 1. Found from the mask, never by searching for the pad id, so it is right under left,
  right or no padding and when PAD = EOS (HF's own pooling searches for pad_token_id and picks the
  token *before* a final EOS when PAD = EOS). Encoders (BERT-like) keep their own pooling (the logits)
  unless ``mean`` is asked for: score = head(masked mean of the last hidden states), the pooling that
  sentence-embedding encoders (MiniLM) were trained with.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Sequence

import torch

from tether.errors import TetherError
from tether.hf import load_errors, quiet_transformers, transformers_model

HEAD_NAMES = ("score", "classifier", "pre_classifier")  # randomly initialised heads of HF seq-cls models


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both (B, T) with T the longest row; padded on ``side``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(seqs):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask



POOLINGS = ("last_token", "mean", "model")


def pooling_of(model) -> str:
    """``"last_token"`` for models with a linear ``score`` head on a decoder (GPT-2, Llama, Qwen, …),
    ``"model"`` (the model's own logits, e.g. BERT's [CLS] pooler + classifier) otherwise."""
    head = getattr(transformers_model(model), "score", None)
    head = getattr(head, "original_module", head)  # peft's modules_to_save wrapper keeps the original
    return "last_token" if isinstance(head, torch.nn.Linear) else "model"


def linear_head(model):
    """The one-output linear head that ``last_token``/``mean`` pooling feed: ``score`` (decoders) or
    ``classifier`` (BERT-like encoders); None when the model has neither as a plain linear layer."""
    hf = transformers_model(model)
    for name in ("score", "classifier"):
        head = getattr(hf, name, None)
        if isinstance(getattr(head, "original_module", head), torch.nn.Linear):
            return head  # the peft wrapper itself when there is one: it routes to the trained copy
    return None


def check_pooling(model, pooling: str) -> str:
    """``pooling`` resolved (``"auto"`` → :func:`pooling_of`) and checked against the model's head."""
    if pooling == "auto":
        return pooling_of(model)
    if pooling not in POOLINGS:
        raise TetherError(f"pooling must be auto or one of {', '.join(POOLINGS)}, got {pooling!r}")
    if pooling != "model" and linear_head(model) is None:
        raise TetherError(f"pooling '{pooling}' needs a linear 'score' or 'classifier' head; "
                          f"{type(transformers_model(model)).__name__} has neither (use pooling 'model')")
    return pooling


def _accepts(module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def last_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) last hidden states of the backbone without its head; position ids count real tokens only
    (cumsum of the mask) so left padding does not shift positions."""
    body = transformers_model(model).base_model  # GPT2Model, LlamaModel, …: the backbone without the head
    kwargs = {}
    if _accepts(body, "position_ids"):
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    if _accepts(body, "use_cache"):
        kwargs["use_cache"] = False
    return body(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def pooled_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Raw scores (B,) float32 of padded rows ``input_ids``/``attention_mask`` (B, T).

    ``last_token``: r = w·h[b, t_b] (+ bias), t_b = the last t with attention_mask[b, t] = 1, so padding on
    either side, or none, gives the same score; position ids count real tokens only (cumsum of the mask)
    so left padding does not shift positions. ``mean``: r = w·(Σ_t m[b,t]·h[b,t] / Σ_t m[b,t]) (+ bias),
    every real token (special ones included, as sentence-transformers does). ``model``: the model's own
    pooled logits.
    """
    if pooling == "model":
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()
    hidden = last_hidden_states(model, input_ids, attention_mask)  # (B, T, H)
    if pooling == "mean":
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)  # (B, H)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        last = (positions * attention_mask).argmax(-1)  # (B,) last position with mask 1
        pooled = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]  # (B, H)
    return linear_head(model)(pooled)[:, 0].float()  # (B,)


def load_sequence_classifier(path: str | Path, *, dtype: torch.dtype | str | None = None, new_head: bool = False):
    """``AutoModelForSequenceClassification`` from a local directory; ``new_head``: one output, a head
    initialised randomly when the checkpoint has none (e.g. a causal LM). Returns ``(model, head_is_new)``."""
    from transformers import AutoModelForSequenceClassification

    kwargs = {"num_labels": 1, "ignore_mismatched_sizes": True} if new_head else {}
    try:
        with quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=dtype, output_loading_info=True, **kwargs)
    except ValueError as e:
        raise TetherError(f"{path}: cannot load as a sequence classifier ({str(e).splitlines()[0]})") from None
    except load_errors() as e:  # missing or corrupt weights (safetensors), a config.json that is not JSON
        raise TetherError(f"{path}: cannot load model weights ({str(e).splitlines()[0]})") from None
    if model.config.num_labels != 1:
        raise TetherError(f"{path}: a reward model has one output, this one has {model.config.num_labels}")
    names = list(info.get("missing_keys", [])) + [m[0] if isinstance(m, tuple) else m
                                                  for m in info.get("mismatched_keys", [])]
    return model, any(n.split(".")[0] in HEAD_NAMES for n in names)


def head_modules(model) -> list[str]:
    """The names of ``model``'s head modules (:data:`HEAD_NAMES` it has): trained in full beside a LoRA adapter."""
    return [n for n in HEAD_NAMES if isinstance(getattr(model, n, None), torch.nn.Module)]
