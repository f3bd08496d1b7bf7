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
from dataclasses import dataclass

from tether.cli_flags import add_config_flags
from tether.config import config_to_dict, option, resolve_config
from tether.diagnostics.shapes import ModelShape, lora_params, lora_tensors, resolve_shape

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MODELS = ("actor", "critic", "reference", "RM")
FROZEN = ("reference", "RM")  # never sharded by tether: whole on every process


def models_of(cfg) -> tuple[str, ...]:
    """The models a run holds: the four, or three with ``critic none`` (a critic-free estimator, B17)."""
    return tuple(m for m in MODELS if not (m == "critic" and cfg.critic == "none"))
PHASES = ("rollout", "train")


@dataclass
class PlanConfig:
    """Inputs of ``tether plan``: one run's models, precision, batch shape and parallelism."""

    model: str = option("7b", "preset (0.5b, 7b, 8b, 13b, 70b) or a Hugging Face config.json (or its folder)")
    dtype: str = option("bf16", "weights/compute dtype; bf16/fp16 train with fp32 master weights",
                        choices=tuple(DTYPE_BYTES))
    batch_size: int = option(8, "sequences per GPU in one forward (generation batch and train micro-batch)", low=1)
    prompt_length: int = option(512, "prompt tokens per sequence", low=1)
    response_length: int = option(512, "generated tokens per sequence", low=1, flag="--max-new-tokens",
                                  old_flags=("--response-length",))
    lora_r: int = option(0, "LoRA rank of the actor; 0 = full fine-tune (the reference is then a frozen copy)",
                         low=0)
    critic_lora_r: int | None = option(None, "LoRA rank of a separate critic; default: --lora-r; 0 = full", low=0)
    lora_targets: str = option("attn", "LoRA target projections: attn (q,k,v,o) or all (attn + MLP = all-linear)",
                               choices=("attn", "all"), flag="--lora-target-modules",
                               old_flags=("--lora-targets",))
    zero: int = option(0, "ZeRO stage: 1 shards Adam+master, 2 + gradients, 3 + weights", choices=(0, 1, 2, 3))
    gpus: int = option(1, "GPUs the models are sharded over (data parallel)", low=1)
    gpu_memory: float = option(80.0, "memory of one GPU in GB (1e9 bytes)", low=0, low_open=True)
    gradient_checkpointing: bool = option(False, "keep only layer inputs; recompute the rest in backward")
    attention: str = option("sdpa", "attention kernel: sdpa/flash (no S×S scores stored) or eager",
                            choices=("sdpa", "eager"))
    critic: str = option("separate", "separate critic model, a value head on the actor, or none (a critic-free "
                         "estimator: rloo, grpo, dr_grpo, reinforce_pp)", choices=("separate", "head", "none"))
    value_head: str = option("mlp", "value head: linear (d+1 params) or mlp (d->d->1, d²+2d+1 params)",
                             choices=("linear", "mlp"))
    offload_ref: bool = option(False, "keep the reference's weights in CPU memory (streamed per layer)")
    offload_rm: bool = option(False, "keep the reward model's weights in CPU memory (streamed per layer)")
    engine: str = option("transformers", "rollout engine of the run (its layouts are planned per process either way)",
                         choices=("transformers", "vllm"))
    engine_tp: int = option(1, "processes per vLLM engine (tensor parallel)", low=1)
    rollout_processes: int = option(0, "disaggregated layout: rollout processes (GPUs) besides the --gpus trainers",
                                    low=0)


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


def value_head_tensors(d: int, kind: str) -> list[tuple[int, int, bool]]:
    """The value head's tensors, (dim 0, numel, cast) as in :class:`ModelShape`."""
    if kind == "linear":
        return [(1, d, True), (1, 1, True)]
    return [(d, d * d, True), (d, d, True), (1, d, True), (1, 1, True)]


STATES = ("weights", "grads", "adam", "master")


def _group(tensors, count: int, **nbytes: int) -> dict:
    """Parameters that hold the same bytes per element in each state (``nbytes``: weights, grads, adam,
    master). ``tensors``: their (dim 0, numel, cast) shapes, None where only the count is known (presets)."""
    return {"tensors": tensors, "count": count, "bytes": {k: nbytes.get(k, 0) for k in STATES}}


