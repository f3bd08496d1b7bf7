"""A trained policy written as a plain Hugging Face directory, shared by the stages that train one (PPO's
``RUN_DIR/policy``, SFT's output directory):

- a full fine-tune: the model as it is;
- LoRA, ``merged`` (the default): the adapter merged into a copy of the base, a plain model;
- LoRA, ``adapter``: the adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``), loaded with
  ``peft.PeftModel.from_pretrained(base, DIR)`` over the policy's base model;

with the tokenizer (and its chat template) beside it. The weights are written in the run's ``--model-dtype``: a
bf16 run exports bf16 weights (its fp32 masters are rounded once, here; they stay whole in the checkpoints, which
a resume reads), an fp32 run fp32 ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tether.checkpoint import save_pretrained
from tether.hf import DTYPES


def write_policy(directory: Path, model, tokenizer, lora: str = "merged", dtype: str = "fp32",
                 state: dict | None = None) -> None:
    """Write ``model`` (unwrapped; a peft model for LoRA) and ``tokenizer`` into ``directory`` (see the module
    docstring). ``state``: the full state dict of a sharded model (FSDP2, gathered by the caller), written in place
    of the module's own. The caller checks the weights are finite and makes the write atomic."""
    target = DTYPES[dtype]
    if hasattr(model, "peft_config") and lora == "adapter":  # peft keeps the adapter's keys of the state given
        adapter = {k: v.to(target) for k, v in (state or model.state_dict()).items() if "lora_" in k}
        model.save_pretrained(directory, state_dict=adapter, safe_serialization=True)
    else:
        plain = merged_lora_copy(model, state) if hasattr(model, "peft_config") else model
        weights = state if plain is model else None
        if target != torch.float32:  # rounded once from the fp32 masters
            weights = {k: v.to(target) if v.is_floating_point() else v
                       for k, v in (weights if weights is not None else plain.state_dict()).items()}
        save_pretrained(plain, directory, weights)
        if target != torch.float32:
            set_config_dtype(Path(directory) / "config.json", target)
    tokenizer.save_pretrained(directory)


def set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """``config.json`` names the dtype its weights are stored in (transformers writes that of the module's
    parameters, the fp32 masters), so that ``from_pretrained`` loads them as they are."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    name = str(dtype).split(".")[1]
    config.update({key: name for key in ("dtype", "torch_dtype") if key in config} or {"dtype": name})
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def merged_lora_copy(model, state: dict | None):
    """A plain copy of the LoRA policy with the adapter merged. ``state``: the full state dict of a sharded
    policy (its base is reloaded from the adapter's base path and the state loaded into it)."""
    import copy

    if state is None:
        return copy.deepcopy(model).merge_and_unload()
    from peft import get_peft_model

    from tether.hf import load_causal_lm

    config = copy.deepcopy(model.peft_config["default"])
    dtype = next(v.dtype for k, v in state.items() if "lora_" not in k and v.is_floating_point())
    base = load_causal_lm(config.base_model_name_or_path, {torch.float32: "fp32", torch.bfloat16: "bf16",
                                                           torch.float16: "fp16"}[dtype])
    plain = get_peft_model(base, config)
    plain.load_state_dict(state, strict=True)
    return plain.merge_and_unload()
