"""The memory model under the planner (:mod:`tether.diagnostics.plan`, SPEC C1): bytes per dtype, the planner's config,
and the static memory of one model (weights, gradients, Adam, master) with its ZeRO/FSDP2 sharding, the KV cache and
the activation estimate — the formulas of plan.py's docstring and docs/plan.md. Its own module so that both the
trainers' plan and the rollout engines' (:mod:`tether.diagnostics.engine_plan`) build on it without importing each
other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.config import option
from tether.diagnostics.shapes import ModelShape, lora_params, lora_tensors

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
    batch_size: int = option(8, "sequences per GPU in one forward (generation batch, and train micro-batch unless "
                             "--train-batch-size)", low=1)
    train_batch_size: int | None = option(None, "sequences per GPU in one training forward (the micro-batch: "
                                          "tether ppo's batch / --mini-batches / --grad-accumulation); "
                                          "default: --batch-size", low=1)
    logits_chunk: int = option(0, "tokens whose output-head logits exist at once in a training forward (tether ppo "
                                  "computes its log-probs 1024 at a time); 0 = the whole (B, S, V)", low=0)
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
    """Activations kept for backward by one trained model, over one micro-batch (``train_batch_size``); ``head`` is
    ``lm`` or ``value``. The LM head's logits, (tokens, V) in the dtype + their fp32 log-softmax, count
    min(B·S, ``logits_chunk``) tokens when the log-probs are taken a chunk at a time (checkpointed: one chunk's logits
    live at once), else all B·S."""
    b, B, S = DTYPE_BYTES[cfg.dtype], train_batch(cfg), cfg.prompt_length + cfg.response_length
    layer = layer_activation_bytes(shape, B, S, b, cfg.attention)
    body = (shape.layers * B * S * shape.hidden * b + layer) if cfg.gradient_checkpointing else shape.layers * layer
    logit_tokens = min(B * S, cfg.logits_chunk) if cfg.logits_chunk else B * S
    return body + (logit_tokens * shape.vocab * (b + 4) if head == "lm" else B * S * 4)


def train_batch(cfg: PlanConfig) -> int:
    """Sequences in one training forward: ``train_batch_size``, else ``batch_size``."""
    return cfg.train_batch_size or cfg.batch_size


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
