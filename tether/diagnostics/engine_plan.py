"""The rollout engine's memory per process in each layout (issue 28, SPEC C1/C3/C4), for ``tether plan`` and
``tether ppo --dry-run``: what sampling adds to the trainers' table of :mod:`tether.diagnostics.plan`.

Per process (GB = 1e9 bytes), b the compute dtype's bytes, N the policy's parameters, B the batch per trainer,
S = prompt + response, K = ``--engine-tp``, T trainers (``--gpus``), R rollout processes:

- **colocated, transformers** (tether's default): ``generate`` on the trained module; under ZeRO-3/FSDP2 the whole
  policy is gathered for the generation, as it is held for training (full fine-tune: 4N, fp32 trained weights;
  LoRA: b·N base + 4·adapters); its KV cache 2·L·B·S·n_kv·d_h·b is the plan's rollout KV row.
- **colocated, vLLM**: one engine beside each trainer (or per K trainers): b·N / K of weights (LoRA merged in)
  and a KV cache for its rows, 2·L·(K·B·S)·max(n_kv / K, 1)·d_h·b; a sync holds at most two blocks gathered at
  once (the one being loaded and the next one's all-gather), never the whole policy.
- **disaggregated**: trainers hold no engine, only a sync's two blocks; a rollout process holds an engine for its
  trainers' rows, ceil(T / R)·B of them (K rollout processes per engine).

On a GPU, vLLM is started with ``gpu_memory_utilization`` = :func:`gpu_memory_share` of its weights + KV cache.
"""

from __future__ import annotations

import dataclasses
import math

from tether.diagnostics.memory import DTYPE_BYTES, GB, PlanConfig, model_static, shard_elements
from tether.diagnostics.shapes import ModelShape


def gpu_memory_share(weight_bytes: int, kv_bytes: int, device_bytes: int, margin: float = 0.2,
                     overhead: int = 2**30) -> float:
    """The share of the device vLLM is started with (``gpu_memory_utilization``): this engine's weights and its
    KV cache for one batch, plus ``margin`` of that and ``overhead`` bytes (CUDA context, sampler and activation
    workspace, CUDA graphs), instead of vLLM's default 0.9: vLLM refuses to start unless that share of the device
    is free, and in the colocated layout the trained models are already resident. At most 0.9."""
    return min(0.9, ((weight_bytes + kv_bytes) * (1 + margin) + overhead) / device_bytes)


