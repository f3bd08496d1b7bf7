"""Memory planner (SPEC C1): will an RLHF run with four models fit, per GPU, in each phase?

Units: bytes; printed in GB = 1e9 bytes. ``b`` is the byte size of ``--dtype`` (fp32 4, bf16/fp16 2);
N a model's parameter count; B the batch per GPU; S = prompt + response length; L layers; d hidden;
n_h heads; n_kv KV heads (GQA); d_h head dim; V vocabulary; r the LoRA rank. Full derivation: docs/plan.md.

Static memory of one model (Adam, mixed precision as in the reference):
  trained, full, b = 2:  weights 2N, gradients 2N, Adam m+v 8N (fp32), master 4N (fp32)  → 16N
  trained, full, fp32:   weights 4N, gradients 4N, Adam 8N, no master (the weights are fp32)  → 16N
  trained, LoRA:         frozen base b·N; adapters (and heads) trained in fp32: 4T + 4T + 8T, no master
  frozen (ref, RM):      weights b·N; the reference costs 0 with LoRA (same base, adapter disabled)
  N from a config.json: actor/reference = causal LM; critic = backbone + value head (linear d+1 or
  mlp d²+2d+1); RM = backbone + score Linear(d, 1, no bias). LoRA: r·(in + out) per target projection.
  torch's AdamW also keeps a 4-byte ``step`` scalar per parameter tensor: not counted (bytes, not GB).
ZeRO across ``--gpus`` G: stage ≥1 divides Adam and master by G, ≥2 also gradients, 3 also all weights.
Gradients exist only in the train phase (``zero_grad(set_to_none=True)`` frees them before rollout).

KV cache (rollout, actor generate):  2·L·B·S·n_kv·d_h·b.
Activations (an ESTIMATE; Korthikanti et al. 2022, "Reducing Activation Recomputation", fp16 figures
scaled by b/2): one layer keeps A_layer = (b/2)·(34·B·S·d + 5·n_h·B·S²) bytes; the S² term (softmax
scores) only with ``--attention eager`` (SDPA/flash kernels do not store them).
  train, no checkpointing:  L·A_layer + head;  with checkpointing: L·B·S·d·b (layer inputs) + A_layer + head
  head: LM logits and their fp32 log-softmax B·S·V·(b + 4) (actor); value/score B·S·4 (critic)
  rollout (no grad): the largest single forward, the actor's log-prob pass: A_layer + B·S·V·(b + 4).
Presets carry a nominal parameter count (``7b`` = exactly 7.0e9, as in the reference's table) used for
static memory; their Llama shapes give KV cache, activations and LoRA sizes. A config.json is exact.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tether.config import add_config_flags, config_to_dict, option, resolve_config
from tether.diagnostics.shapes import ModelShape, lora_params, resolve_shape

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MODELS = ("actor", "critic", "reference", "RM")
PHASES = ("rollout", "train")


@dataclass
class PlanConfig:
    """Inputs of ``tether plan``: one run's models, precision, batch shape and parallelism."""

    model: str = option("7b", "preset (0.5b, 7b, 8b, 13b, 70b) or a Hugging Face config.json (or its folder)")
    dtype: str = option("bf16", "weights/compute dtype; bf16/fp16 train with fp32 master weights",
                        choices=tuple(DTYPE_BYTES))
    batch_size: int = option(8, "sequences per GPU in one forward (generation batch and train micro-batch)", low=1)
    prompt_length: int = option(512, "prompt tokens per sequence", low=1)
    response_length: int = option(512, "generated tokens per sequence", low=1)
    lora_r: int = option(0, "LoRA rank of the actor; 0 = full fine-tune (the reference is then a frozen copy)",
                         low=0)
    critic_lora_r: int | None = option(None, "LoRA rank of a separate critic; default: --lora-r; 0 = full", low=0)
    lora_targets: str = option("attn", "LoRA target projections: attn (q,k,v,o) or all (attn + MLP = all-linear)",
                               choices=("attn", "all"))
    zero: int = option(0, "ZeRO stage: 1 shards Adam+master, 2 + gradients, 3 + weights", choices=(0, 1, 2, 3))
    gpus: int = option(1, "GPUs the models are sharded over (data parallel)", low=1)
    gpu_memory: float = option(80.0, "memory of one GPU in GB (1e9 bytes)", low=0, low_open=True)
    gradient_checkpointing: bool = option(False, "keep only layer inputs; recompute the rest in backward")
    attention: str = option("sdpa", "attention kernel: sdpa/flash (no S×S scores stored) or eager",
                            choices=("sdpa", "eager"))
    critic: str = option("separate", "separate critic model, or a value head on the actor",
                         choices=("separate", "head"))
    value_head: str = option("mlp", "value head: linear (d+1 params) or mlp (d->d->1, d²+2d+1 params)",
                             choices=("linear", "mlp"))
    offload_ref: bool = option(False, "keep the reference's weights in CPU memory (streamed per layer)")
    offload_rm: bool = option(False, "keep the reward model's weights in CPU memory (streamed per layer)")


