"""The policy's weights for an engine that holds its own copy (C3, C4), one transformer block at a time.

An engine outside the trainer's module (vLLM in this process, or a rollout process of the disaggregated layout)
takes the weights as a checkpoint names them: what ``save_pretrained`` of the merged model would write, a LoRA
adapter folded in (W + ΔW per adapted layer), the training model left untouched. :func:`policy_blocks` yields
them block by block (each transformer block, then the rest: embeddings, final norm, head), so that no process
ever holds a whole extra copy of the policy:

- **FSDP2**: each process holds a shard (dim 0) of every parameter. A block's full tensors are all-gathered from
  the shards (one collective per block and dtype), handed on, and dropped; the next block's all-gather is started
  before the current block is handed on, so gathering overlaps with loading or broadcasting it (reference 000
  §C.6's pipelined layer-wise sync). Collective: every process of the trainers' group iterates, in the same order.
- **Unsharded** (one process, DDP): the tensors are the module's own (no copy), LoRA layers folded.

The gathered tensors are fresh allocations, not views of FSDP2's unshard buffers: an engine may keep references
after the block has been handed on (vLLM's layer-wise reload buffers a layer's weights until it has them all).

With a compute dtype (``--model-dtype bf16``/``fp16``) each tensor goes in the dtype the forward computes it in: a
weight or bias that autocast casts before every use (:func:`tether.precision.autocast_cast_parameters`: Linear and
Conv1D, not tied to an embedding) in the compute dtype, cast from the fp32 master exactly as autocast casts it (and
before the all-gather: half the bytes); embeddings, norms and tied weights as held (fp32 masters). An engine then
samples with the numbers the trainer computes with, and a bf16 run sends ~half the bytes of its fp32 masters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Block:
    """One unit of the weight sync: the checkpoint names of its tensors and where each comes from."""

    prefix: str                                   # the block's module path ('' for the rest of the model)
    tensors: dict[str, torch.Tensor]              # checkpoint name -> the module's own tensor (maybe a DTensor)
    # merged weight name -> (base weight, [(A, B, scale, fan_in_fan_out) per active adapter])
    lora: dict[str, tuple] = field(default_factory=dict)


@dataclass
class SyncSeconds:
    """Where a weight sync's wall time went: ``gather`` waiting for a block's full tensors (the all-gather not
    hidden behind the previous block's transfer, and folding LoRA in), ``transfer`` the rest (the engine loading
    them, or the broadcast to rollout processes); gather + transfer = the sync's wall time."""

    gather: float = 0.0
    transfer: float = 0.0


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft model (checkpoint names are its names), else ``model``."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def block_prefixes(model: nn.Module) -> list[str]:
    """Module paths of the transformer blocks (Hugging Face's ``_no_split_modules`` classes, the unit FSDP2
    shards), in forward order."""
    from tether.sharding import _block_class_names

    names = _block_class_names(model)
    return [name for name, m in model.named_modules() if name and type(m).__name__ in names]


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set


def checkpoint_blocks(model: nn.Module) -> list[Block]:
    """The policy's tensors grouped into blocks, under checkpoint names (a tied weight under each of its names,
    as ``state_dict`` lists it; LoRA's A and B folded into their base layer's ``weight``)."""
    base = base_model(model)
    prefixes = block_prefixes(base)
    blocks = [Block(p, {}) for p in prefixes] + [Block("", {})]

    def owner(name: str) -> Block:
        for block in blocks[:-1]:
            if name.startswith(block.prefix + "."):
                return block
        return blocks[-1]

    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "get_base_layer"):  # a peft LoRA layer
            adapters = [(module.lora_A[a].weight, module.lora_B[a].weight, module.scaling[a], module.fan_in_fan_out)
                        for a in module.active_adapters if a in module.lora_A and not module.disable_adapters]
            owner(name).lora[f"{name}.weight"] = (module.get_base_layer().weight, adapters)
    named = list(base.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in base.named_buffers(remove_duplicate=False) if _persistent(base, n)]
    for name, t in named:
        if "lora_" in name:
            continue
        ckpt = name.replace(".base_layer.", ".")
        block = owner(ckpt)
        if ckpt not in block.lora:
            block.tensors[ckpt] = t
    return blocks


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """ΔW = scale · (B @ A), transposed when the base layer stores W as (in, out) (GPT-2's Conv1D): A (r, in),
    B (out, r), in the adapters' dtype. Computed as peft's ``get_delta_weight`` does (bf16/fp16 adapters in fp32
    on a CPU, then cast back)."""
    dtype = a.dtype
    if a.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    delta = b @ a
    return ((delta.T if fan_in_fan_out else delta) * scale).to(dtype)