def engine_kv_bytes(shape: ModelShape, rows: int, seq: int, nbytes: int, tp: int = 1) -> int:
    """K and V of ``rows`` sequences of ``seq`` tokens on one process of a ``tp``-way engine that serves ``tp``
    processes' rows: 2·L·(tp·rows·seq)·max(n_kv / tp, 1)·d_h·b."""
    return 2 * shape.layers * tp * rows * seq * max(shape.kv_heads // tp, 1) * shape.head_dim * nbytes


def block_params(shape: ModelShape) -> int:
    """Parameters of the largest unit a sync gathers: a transformer block, or the rest (embeddings, head, norm)."""
    params = shape.nominal_params or shape.lm_params
    rest = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    return max(rest, (params - rest) // shape.layers)


def gathered_policy_bytes(shape: ModelShape, cfg: PlanConfig) -> int:
    """The whole policy as FSDP2's unshard allocates it for a generation: every tensor padded to G·ceil(d0/G) rows
    (presets, whose tensors are unknown: unpadded), the trained weights in fp32 (tether trains fp32 masters under
    autocast), LoRA's frozen base in b."""
    total = 0
    for group in model_static(shape, cfg, "actor")["groups"]:
        nbytes = 4 if group["bytes"]["grads"] else group["bytes"]["weights"]
        elements = group["count"] if group["tensors"] is None else cfg.gpus * shard_elements(group["tensors"], cfg.gpus)
        total += nbytes * elements
    return total


def rollout_process_weights(shape: ModelShape, cfg: PlanConfig) -> int:
    """A rollout process's copy of the policy: vLLM's, b·N / K; the transformers engine's, the weights as the sync
    sends them (matmul weights in b, embeddings and norms in fp32: the reference twin's bytes, b·N for a preset)."""
    if cfg.engine == "vllm":
        return (shape.nominal_params or shape.lm_params) * DTYPE_BYTES[cfg.dtype] // cfg.engine_tp
    return model_static(shape, dataclasses.replace(cfg, lora_r=0), "reference")["weights"]


def engine_plan(shape: ModelShape, cfg: PlanConfig) -> list[dict]:
    """Rows (bytes per process) for each layout; ``this_run`` marks the configured one."""
    b, B, S, K = DTYPE_BYTES[cfg.dtype], cfg.batch_size, cfg.prompt_length + cfg.response_length, cfg.engine_tp
    params = shape.nominal_params or shape.lm_params
    trained_bytes = 4  # tether trains in fp32 (bf16 runs: fp32 weights under autocast)
    sharded = cfg.zero == 3 and cfg.gpus > 1
    gathered = gathered_policy_bytes(shape, cfg)
    block = block_params(shape) * (b if cfg.lora_r else trained_bytes)
    sync = 2 * block if sharded else 0
    weights = params * b // K
    R = cfg.rollout_processes or cfg.gpus  # shown with one rollout GPU per trainer when the run has none
    rollout_rows = math.ceil(cfg.gpus / R) * B
    layouts = [
        ("colocated, transformers", "every process", 0, engine_kv_bytes(shape, B, S, b), 0,
         gathered if sharded else 0, cfg.engine == "transformers" and not cfg.rollout_processes),
        (f"colocated, vLLM{f' TP={K}' if K > 1 else ''}", "every process", weights,
         engine_kv_bytes(shape, B, S, b, K), sync, 0, cfg.engine == "vllm" and not cfg.rollout_processes),
        (f"disaggregated, R={R}", "trainer", 0, 0, sync, 0, bool(cfg.rollout_processes)),
        (f"disaggregated, R={R}", "rollout process", rollout_process_weights(shape, cfg),
         engine_kv_bytes(shape, rollout_rows, S, b, K), 0, 0, bool(cfg.rollout_processes)),
    ]
    rows = []
    for layout, process, w, kv, sync_bytes, gathered_bytes, this in layouts:
        total = w + kv + sync_bytes + gathered_bytes
        rows.append({"layout": layout, "process": process, "engine_weights": w, "kv_cache": kv,
                     "sync_blocks": sync_bytes, "gathered_policy": gathered_bytes, "total": total,
                     "vllm_gpu_memory_utilization": gpu_memory_share(w, kv, int(cfg.gpu_memory * GB)) if w else None,
                     "this_run": this})
    return rows


def trainer_engine(shape: ModelShape, cfg: PlanConfig) -> dict:
    """This run's row for a trainer process (colocated: the layout of its engine; disaggregated: the trainer's)."""
    return next(r for r in engine_plan(shape, cfg) if r["this_run"] and r["process"] != "rollout process")


def format_engine_plan(rows: list[dict], cfg: PlanConfig) -> str:
    """The layouts as a plain-text table (GB per process), the configured one marked."""
    def gb(x: int) -> str:
        return f"{x / GB:.2f}" if x else "-"

    lines = [f"rollout engine per process, in each layout (GB; batch {cfg.batch_size}/trainer, {cfg.gpus} trainer(s)"
             f"{f', engine TP {cfg.engine_tp}' if cfg.engine_tp > 1 else ''}; * = this run):"]
    head = (f"  {'layout':<28}{'process':<17}{'weights':>9}{'KV cache':>10}{'sync':>8}{'gathered':>10}{'total':>8}"
            f"  vLLM share")
    lines += [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        share = f"{r['vllm_gpu_memory_utilization']:.2f}" if r["vllm_gpu_memory_utilization"] else "-"
        lines.append(f"{'*' if r['this_run'] else ' '} {r['layout']:<28}{r['process']:<17}{gb(r['engine_weights']):>9}"
                     f"{gb(r['kv_cache']):>10}{gb(r['sync_blocks']):>8}{gb(r['gathered_policy']):>10}"
                     f"{gb(r['total']):>8}  {share}")
    lines.append("  weights: the engine's copy (LoRA merged, b·N / TP); sync: two blocks gathered at once during a "
                 "weight sync (ZeRO-3/FSDP2); gathered: the whole policy FSDP2 generation gathers with the "
                 "transformers engine; the colocated KV cache is the plan's rollout KV row, not in addition to it; "
                 "vLLM share: its gpu_memory_utilization on a GPU")
    if not cfg.rollout_processes:
        lines.append(f"  (disaggregated shown with R = {cfg.gpus} rollout processes, one per trainer: "
                     "--rollout-processes)")
    return "\n".join(lines)