def kv_cache_bytes(shape: ModelShape, batch: int, seq: int, nbytes: int) -> int:
    """KV cache of a generation batch: 2 (K and V) · L · B · S · n_kv · d_h · bytes."""
    return 2 * shape.layers * batch * seq * shape.kv_heads * shape.head_dim * nbytes


def layer_activation_bytes(shape: ModelShape, batch: int, seq: int, nbytes: int, attention: str) -> int:
    """One layer's saved activations (Korthikanti et al. 2022): (b/2)·(34·B·S·d + 5·n_h·B·S² [eager])."""
    elems2 = 34 * batch * seq * shape.hidden + (5 * shape.heads * batch * seq * seq if attention == "eager" else 0)
    return elems2 * nbytes // 2


def train_activation_bytes(shape: ModelShape, cfg: PlanConfig, head: str) -> int:
    """Activations kept for backward by one trained model; ``head`` is ``lm`` or ``value``."""
    b, B, S = DTYPE_BYTES[cfg.dtype], cfg.batch_size, cfg.prompt_length + cfg.response_length
    layer = layer_activation_bytes(shape, B, S, b, cfg.attention)
    body = (shape.layers * B * S * shape.hidden * b + layer) if cfg.gradient_checkpointing else shape.layers * layer
    return body + (B * S * shape.vocab * (b + 4) if head == "lm" else B * S * 4)


def value_head_params(d: int, kind: str) -> int:
    """Linear(d, 1) with bias, or the 2-layer MLP Linear(d, d) → tanh → Linear(d, 1) (reference 001)."""
    return d + 1 if kind == "linear" else d * d + d + d + 1


def critic_lora_r(cfg: PlanConfig) -> int:
    return cfg.lora_r if cfg.critic_lora_r is None else cfg.critic_lora_r


def model_static(shape: ModelShape, cfg: PlanConfig, role: str) -> dict:
    """Unsharded static memory of one model: params (trainable, frozen) and bytes of each state."""
    b, nominal = DTYPE_BYTES[cfg.dtype], shape.nominal_params
    head = value_head_params(shape.hidden, cfg.value_head)
    out = {"trainable": 0, "frozen": 0, "weights": 0, "grads": 0, "adam": 0, "master": 0, "note": ""}
    if role in ("reference", "RM"):
        if role == "reference" and cfg.lora_r > 0:
            out["note"] = "shared with the actor (LoRA adapter disabled)"
            return out
        # the RM is a sequence-classification model: backbone + score Linear(d, 1, bias=False)
        frozen = nominal or (shape.lm_params if role == "reference" else shape.backbone_params + shape.hidden)
        out.update(frozen=frozen, weights=frozen * b)
        return out
    if role == "critic" and cfg.critic == "head":
        out["note"] = "value head on the actor"
        r, frozen, trainable = cfg.lora_r, 0, head  # trained like the actor's trainable weights
    else:
        r = cfg.lora_r if role == "actor" else critic_lora_r(cfg)
        body = nominal or (shape.lm_params if role == "actor" else shape.backbone_params)
        extra = head if role == "critic" and nominal is None else 0  # presets: the critic is N, as in the reference
        if r > 0:
            frozen = body
            trainable = lora_params(shape, r, cfg.lora_targets) + extra
        else:
            frozen, trainable = 0, body + extra
    if r > 0:  # LoRA: adapters and heads train in fp32 (peft's default, SPEC A6), no master copy
        out.update(weights=frozen * b + 4 * trainable, grads=4 * trainable)
    else:  # full fine-tune: fp32 master only when the weights are not fp32
        out.update(weights=b * trainable, grads=b * trainable, master=0 if b == 4 else 4 * trainable)
    out.update(trainable=trainable, frozen=frozen, adam=8 * trainable)
    return out