def _is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class _Gather:
    """The all-gather of one block's sharded tensors, started at once (async), each in its ``dtypes`` entry (cast
    before gathering: elementwise, so the same as casting the full tensor), grouped by dtype: one collective per
    dtype. ``wait()`` returns every tensor of the block full and local, in its dtype."""

    def __init__(self, tensors: list[torch.Tensor], dtypes: list[torch.dtype]):
        self.tensors, self.dtypes = tensors, dtypes
        self.pending = []  # (work, output (G, n), [(index, local rows, shape)])
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            if _is_sharded(t):
                by_dtype.setdefault(dtypes[i], []).append(i)
        for dtype, indices in by_dtype.items():
            group = tensors[indices[0]].device_mesh.get_group()
            world = torch.distributed.get_world_size(group)
            parts, layout = [], []
            for i in indices:
                t = tensors[i]
                assert tuple(t.placements) == (torch.distributed.tensor.Shard(0),), t.placements
                rows = -(-t.shape[0] // world)  # torch.chunk's (and FSDP2's) chunk: ceil(d0 / G) rows
                local = t.to_local().to(dtype)
                padded = local.new_zeros((rows, *t.shape[1:]))
                padded[:local.shape[0]] = local
                parts.append(padded.reshape(-1))
                layout.append((i, rows, tuple(t.shape)))
            flat = torch.cat(parts)
            out = flat.new_empty(world * flat.numel())  # gloo takes a flat output only
            work = torch.distributed.all_gather_into_tensor(out, flat, group=group, async_op=True)
            self.pending.append((work, out.view(world, flat.numel()), layout))

    def wait(self) -> list[torch.Tensor]:
        full = [t if _is_sharded(t) else t.to(dtype) for t, dtype in zip(self.tensors, self.dtypes)]
        for work, out, layout in self.pending:
            work.wait()
            if out.is_cuda:  # NCCL's wait only orders the streams: time the gather's completion, not its enqueue
                torch.cuda.current_stream(out.device).synchronize()
            offset = 0
            for i, rows, shape in layout:
                n = rows * (torch.Size(shape[1:]).numel())
                chunks = out[:, offset:offset + n].reshape(out.shape[0], rows, *shape[1:])
                full[i] = chunks.reshape(-1, *shape[1:])[:shape[0]].clone()  # ranks' chunks in order, padding cut
                offset += n
        return full


def wire_dtype(t: torch.Tensor, cast: set[int], compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is sent in: the compute dtype when autocast casts it before use (``cast``: ids of such
    parameters), else its own."""
    return compute_dtype if compute_dtype is not None and id(t) in cast else t.dtype


def _block_inputs(block: Block, cast: set[int], compute_dtype: torch.dtype | None
                  ) -> tuple[list[torch.Tensor], list[torch.dtype], list[int]]:
    """The block's source tensors, each once (a tied weight is gathered once), the dtype each is gathered in (LoRA's A
    and B in their own: ΔW is computed from them as peft does), and for each entry of :func:`_assemble`'s walk
    (names, then each LoRA base, A, B) its index among them."""
    unique: dict[int, int] = {}
    inputs: list[torch.Tensor] = []
    dtypes: list[torch.dtype] = []
    walk = [(t, wire_dtype(t, cast, compute_dtype)) for t in block.tensors.values()]
    for base, adapters in block.lora.values():
        walk.append((base, wire_dtype(base, cast, compute_dtype)))
        for a, b, _, _ in adapters:
            walk += [(a, a.dtype), (b, b.dtype)]
    index = []
    for t, dtype in walk:
        if id(t) not in unique:
            unique[id(t)] = len(inputs)
            inputs.append(t)
            dtypes.append(dtype)
        index.append(unique[id(t)])
    return inputs, dtypes, index


def _assemble(block: Block, full: list[torch.Tensor], index: list[int]) -> dict[str, torch.Tensor]:
    """The block's checkpoint tensors from its gathered inputs (:func:`_block_inputs`), LoRA folded: W + ΔW for
    each adapter (peft's merge, without touching the training model). Tied names share one tensor."""
    walk = iter(full[i].detach() for i in index)
    out = {name: next(walk) for name in block.tensors}
    for name, (_, adapters) in block.lora.items():
        weight = next(walk)
        for _, _, scale, fan_in_fan_out in adapters:
            a, b = next(walk), next(walk)
            # peft's merge, weight += ΔW: summed in the wider dtype, rounded once to the base's
            weight = (weight + lora_delta(a, b, scale, fan_in_fan_out)).to(weight.dtype)
        out[name] = weight
    return out


def cast_parameters(model: nn.Module, compute_dtype: torch.dtype | None) -> set[int]:
    """ids of the policy's parameters that go in ``compute_dtype`` (none for fp32 or None)."""
    from tether.precision import autocast_cast_parameters

    if compute_dtype in (None, torch.float32):
        return set()
    return autocast_cast_parameters(base_model(model))


@torch.no_grad()
def policy_blocks(model: nn.Module, seconds: SyncSeconds | None = None,
                  compute_dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The policy's checkpoint tensors, one block (dict name -> full tensor) at a time; the next block's all-gather
    runs while the caller uses the current one. ``seconds.gather`` accumulates the time spent waiting for a block
    (and folding LoRA in). ``compute_dtype``: the run's (see the module docstring); None keeps every dtype.
    Collective under FSDP2: every process of the group iterates to the end, with the same ``compute_dtype``."""
    blocks = checkpoint_blocks(model)
    cast = cast_parameters(model, compute_dtype)
    inputs, dtypes, index = _block_inputs(blocks[0], cast, compute_dtype)
    gather = _Gather(inputs, dtypes)
    for k, block in enumerate(blocks):
        start = time.perf_counter()
        tensors = _assemble(block, gather.wait(), index)
        if seconds is not None:
            seconds.gather += time.perf_counter() - start
        if k + 1 < len(blocks):  # in flight while this block is loaded or broadcast
            inputs, dtypes, index = _block_inputs(blocks[k + 1], cast, compute_dtype)
            gather = _Gather(inputs, dtypes)
        yield tensors


def policy_weights(model: nn.Module, compute_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All of the policy's checkpoint tensors at once (an unsharded model: its own tensors, LoRA folded into new
    ones). Collective under FSDP2, and then a whole full copy: use :func:`policy_blocks` to stream them."""
    weights: dict[str, torch.Tensor] = {}
    for block in policy_blocks(model, compute_dtype=compute_dtype):
        weights.update(block)
    return weights


def manifest(model: nn.Module, compute_dtype: torch.dtype | None = None) -> list[list[tuple[str, tuple, str, str]]]:
    """What :func:`policy_blocks` will yield, without gathering anything: per block, (checkpoint name, shape, dtype
    on the wire, the name it is tied to or '') in yield order. A receiver allocates from it; a tied tensor is sent
    once."""
    cast = cast_parameters(model, compute_dtype)
    out = []
    for block in checkpoint_blocks(model):
        first: dict[int, str] = {}
        entries = []
        sources = [(name, t) for name, t in block.tensors.items()] + [(name, base) for name, (base, _) in
                                                                     block.lora.items()]
        for name, t in sources:
            tied = first.setdefault(id(t), name)
            dtype = str(wire_dtype(t, cast, compute_dtype)).removeprefix("torch.")
            entries.append((name, tuple(t.shape), dtype, "" if tied == name else tied))
        out.append(entries)
    return out
