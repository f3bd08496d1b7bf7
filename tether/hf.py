"""Loading Hugging Face models and tokenizers: the pieces both stages share (quiet loading, a pad token,
dropout off, dtype names). Shared layer: imports torch and, lazily, transformers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

# One spelling per dtype everywhere (config, CLI, saved runs); the long names are accepted as aliases.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@contextlib.contextmanager
def quiet_transformers():
    """Hide transformers' load reports (\"newly initialized: score.weight\"): tether says it in one line."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def ensure_pad_token(tokenizer, model=None) -> None:
    """Give the tokenizer a pad token if it has none (EOS, else UNK, else a new ``[PAD]``) and tell the
    model's config. Safe because pooling reads the attention mask, not the pad id."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.add_special_tokens({"pad_token": "[PAD]"})
            if model is not None:
                model.resize_token_embeddings(len(tokenizer))
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id


def disable_dropout(model: nn.Module) -> None:
    """PPO needs deterministic forwards: with dropout the first minibatch's ratio would not be 1."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


# Any of these in a model directory means a tokenizer was saved with it. Without one, transformers 5 still
# builds a tokenizer (a GPT-2 one with a 1-token vocabulary) and a run would train on nonsense.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def context_positions(config) -> int | None:
    """How many positions a model's config gives it (GPT-2's ``n_positions``, else ``max_position_embeddings``;
    the text part of a multimodal config); None when it does not say."""
    text_config = config.get_text_config()
    return getattr(text_config, "n_positions", None) or getattr(text_config, "max_position_embeddings", None)


def check_tokenizer_files(path) -> None:
    from tether.errors import TetherError

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise TetherError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.*); save the "
                          f"tokenizer beside the model (tokenizer.save_pretrained)")


def load_errors() -> tuple[type, ...]:
    """What loading a broken model directory raises: missing or corrupt weights (safetensors), a config.json
    that is not JSON, an unknown architecture."""
    from safetensors import SafetensorError

    return OSError, ValueError, TypeError, KeyError, EnvironmentError, SafetensorError


def load_failed(path, what: str, error: Exception):
    """The one-line error for a directory that does not load (first line of the library's message)."""
    from tether.errors import TetherError

    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return TetherError(f"{path}: cannot load the {what} ({type(error).__name__}: {first[:200]})")


def load_tokenizer(path, trust_remote_code: bool = False, *, need_pad: bool = True, need_fast: bool = False):
    """The tokenizer saved in ``path`` (quietly; a one-line TetherError naming ``path`` when it does not load).

    ``need_pad`` (PPO's policy and critic): a tokenizer with no pad token gets EOS as its pad (safe: every
    mask is built from attention masks and the first EOS, never by searching for the pad id), an error when
    it has no EOS either; reward models pass False (training picks a pad itself, ``ensure_pad_token``).
    ``need_fast``: refuse a slow tokenizer (reward models locate the reply in the text by the fast
    tokenizer's character offsets). Transformers' one-time "sequence length is longer than the maximum"
    warning is muted: tether truncates after tokenising, where it must."""
    from transformers import AutoTokenizer

    from tether.errors import TetherError

    check_tokenizer_files(path)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except load_errors() as e:
        raise load_failed(path, "tokenizer", e) from None
    if need_fast and not getattr(tokenizer, "is_fast", False):
        raise TetherError(f"{path}: tether needs a fast tokenizer (tokenizer.json) to locate the reply in the text")
    if need_pad and tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise TetherError(f"{path}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def upcast_trainable(model: nn.Module) -> nn.Module:
    """Every trainable parameter to fp32, in place: the fp32 masters (exact, a bf16/fp16 value is an fp32
    value). Buffers keep their dtype."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            p.data = p.data.float()
    return model


def apply_lora(model, r: int, alpha: float, dropout: float, target_modules: str = "",
               task_type: str | None = "CAUSAL_LM", modules_to_save: list[str] | None = None,
               key: str = "lora.target_modules"):
    """``model`` wrapped in a peft LoRA adapter, every trainable weight in fp32 (A6, C5). ``target_modules``:
    ``"all-linear"``, a comma list of module names, or ``""`` for peft's default for the architecture;
    ``task_type`` ``"CAUSAL_LM"`` (a policy), ``"SEQ_CLS"`` (a reward model) or None (a bare backbone, a
    critic's ``AutoModel``); ``modules_to_save``: modules trained in full beside the adapter (a reward model's
    head). A target peft cannot find is a one-line error naming the config ``key``."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from tether.errors import TetherError

    targets = None if not target_modules else (
        "all-linear" if target_modules == "all-linear"
        else [t.strip() for t in target_modules.split(",") if t.strip()])
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type,
                        modules_to_save=modules_to_save)
    try:
        with warnings.catch_warnings():  # peft notes GPT-2's Conv1D layout and a transformers deprecation
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, config)
    except ValueError as e:
        raise TetherError(f"LoRA: {str(e).splitlines()[0]} (set {key})") from None
    return upcast_trainable(model)


def transformers_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside the wrappers a run puts around it: DDP's ``.module`` and peft's
    ``get_base_model()`` (LoRA layers stay injected and active). Where ``generate``, ``config`` and
    ``generation_config`` live."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def block_mask_for(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """A packed batch's (N, 1, L, L) bool block mask (True = may attend, :mod:`tether.core.packing`) as this model's
    attention takes it: as is for sdpa and flex, additive (0 / the dtype's minimum) for eager, which adds its mask to
    the scores."""
    if transformers_model(model).config._attn_implementation != "eager":
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)


def load_causal_lm(path: str | Path, dtype: str = "fp32", trust_remote_code: bool = False, dropout: bool = False):
    """A causal LM from a local directory in ``dtype``, dropout off (``dropout``: as its config sets it, for SFT);
    a directory that is not one (an encoder, a classifier, missing or corrupt weights) is a one-line error."""
    from transformers import AutoModelForCausalLM

    from tether.errors import TetherError

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
    except ValueError as e:  # e.g. an encoder or a sequence-classification checkpoint
        if "Unrecognized configuration class" in str(e) or "Unrecognized model" in str(e):
            raise TetherError(f"{path}: not a causal language model ({str(e).splitlines()[0][:200]})") from None
        raise load_failed(path, "model", e) from None
    except load_errors() as e:  # missing or corrupt weights, a config.json that is not JSON
        raise load_failed(path, "model", e) from None
    if not dropout:
        disable_dropout(model)
    return model


def causal_lm_skeleton(path: str | Path, dtype: str = "fp32", trust_remote_code: bool = False):
    """The causal LM of ``path`` without its weights: built on the meta device from its config.json, with the
    checkpoint's generation config (its EOS ids decide where a response ends). What an engine that takes the weights
    by a sync starts from: it allocates none of them (a vLLM rollout process holds vLLM's copy only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    except (ValueError, *load_errors()) as e:
        raise load_failed(path, "model", e) from None
    with contextlib.suppress(OSError):  # no generation_config.json: the one from_config derived stays
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model
