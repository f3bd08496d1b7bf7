"""Model shapes for the memory planner: the decoder's sizes and exact parameter counts, from a named
preset (7b, 8b, …) or a Hugging Face ``config.json``, and the LoRA targets per family. See docs/plan.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tether.errors import TetherError


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shapes and parameter counts (from a preset or a config.json)."""

    name: str
    family: str  # llama | mistral | qwen2 | qwen3 | gpt2
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    backbone_params: int  # embeddings + layers + final norm (AutoModel)
    lm_params: int  # AutoModelForCausalLM: backbone + LM head (0 extra when tied)
    lora_shapes: dict  # "attn"/"mlp" -> ((in, out), ...) of the LoRA target projections of one layer
    nominal_params: int | None = None  # presets: the size in the name, used for every model's static memory
    # Every parameter tensor as (dim 0, numel, autocast-cast), in module order: what FSDP2 shards (row-wise,
    # dim 0) and what the bf16 reference twin keeps in bf16 (cast = a Linear/Conv1D weight or bias, untied).
    backbone_tensors: tuple = ()  # AutoModel
    lm_tensors: tuple = ()  # AutoModelForCausalLM: the backbone + an untied LM head


def _gpt2_tensors(d: int, L: int, V: int, P: int, ff: int) -> list[tuple[int, int, bool]]:
    """GPT-2's parameters; its Conv1D weights are (in, out), so dim 0 is the input size."""
    def norm():
        return [(d, d, False), (d, d, False)]  # LayerNorm weight, bias

    layer = (norm() + [(d, d * 3 * d, True), (3 * d, 3 * d, True), (d, d * d, True), (d, d, True)] + norm()
             + [(d, d * ff, True), (ff, ff, True), (ff, ff * d, True), (d, d, True)])
    return [(V, V * d, False), (P, P * d, False)] + layer * L + norm()


def _llama_tensors(family: str, c: dict, d: int, L: int, V: int, q: int, k: int, ff: int, hd: int
                   ) -> list[tuple[int, int, bool]]:
    """A Llama-like model's parameters; ``nn.Linear`` weights are (out, in), so dim 0 is the output size."""
    bias_qkv = family == "qwen2" or c.get("attention_bias", False)
    bias_o = family != "qwen2" and c.get("attention_bias", False)
    mlp_bias = c.get("mlp_bias", False)

    def linear(i: int, o: int, bias: bool) -> list[tuple[int, int, bool]]:
        return [(o, o * i, True)] + ([(o, o, True)] if bias else [])

    layer = (linear(d, q, bias_qkv) + linear(d, k, bias_qkv) + linear(d, k, bias_qkv) + linear(q, d, bias_o)
             + ([(hd, hd, False), (hd, hd, False)] if family == "qwen3" else [])  # q_norm, k_norm
             + linear(d, ff, mlp_bias) + linear(d, ff, mlp_bias) + linear(ff, d, mlp_bias)
             + [(d, d, False), (d, d, False)])  # input and post-attention RMSNorm
    return [(V, V * d, False)] + layer * L + [(d, d, False)]


# name -> (nominal params, family, L, d, n_h, n_kv, d_ff, V, tied, shapes of)
PRESETS = {
    "0.5b": (0.5e9, "qwen2", 24, 896, 14, 2, 4864, 151936, True, "Qwen2.5-0.5B"),
    "7b": (7e9, "llama", 32, 4096, 32, 32, 11008, 32000, False, "Llama-2-7B"),
    "8b": (8e9, "llama", 32, 4096, 32, 8, 14336, 128256, False, "Llama-3-8B"),
    "13b": (13e9, "llama", 40, 5120, 40, 40, 13824, 32000, False, "Llama-2-13B"),
    "70b": (70e9, "llama", 80, 8192, 64, 8, 28672, 32000, False, "Llama-2-70B"),
}
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
# peft target_modules per family; "attn.c_proj" so GPT-2's MLP c_proj is not matched.
LORA_TARGETS = {
    "llama": {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]},
    "gpt2": {"attn": ["c_attn", "attn.c_proj"], "mlp": ["c_fc", "mlp.c_proj"]},
}


def lora_target_modules(family: str, targets: str = "attn") -> list[str]:
    """peft ``target_modules`` the planner assumes for ``family`` (``attn`` or ``all``)."""
    t = LORA_TARGETS["gpt2" if family == "gpt2" else "llama"]
    return t["attn"] + (t["mlp"] if targets == "all" else [])


