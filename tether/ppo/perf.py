"""Throughput accounting for a PPO step (C6): the FLOP shape of each model, the device's peak FLOP/s, and
the step's model FLOPs per phase, so that ``perf/mfu`` = FLOPs / (seconds × peak). The formulas are
:mod:`tether.core.flops`; this module only reads models and the device.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tether.core.flops import FlopShape

EMBEDDING_NAMES = ("wte", "wpe", "embed_tokens", "embed_positions", "word_embeddings", "position_embeddings")
# Dense peak FLOP/s by device name fragment (bf16/fp16 tensor cores, no sparsity), for GPUs.
GPU_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
            "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12}


def flop_shape(model: nn.Module) -> FlopShape:
    """Matmul parameters of ``model`` (2-D weights, embeddings excluded), its LM head's d·V (tied or not),
    layers and width, from the module itself (works for LoRA-wrapped and DDP-wrapped models: the adapter's
    small matmuls are counted too)."""
    model = getattr(model, "module", model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_params = head.weight.numel() if isinstance(head, nn.Module) and hasattr(head, "weight") else 0
    head_ids = {id(head.weight)} if head_params else set()
    matmul = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and id(p) not in head_ids and not any(e in name for e in EMBEDDING_NAMES))
    return FlopShape(matmul_params=matmul, head_params=head_params, layers=config.num_hidden_layers,
                     width=config.hidden_size)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.3) -> tuple[float, str]:
    """The device's peak FLOP/s and where the figure comes from: a GPU's table entry for bf16/fp16, else (a CPU,
    fp32, an unknown GPU) a short matmul probe (n = 1024, the best of repeated runs within ``seconds``)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for fragment, peak in GPU_PEAK.items():
            if fragment in name:
                return peak, f"{name} table ({str(dtype).replace('torch.', '')} dense)"
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best, f"matmul probe ({n}x{n} {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads)"