def _shard(x: int, gpus: int) -> int:
    return -(-x // gpus)  # ZeRO pads partitions to equal size: ceil


def plan(shape: ModelShape, cfg: PlanConfig) -> dict:
    """Per-GPU bytes for each model and phase, totals, peak and whether it fits ``cfg.gpu_memory``."""
    b, B, S = DTYPE_BYTES[cfg.dtype], cfg.batch_size, cfg.prompt_length + cfg.response_length
    G, z = cfg.gpus, cfg.zero
    static, phases = {}, {p: {} for p in PHASES}
    for role in MODELS:
        s = model_static(shape, cfg, role)
        cpu = 0
        if (role == "reference" and cfg.offload_ref or role == "RM" and cfg.offload_rm) and s["weights"]:
            cpu, s["weights"] = s["weights"], 0
            s["note"] = "weights offloaded to CPU"
        per_gpu = {"weights": _shard(s["weights"], G) if z >= 3 else s["weights"],
                   "grads": _shard(s["grads"], G) if z >= 2 else s["grads"],
                   "adam": _shard(s["adam"], G) if z >= 1 else s["adam"],
                   "master": _shard(s["master"], G) if z >= 1 else s["master"]}
        static[role] = {**per_gpu, "total": sum(per_gpu.values()), "trainable_params": s["trainable"],
                        "frozen_params": s["frozen"], "cpu_bytes": cpu, "note": s["note"]}
        for phase in PHASES:
            row = dict(per_gpu, activations=0, kv_cache=0)
            if phase == "rollout":
                row["grads"] = 0  # freed by zero_grad(set_to_none=True) after each optimiser step
                if role == "actor":
                    row["kv_cache"] = kv_cache_bytes(shape, B, S, b)
                    logits = B * S * shape.vocab * (b + 4)  # (B, S, V) in --dtype + fp32 log-softmax
                    row["activations"] = layer_activation_bytes(shape, B, S, b, cfg.attention) + logits
            elif role == "actor":
                row["activations"] = train_activation_bytes(shape, cfg, "lm")
            elif role == "critic":
                # a head on the actor's detached hidden states keeps only its (B, S) values
                row["activations"] = (B * S * 4 if cfg.critic == "head"
                                      else train_activation_bytes(shape, cfg, "value"))
            row["total"] = sum(row.values())
            phases[phase][role] = row
    totals = {p: sum(r["total"] for r in phases[p].values()) for p in PHASES}
    peak_phase = max(PHASES, key=totals.get)
    capacity = int(cfg.gpu_memory * GB)
    return {"model": shape.name, "params": shape.nominal_params or shape.lm_params, "config": config_to_dict(cfg),
            "static": static, "static_total": sum(v["total"] for v in static.values()), "phases": phases,
            "totals": totals, "peak_phase": peak_phase, "peak": totals[peak_phase],
            "gpu_memory": capacity, "fits": totals[peak_phase] <= capacity}


def levers(shape: ModelShape, cfg: PlanConfig, peak: int | None = None) -> list[dict]:
    """Each lever not already in use, applied alone to ``cfg``: the peak it gives and what it saves."""
    peak = plan(shape, cfg)["peak"] if peak is None else peak
    options = []
    actor_full, critic_full = cfg.lora_r == 0, cfg.critic == "separate" and critic_lora_r(cfg) == 0
    if actor_full or critic_full:
        change = {"lora_r": 16} if actor_full else {}
        if critic_full and not (actor_full and cfg.critic_lora_r is None):  # else the critic follows --lora-r
            change["critic_lora_r"] = 16
        who = " and ".join(w for w, full in (("actor", actor_full), ("critic", critic_full)) if full)
        options.append((f"LoRA r=16 on the {who}", " ".join(f"--{k.replace('_', '-')} 16" for k in change), change))
    if cfg.zero < 3:
        name = "ZeRO-3 (shards nothing on 1 GPU: add --gpus)" if cfg.gpus == 1 else f"ZeRO-3 over {cfg.gpus} GPUs"
        options.append((name, "--zero 3", {"zero": 3}))
    if not cfg.gradient_checkpointing:
        options.append(("gradient checkpointing", "--gradient-checkpointing", {"gradient_checkpointing": True}))
    if cfg.lora_r > 0 and not cfg.offload_rm:  # the reference is the actor's base: nothing to offload
        options.append(("offload RM weights to CPU", "--offload-rm", {"offload_rm": True}))
    elif not (cfg.offload_ref and cfg.offload_rm):
        options.append(("offload reference and RM weights to CPU", "--offload-ref --offload-rm",
                        {"offload_ref": True, "offload_rm": True}))
    if cfg.critic == "separate":
        options.append(("value head on the actor instead of a critic model", "--critic head", {"critic": "head"}))
    if cfg.batch_size > 1:
        options.append(("half the batch per GPU", f"--batch-size {cfg.batch_size // 2}",
                        {"batch_size": cfg.batch_size // 2}))
    out = []
    for name, flags, change in options:
        p = plan(shape, dataclasses.replace(cfg, **change))
        out.append({"lever": name, "flags": flags, "peak": p["peak"], "saves": peak - p["peak"], "fits": p["fits"]})
    out.sort(key=lambda x: -x["saves"])
    if len(options) > 1:
        merged = {k: v for _, _, change in options for k, v in change.items()}
        p = plan(shape, dataclasses.replace(cfg, **merged))
        out.append({"lever": "all of the above", "flags": " ".join(f for _, f, _ in options),
                    "peak": p["peak"], "saves": peak - p["peak"], "fits": p["fits"]})
    return out


def _gb(x: int) -> str:
    return f"{x / GB:.2f}" if x else "-"


def format_plan(shape: ModelShape, cfg: PlanConfig, result: dict, lever_rows: list[dict]) -> str:
    """The plan as a plain-text table (GB = 1e9 bytes, per GPU)."""
    S = cfg.prompt_length + cfg.response_length
    lora = lambda r: f"LoRA r={r} ({cfg.lora_targets})" if r else "full fine-tune"  # noqa: E731
    critic = (f"separate critic {lora(critic_lora_r(cfg))}" if cfg.critic == "separate"
              else "critic = head on the actor") + f", {cfg.value_head} value head"
    count = f"{result['params'] / 1e9:.2f}e9 params"
    if shape.nominal_params is not None:
        count += f" (nominal; the shapes give {shape.lm_params / 1e9:.2f}e9 — pass a config.json for exact)"
    lines = [f"model {shape.name}: {count}",
             f"{cfg.dtype}, actor {lora(cfg.lora_r)}, {critic}, "
             f"ZeRO-{cfg.zero} over {cfg.gpus} GPU(s) of {cfg.gpu_memory:g} GB, "
             f"batch {cfg.batch_size}/GPU, seq {cfg.prompt_length}+{cfg.response_length}={S}, "
             f"checkpointing {'on' if cfg.gradient_checkpointing else 'off'}, attention {cfg.attention}",
             "memory per GPU in GB (1 GB = 1e9 bytes); activations are an estimate", ""]
    cols = ("weights", "grads", "adam", "master", "activations", "kv_cache", "total")
    titles = ("weights", "grads", "Adam m+v", "fp32 mstr", "activ.", "KV cache", "total")
    head = f"{'phase':<8} {'model':<10}" + "".join(f"{c:>10}" for c in titles)
    lines += [head, "-" * len(head)]
    for phase in PHASES:
        for i, role in enumerate(MODELS):
            row = result["phases"][phase][role]
            note = result["static"][role]["note"]
            lines.append(f"{phase if i == 0 else '':<8} {role:<10}" + "".join(f"{_gb(row[c]):>10}" for c in cols)
                         + (f"  {note}" if note else ""))
        lines.append(f"{'':<8} {'total':<10}" + " " * 60 + f"{_gb(result['totals'][phase]):>10}")
    st = result["static"]
    lines += ["", "static (weights + grads + Adam + master): "
              + ", ".join(f"{r} {_gb(st[r]['total'])}" for r in MODELS) + f"; all {_gb(result['static_total'])} GB"]
    cpu = sum(st[r]["cpu_bytes"] for r in MODELS)
    if cpu:
        lines.append(f"CPU memory for offloaded weights: {_gb(cpu)} GB per process")
    verdict = "FITS" if result["fits"] else "DOES NOT FIT"
    margin = result["gpu_memory"] - result["peak"]
    lines += [f"peak: {result['peak_phase']} phase, {_gb(result['peak'])} GB of {cfg.gpu_memory:g} GB per GPU -> "
              f"{verdict} ({'headroom' if margin >= 0 else 'short by'} {abs(margin) / GB:.2f} GB)"]
    if result["fits"] and margin < 0.1 * result["gpu_memory"]:
        # not planned: CUDA context, allocator fragmentation, ZeRO-3 gather buffers, temporaries
        lines.append("tight: under 10% headroom for what the plan does not count (CUDA context, fragmentation)")
    if lever_rows:
        lines += ["", "levers (each alone from this configuration; GB per GPU at the peak):"]
        width = max(len(x["lever"]) for x in lever_rows)
        for x in lever_rows:
            lines.append(f"  {x['lever']:<{width}}  saves {x['saves'] / GB:7.2f} -> {x['peak'] / GB:7.2f} "
                         f"{'fits' if x['fits'] else 'does not fit':<12}  {x['flags']}")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    add_config_flags(parser, PlanConfig)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (bytes)")


def run(args) -> int:
    cfg = resolve_config(PlanConfig, args)
    shape = resolve_shape(cfg.model)
    result = plan(shape, cfg)
    lever_rows = levers(shape, cfg, result["peak"])
    if args.json:
        result.update(unit="bytes", levers=lever_rows, kv_cache_formula="2*L*B*S*n_kv*d_h*bytes",
                      shape={k: v for k, v in dataclasses.asdict(shape).items() if k != "lora_shapes"})
        print(json.dumps(result))
    else:
        print(format_plan(shape, cfg, result, lever_rows))
    return 0
