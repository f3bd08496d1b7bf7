"""How a run computes (SPEC C5): the compute dtype, autocast around every forward, the fp16 loss scaler, and which
parameters autocast casts — shared by the stages that train (PPO, SFT), the reference twin, and the weight sync that
sends each tensor in the dtype it is computed in."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Precision:
    """How the run computes (C5): ``dtype`` is ``--model-dtype``; bf16/fp16 forwards run under
    ``torch.autocast`` (matmuls in ``dtype``; the residual stream, norms and everything autocast leaves alone
    in the parameters' fp32), fp32 runs with autocast off. fp16 also needs a loss scaler: gradients below
    fp16's smallest normal (6e-5) would flush to 0, so the loss is multiplied by a scale S before backward,
    gradients divided by S before clipping, and a step with inf/NaN gradients is skipped while S halves."""

    dtype: torch.dtype
    device_type: str

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    def autocast(self):
        """The context every policy, reference and critic forward runs in (a no-op for fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Enabled for fp16 only; disabled, its ``scale``/``unscale_``/``step``/``update`` are pass-throughs."""
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == torch.float16)


def autocast_cast_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters autocast casts to the compute dtype before every use: the weights and biases of
    ``nn.Linear`` (``F.linear``) and transformers' ``Conv1D`` (``torch.addmm``), unless a parameter is shared
    with another kind of module (a tied embedding is also looked up, outside autocast's casts)."""
    from transformers.pytorch_utils import Conv1D

    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return {i for i, mods in owners.items() if all(isinstance(m, (nn.Linear, Conv1D)) for m in mods)}
