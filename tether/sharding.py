"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the trainable PPO models, chosen by the accelerate
launch config (``accelerate launch --config_file examples/accelerate/fsdp2.yaml -m tether ppo ...``).

tether shards the models itself instead of letting ``accelerator.prepare`` do it: accelerate only switches
to FSDP from its multi-GPU types, so on CPU processes (gloo) it would silently wrap the models in DDP. One
code path (tether's) runs on CPU and GPU, and it is the one the CPU tests exercise.

What is sharded: the policy (each transformer block, then the root) and the critic (a separate critic's
blocks and root; a value head as one unit). Every trainable module must be sharded, or its gradients would
not be averaged over processes. The frozen reference and reward models stay whole on every process.

Read from the launcher's environment: ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION`` (2 only),
``FSDP_RESHARD_AFTER_FORWARD``, ``FSDP_OFFLOAD_PARAMS`` (refused), ``FSDP_STATE_DICT_TYPE`` (checkpoints
are always full state dicts written by process 0; the setting is noted, not followed).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tether.errors import TetherError


def _env_true(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in ("true", "1", "yes")


@dataclass
class FsdpSettings:
    """The launch config's FSDP settings that tether follows."""

    reshard_after_forward: bool = True  # free the gathered block after its forward (ZeRO-3); False: ZeRO-2-like


def fsdp_settings() -> FsdpSettings | None:
    """The FSDP settings of ``accelerate launch --config_file ...`` (None when the launch asked for none)."""
    if not _env_true("ACCELERATE_USE_FSDP"):
        return None
    version = os.environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise TetherError(f"accelerate config: fsdp_version {version}: tether shards with FSDP2 only "
                          "(set fsdp_version: 2, as in examples/accelerate/fsdp2.yaml)")
    if _env_true("FSDP_OFFLOAD_PARAMS"):
        raise TetherError("accelerate config: fsdp_offload_params: true is not supported by tether (set it to false)")
    return FsdpSettings(reshard_after_forward=_env_true("FSDP_RESHARD_AFTER_FORWARD", "true"))


def _block_class_names(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks (Hugging Face's ``_no_split_modules``, the unit accelerate's
    transformer auto-wrap policy uses)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def shard(model: nn.Module, settings: FsdpSettings, device: torch.device) -> nn.Module:
    """Apply ``fully_shard`` to each transformer block of ``model``, then to ``model`` itself (embeddings,
    final norm, heads, and anything not in a block). Sharded in place: the parameters become DTensors, so
    optimisers must be built after this."""
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    # FSDP2 warns that a view returned by a wrapped module loses its pre-backward hook under in-place ops;
    # tether never modifies model outputs in place (masks multiply out of place).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # Each process seeds its own RNG (they sample different responses), so randomly initialised weights (the
    # value head, LoRA adapters) differ between processes: take process 0's, as DDP does when it wraps.
    if torch.distributed.is_initialized():
        with torch.no_grad():
            for tensor in [p for p in model.parameters() if p.requires_grad] + list(model.buffers()):
                torch.distributed.broadcast(tensor.data, src=0)
    names = _block_class_names(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    for block in blocks:
        fully_shard(block, reshard_after_forward=settings.reshard_after_forward)
    # A peft model generates through its base model's generate (bypassing its own forward): the root must be
    # the base model, the module every forward and every generation enters first.
    root = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    fully_shard(root, reshard_after_forward=settings.reshard_after_forward)
    return model


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules inside ``model``, the root first (pre-order)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module, settings: FsdpSettings | None):
    """All of ``model``'s parameters gathered once, for a generation: sharded, every decoding step would
    all-gather every block again (one all-gather per layer per token). Costs the full weights on every
    process for the duration. Collective: every process enters it. No-op for an unsharded model."""
    units = fsdp_units(model)
    # Re-entrant: evaluation gathers once for all its chunks, and each chunk's rollout_batch asks again.
    if settings is None or not units or getattr(model, "_tether_gathered", False):
        yield
        return
    model._tether_gathered = True
    inner = units[1:]  # the root never reshards after forward (FSDP2's rule)
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
        for m in inner:
            m.set_reshard_after_forward(settings.reshard_after_forward, recurse=False)
        model._tether_gathered = False


def set_gradient_sync(models: list[nn.Module], sync: bool) -> None:
    """Accumulate gradients locally (``sync`` False) or reduce-scatter them at this backward (True): FSDP2's
    ``no_sync``. The unsharded gradients are held between micro-batches, as DDP holds its full copy."""
    for model in models:
        for unit in fsdp_units(model):
            unit.set_requires_gradient_sync(sync, recurse=False)


def grad_norm_value(norm) -> float:
    """``clip_grad_norm_`` over DTensor parameters returns a DTensor: its full value, the same on every process."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


# ------------------------------------------------------------------------------ state dicts (B14)
def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on process 0 (CPU tensors; empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (full tensors keyed as the model's own state dict, the same on every process; keys it
    lacks keep their values) into the sharded ``model``: each process keeps its shard. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    own = set(model.state_dict().keys())
    unexpected = [k for k in state if k not in own]
    if unexpected:
        raise RuntimeError(f"checkpoint does not match the sharded model (unexpected {unexpected[:3]})")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimiser's state with full tensors, keyed by parameter name, on process 0. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a :func:`full_optimizer_state` (the same on every process) into the sharded optimiser. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def adapter_keys_to_model_keys(saved: dict[str, torch.Tensor], model_keys) -> dict[str, torch.Tensor]:
    """A peft adapter file names ``...lora_A.weight``; the model's state dict names ``...lora_A.default.weight``
    (the adapter's name inside). Map the file's keys onto the model's."""
    by_saved_name = {k.replace(".default.", "."): k for k in model_keys}
    out = {}
    for key, value in saved.items():
        if key not in by_saved_name:
            raise RuntimeError(f"adapter checkpoint key {key} matches no parameter of the sharded policy")
        out[by_saved_name[key]] = value
    return out


def load_sharded_checkpoint(path, policy_model: nn.Module, critic: nn.Module | None) -> dict:
    """Restore a checkpoint's weights into sharded models (every process reads the files and keeps its shard)
    and return its trainer state. Collective. ``critic`` None: the run has none (B17), nor the checkpoint."""
    from pathlib import Path

    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for f in sorted((Path(path) / "policy").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    if hasattr(policy_model, "peft_config"):
        saved = adapter_keys_to_model_keys(saved, policy_model.state_dict().keys())
    load_full_model_state(policy_model, saved)  # tied weights (lm_head) are not in the file: they follow
    if critic is not None:
        load_full_model_state(critic, load_file(str(Path(path) / "critic.safetensors")))
    return torch.load(Path(path) / "trainer_state.pt", weights_only=True)