def _shape(name, family, c: dict, nominal=None) -> ModelShape:
    """Count parameters exactly as transformers builds the model (see docs/plan.md)."""
    g = lambda k: c[k]  # noqa: E731 - short accessor; missing keys are reported by the caller
    if family == "gpt2":
        d, L, h, V, P = g("n_embd"), g("n_layer"), g("n_head"), g("vocab_size"), g("n_positions")
        ff = c.get("n_inner") or 4 * d
        kv, hd, tied = h, d // h, c.get("tie_word_embeddings", True)
        layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d)
        backbone = V * d + P * d + L * layer + 2 * d
        lora = {"attn": ((d, 3 * d), (d, d)), "mlp": ((d, ff), (ff, d))}
        tensors = _gpt2_tensors(d, L, V, P, ff)
    else:
        d, L, h, V = g("hidden_size"), g("num_hidden_layers"), g("num_attention_heads"), g("vocab_size")
        ff = g("intermediate_size")
        kv = c.get("num_key_value_heads") or h
        hd = c.get("head_dim") or (128 if family == "qwen3" else d // h)
        tied = c.get("tie_word_embeddings", False)
        q, k = h * hd, kv * hd
        attn = d * q + 2 * d * k + q * d
        if family == "qwen2":  # q, k, v always carry a bias in Qwen2; o does not
            attn += q + 2 * k
        elif c.get("attention_bias", False):
            attn += q + 2 * k + d
        mlp = 3 * d * ff + ((2 * ff + d) if c.get("mlp_bias", False) else 0)
        norms = 2 * d + (2 * hd if family == "qwen3" else 0)  # Qwen3 adds q_norm, k_norm over d_h
        backbone = V * d + L * (attn + mlp + norms) + d
        lora = {"attn": ((d, q), (d, k), (d, k), (q, d)), "mlp": ((d, ff), (d, ff), (ff, d))}
        tensors = _llama_tensors(family, c, d, L, V, q, k, ff, hd)
    lm = backbone + (0 if tied else V * d)
    lm_tensors = tensors + ([] if tied else [(V, V * d, True)])
    return ModelShape(name, family, L, d, h, kv, hd, ff, V, bool(tied), backbone, lm, lora,
                      None if nominal is None else int(nominal), tuple(tensors), tuple(lm_tensors))


def preset_shape(name: str) -> ModelShape:
    nominal, family, L, d, h, kv, ff, V, tied, source = PRESETS[name]
    c = {"hidden_size": d, "num_hidden_layers": L, "num_attention_heads": h, "num_key_value_heads": kv,
         "intermediate_size": ff, "vocab_size": V, "tie_word_embeddings": tied}
    return _shape(f"{name} ({source} shapes)", family, c, nominal)


def config_shape(path: str | Path) -> ModelShape:
    """Shapes from a Hugging Face ``config.json`` (or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TetherError(f"{path}: no config.json in this folder")
        path = path / "config.json"
    if not path.is_file():
        raise TetherError(f"{path}: file not found")
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TetherError(f"{path}: not a JSON config ({e})") from None
    family = c.get("model_type") if isinstance(c, dict) else None
    if family not in LLAMA_LIKE + ("gpt2",):
        raise TetherError(f"{path}: model_type {family!r} is not supported "
                          f"(supported: {', '.join(LLAMA_LIKE + ('gpt2',))})")
    try:
        shape = _shape(str(path), family, c)
    except KeyError as e:
        raise TetherError(f"{path}: missing key {e.args[0]!r}") from None
    for field in ("layers", "hidden", "heads", "vocab", "intermediate"):
        if not isinstance(getattr(shape, field), int) or getattr(shape, field) <= 0:
            raise TetherError(f"{path}: {field} must be a positive integer, got {getattr(shape, field)!r}")
    return shape


def resolve_shape(model: str) -> ModelShape:
    if model.lower() in PRESETS:
        return preset_shape(model.lower())
    if Path(model).exists() or model.endswith(".json"):
        return config_shape(model)
    from tether.hub import model_config, parse_model_id

    parsed = parse_model_id(model)
    if parsed is None:  # plainly a path
        return config_shape(model)
    # a Hugging Face Hub id: its config.json alone (the cached copy offline)
    refused = (f"--model {model}: not a config.json path" if "/" in model else
               f"--model: unknown preset {model!r} (presets: {', '.join(PRESETS)}), not a config.json path")
    return config_shape(model_config(model, *parsed, refused=refused))


def lora_tensors(shape: ModelShape, r: int, targets: str = "attn") -> list[tuple[int, int, bool]]:
    """The LoRA adapters' tensors, (dim 0, numel, cast) as in ModelShape: A is (r, in), B is (out, r)."""
    pairs = shape.lora_shapes["attn"] + (shape.lora_shapes["mlp"] if targets == "all" else ())
    return [t for i, o in pairs for t in ((r, r * i, True), (o, o * r, True))] * shape.layers


def lora_params(shape: ModelShape, r: int, targets: str = "attn") -> int:
    """Trainable LoRA parameters: r·(in + out) per target projection (A: r×in, B: out×r), every layer."""
    pairs = shape.lora_shapes["attn"] + (shape.lora_shapes["mlp"] if targets == "all" else ())
    return shape.layers * sum(r * (i + o) for i, o in pairs)