def model_static(shape: ModelShape, cfg: PlanConfig, role: str) -> dict:
    """Unsharded static memory of one model: params (trainable, frozen), bytes of each state, and the
    parameter ``groups`` they come from (what :func:`sharded_bytes` splits over GPUs)."""
    b, nominal = DTYPE_BYTES[cfg.dtype], shape.nominal_params
    exact = nominal is None  # a config.json: every tensor's shape is known
    head, head_t = value_head_params(shape.hidden, cfg.value_head), value_head_tensors(shape.hidden, cfg.value_head)
    out = {"trainable": 0, "frozen": 0, "note": "", "groups": []}
    if role == "reference" and cfg.lora_r > 0:
        out["note"] = "shared with the actor (LoRA adapter disabled)"
        groups = []
    elif role == "reference" and exact and b < 4:
        # tether's reference twin (tether.ppo.models.frozen_twin): matmul weights in --dtype, embeddings and
        # norms in fp32 as the actor's masters, so that it computes exactly as the actor under autocast
        cast = [t for t in shape.lm_tensors if t[2]]
        rest = [t for t in shape.lm_tensors if not t[2]]
        groups = [_group(cast, sum(t[1] for t in cast), weights=b), _group(rest, sum(t[1] for t in rest), weights=4)]
        out["frozen"] = shape.lm_params
    elif role in ("reference", "RM"):
        # the RM is a sequence-classification model: backbone + score Linear(d, 1, bias=False)
        tensors = shape.lm_tensors if role == "reference" else shape.backbone_tensors + ((1, shape.hidden, True),)
        frozen = nominal or (shape.lm_params if role == "reference" else shape.backbone_params + shape.hidden)
        groups = [_group(list(tensors) if exact else None, frozen, weights=b)]
        out["frozen"] = frozen
    else:
        if role == "critic" and cfg.critic == "head":
            out["note"] = "value head on the actor"
            r, frozen, trainable, frozen_t, trainable_t = cfg.lora_r, 0, head, [], head_t  # trained like the actor
        else:
            r = cfg.lora_r if role == "actor" else critic_lora_r(cfg)
            body = nominal or (shape.lm_params if role == "actor" else shape.backbone_params)
            body_t = list(shape.lm_tensors if role == "actor" else shape.backbone_tensors)
            extra = head if role == "critic" and exact else 0  # presets: the critic is N, as in the reference
            extra_t = head_t if extra else []
            if r > 0:
                frozen, frozen_t = body, body_t
                trainable, trainable_t = lora_params(shape, r, cfg.lora_targets) + extra, \
                    lora_tensors(shape, r, cfg.lora_targets) + extra_t
            else:
                frozen, frozen_t, trainable, trainable_t = 0, [], body + extra, body_t + extra_t
        if not exact:
            frozen_t = trainable_t = None
        if r > 0:  # LoRA: adapters and heads train in fp32 (peft's default, SPEC A6), no master copy
            groups = [_group(frozen_t, frozen, weights=b), _group(trainable_t, trainable, weights=4, grads=4, adam=8)]
        else:  # full fine-tune: fp32 master only when the weights are not fp32
            groups = [_group(trainable_t, trainable, weights=b, grads=b, adam=8, master=0 if b == 4 else 4)]
        out.update(trainable=trainable, frozen=frozen)
    out["groups"] = groups
    out.update({k: sum(g["bytes"][k] * g["count"] for g in groups) for k in STATES})
    return out


def shard_elements(tensors, gpus: int) -> int:
    """Elements of ``tensors`` on the GPU holding the most when each is split along dim 0 as FSDP2 does: into
    ``gpus`` chunks of ceil(d0 / G) rows (the last ones shorter or empty), the first chunk on GPU 0. FSDP2
    allocates the parameter and gradient shards padded to that size on every GPU (AdamW's moments only on
    the rows a GPU owns: GPU 0's are the largest, so its total is the figure)."""
    return sum(-(-d0 // gpus) * (numel // d0) for d0, numel, _ in tensors)


def sharded_bytes(s: dict, state: str, gpus: int) -> int:
    """Per-GPU bytes of ``state`` of a model (:func:`model_static`) sharded over ``gpus``: per tensor, as FSDP2
    (:func:`shard_elements`); a preset, whose tensors are not known, splits its bytes evenly (ceil)."""
    if any(g["tensors"] is None for g in s["groups"]):
        return _shard(s[state], gpus)
    return sum(g["bytes"][state] * shard_elements(g["tensors"], gpus) for g in s["groups"])


def _shard(x: int, gpus: int) -> int:
    return -(-x // gpus)  # an even split of a flat buffer padded to G equal parts: ceil


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
                row["activations"] = (B * S * 4 if cfg.critic == "head"
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
    from tether.diagnostics.engine_plan import trainer_engine

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
    critic = "no critic (critic-free estimator)" if cfg.critic == "none" else critic
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
    from tether.diagnostics.engine_plan import engine_plan, format_engine_plan

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
