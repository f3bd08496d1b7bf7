"""Memory planner (SPEC C1): will an RLHF run with four models (three without a critic) fit, per GPU, in each phase?

Units: bytes; printed in GB = 1e9 bytes. ``b`` is the byte size of ``--dtype`` (fp32 4, bf16/fp16 2);
N a model's parameter count; B the batch per GPU; S = prompt + response length; L layers; d hidden;
n_h heads; n_kv KV heads (GQA); d_h head dim; V vocabulary; r the LoRA rank. Full derivation: docs/plan.md.

Static memory of one model (Adam, mixed precision as in the reference):
  trained, full, b = 2:  weights 2N, gradients 2N, Adam m+v 8N (fp32), master 4N (fp32)  → 16N
  trained, full, fp32:   weights 4N, gradients 4N, Adam 8N, no master (the weights are fp32)  → 16N
  trained, LoRA:         frozen base b·N; adapters (and heads) trained in fp32: 4T + 4T + 8T, no master
  frozen (ref, RM):      weights b·N; the reference costs 0 with LoRA (same base, adapter disabled)
  reference, full, b = 2, from a config.json: b·N_matmul + 4·(N − N_matmul): tether's twin keeps embeddings
                         and norms in fp32 like the actor's masters, so it computes exactly as the actor
                         (N_matmul: Linear/Conv1D weights and biases not tied to an embedding)
  N from a config.json: actor/reference = causal LM; critic = backbone + value head (linear d+1 or
  mlp d²+2d+1); RM = backbone + score Linear(d, 1, no bias). LoRA: r·(in + out) per target projection.
  torch's AdamW also keeps a 4-byte ``step`` scalar per parameter tensor: not counted (bytes, not GB).
ZeRO across ``--gpus`` G: stage ≥1 divides Adam and master by G, ≥2 also gradients, 3 also all weights.
  Divided as FSDP2 divides (tether's ZeRO-3): each tensor along dim 0 into G chunks of ceil(d0/G) rows, so
  a GPU holds Σ_tensors ceil(d0/G)·numel/d0 elements (GPU 0, the fullest; the others allocate the same
  padded parameter and gradient shards). Presets (tensor shapes unknown at the nominal size): ceil(bytes/G).
tether's trainer holds bf16/fp16 runs' trained weights in fp32 with fp32 gradients and no separate master
(SPEC C5, autocast): 4N + 4N + 8N, the same total per GPU as 2N + 2N + 4N + 8N (fp32 weights and
  gradients = this table's weights + gradients + master).
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

from tether.cli_flags import add_config_flags
from tether.config import config_to_dict, resolve_config
from tether.diagnostics.engine_plan import engine_plan, format_engine_plan, trainer_engine
from tether.diagnostics.memory import (  # the memory model; its names importable from here as before
    DTYPE_BYTES,
    FROZEN,
    GB,
    PHASES,
    STATES,
    PlanConfig,
    critic_lora_r,
    kv_cache_bytes,
    layer_activation_bytes,
    model_static,
    models_of,
    sharded_bytes,
    train_activation_bytes,
    train_batch,
)
from tether.diagnostics.shapes import ModelShape, resolve_shape


def plan(shape: ModelShape, cfg: PlanConfig) -> dict:
    """Per-GPU bytes for each model and phase, totals, peak and whether it fits ``cfg.gpu_memory``."""
    b, B, S = DTYPE_BYTES[cfg.dtype], cfg.batch_size, cfg.prompt_length + cfg.response_length
    G, z = cfg.gpus, cfg.zero
    static, phases = {}, {p: {} for p in PHASES}
    for role in models_of(cfg):
        s = model_static(shape, cfg, role)
        cpu = 0
        if (role == "reference" and cfg.offload_ref or role == "RM" and cfg.offload_rm) and s["weights"]:
            cpu, s["weights"] = s["weights"], 0
            for g in s["groups"]:
                g["bytes"]["weights"] = 0
            s["note"] = "weights offloaded to CPU"
        stage = {"weights": 3, "grads": 2, "adam": 1, "master": 1}  # the ZeRO stage that shards each state
        # tether's FSDP2 shards what trains; the frozen reference and RM stay whole on every process (C5)
        sharded = role not in FROZEN
        per_gpu = {k: sharded_bytes(s, k, G) if sharded and z >= stage[k] else s[k] for k in STATES}
        static[role] = {**per_gpu, "total": sum(per_gpu.values()), "trainable_params": s["trainable"],
                        "frozen_params": s["frozen"], "cpu_bytes": cpu, "note": s["note"]}
        for phase in PHASES:
            row = dict(per_gpu, activations=0, kv_cache=0)
            if phase == "rollout":
                row["grads"] = 0  # freed by zero_grad(set_to_none=True) after each optimiser step
                if role == "actor":  # its KV cache when it samples itself (the transformers engine, colocated)
                    generates = cfg.engine == "transformers" and not cfg.rollout_processes
                    row["kv_cache"] = kv_cache_bytes(shape, B, S, b) if generates else 0
                    logits = B * S * shape.vocab * (b + 4)  # (B, S, V) in --dtype + fp32 log-softmax
                    row["activations"] = layer_activation_bytes(shape, B, S, b, cfg.attention) + logits
            elif role == "actor":
                row["activations"] = train_activation_bytes(shape, cfg, "lm")
            elif role == "critic":
                # a head on the actor's detached hidden states keeps only its (B, S) values
                row["activations"] = (train_batch(cfg) * S * 4 if cfg.critic == "head"
                                      else train_activation_bytes(shape, cfg, "value"))
            row["total"] = sum(row.values())
            phases[phase][role] = row
    phases["rollout"]["engine"] = engine_rollout_row(shape, cfg)
    totals = {p: sum(r["total"] for r in phases[p].values()) for p in PHASES}
    peak_phase = max(PHASES, key=totals.get)
    capacity = int(cfg.gpu_memory * GB)
    return {"model": shape.name, "params": shape.nominal_params or shape.lm_params, "config": config_to_dict(cfg),
            "static": static, "static_total": sum(v["total"] for v in static.values()), "phases": phases,
            "totals": totals, "peak_phase": peak_phase, "peak": totals[peak_phase],
            "gpu_memory": capacity, "fits": totals[peak_phase] <= capacity}


def engine_rollout_row(shape: ModelShape, cfg: PlanConfig) -> dict:
    """What sampling adds to a trainer in the rollout phase, for this run's layout (tether.diagnostics.engine_plan):
    the whole policy FSDP2 generation gathers (colocated transformers engine), a vLLM engine's weights and KV cache
    (colocated), the two blocks a weight sync holds (vLLM or rollout processes under ZeRO-3)."""
    e = trainer_engine(shape, cfg)
    row = {k: 0 for k in (*STATES, "activations", "kv_cache")}
    row["weights"] = e["engine_weights"] + e["sync_blocks"] + e["gathered_policy"]
    row["kv_cache"] = e["kv_cache"] if cfg.engine == "vllm" and not cfg.rollout_processes else 0
    row["total"] = sum(row.values())
    return row


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
    if cfg.critic != "none":
        options.append(("no critic (a critic-free estimator, e.g. tether ppo --advantage grpo)", "--critic none",
                        {"critic": "none"}))
    if cfg.batch_size > 1:
        half = {"batch_size": cfg.batch_size // 2}
        if cfg.train_batch_size:  # tether ppo's micro-batch is a fixed share of its batch
            half["train_batch_size"] = max(1, cfg.train_batch_size // 2)
        options.append(("half the batch per GPU", f"--batch-size {cfg.batch_size // 2}", half))
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
    critic = "no critic (critic-free estimator)" if cfg.critic == "none" else critic
    count = f"{result['params'] / 1e9:.2f}e9 params"
    micro = f" (train micro-batch {cfg.train_batch_size})" if cfg.train_batch_size else ""
    if shape.nominal_params is not None:
        count += f" (nominal; the shapes give {shape.lm_params / 1e9:.2f}e9 — pass a config.json for exact)"
    lines = [f"model {shape.name}: {count}",
             f"{cfg.dtype}, actor {lora(cfg.lora_r)}, {critic}, "
             f"ZeRO-{cfg.zero} over {cfg.gpus} GPU(s) of {cfg.gpu_memory:g} GB, "
             f"batch {cfg.batch_size}/GPU{micro}, seq {cfg.prompt_length}+{cfg.response_length}={S}, "
             f"checkpointing {'on' if cfg.gradient_checkpointing else 'off'}, attention {cfg.attention}",
             "memory per GPU in GB (1 GB = 1e9 bytes); activations are an estimate", ""]
    cols = ("weights", "grads", "adam", "master", "activations", "kv_cache", "total")
    titles = ("weights", "grads", "Adam m+v", "fp32 mstr", "activ.", "KV cache", "total")
    head = f"{'phase':<8} {'model':<10}" + "".join(f"{c:>10}" for c in titles)
    lines += [head, "-" * len(head)]
    for phase in PHASES:
        for i, role in enumerate(models_of(cfg)):
            row = result["phases"][phase][role]
            note = result["static"][role]["note"]
            if role in FROZEN and cfg.zero == 3 and cfg.gpus > 1 and row["weights"]:
                note = (note + "; " if note else "") + "whole on every GPU (tether shards what trains)"
            lines.append(f"{phase if i == 0 else '':<8} {role:<10}" + "".join(f"{_gb(row[c]):>10}" for c in cols)
                         + (f"  {note}" if note else ""))
        engine = result["phases"][phase].get("engine")
        if engine and engine["total"]:
            lines.append(f"{'':<8} {'engine':<10}" + "".join(f"{_gb(engine[c]):>10}" for c in cols)
                         + "  sampling: the engine table below, this run's trainer row")
        lines.append(f"{'':<8} {'total':<10}" + " " * 60 + f"{_gb(result['totals'][phase]):>10}")
    st = result["static"]
    lines += ["", "static (weights + grads + Adam + master): "
              + ", ".join(f"{r} {_gb(st[r]['total'])}" for r in st) + f"; all {_gb(result['static_total'])} GB"]
    cpu = sum(st[r]["cpu_bytes"] for r in st)
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
    engines = engine_plan(shape, cfg)
    if args.json:
        result.update(unit="bytes", levers=lever_rows, kv_cache_formula="2*L*B*S*n_kv*d_h*bytes", engines=engines,
                      shape={k: v for k, v in dataclasses.asdict(shape).items() if k != "lora_shapes"})
        print(json.dumps(result))
    else:
        print(format_plan(shape, cfg, result, lever_rows) + "\n\n" + format_engine_plan(engines, cfg))
    return 0
