"""Throughput accounting for a PPO step (C6): the FLOP shape of each model, the device's peak FLOP/s, and
the step's model FLOPs per phase, so that ``perf/mfu`` = FLOPs / (seconds × peak). The formulas are
:mod:`tether.core.flops`; this module only reads models and the device.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tether.watchdog import mark
from tether.core.flops import FlopShape, forward_flops, generation_flops, train_flops

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


@dataclass(frozen=True)
class Throughput:
    """What the step's FLOP count needs, measured once at set-up."""

    policy: FlopShape
    critic: FlopShape | None   # a separate critic's backbone + value head; None: a head on the policy, or none
    value_head_params: int     # matmul weights of the value head (the whole critic cost of a head); 0: no critic
    peak: float                # FLOP/s of one device
    peak_source: str


def throughput_of(models, device: torch.device, dtype: torch.dtype = torch.float32) -> Throughput:
    """FLOP shapes of the policy and the critic (``models``: :class:`~tether.ppo.setup.Models`) and the peak."""
    critic = models.unwrapped_critic
    head = getattr(critic, "head", critic)
    head_params = sum(p.numel() for p in head.parameters() if p.dim() == 2) if critic is not None else 0
    critic_shape = None
    if hasattr(critic, "backbone"):
        body = flop_shape(critic.backbone)
        critic_shape = FlopShape(body.matmul_params + head_params, 0, body.layers, body.width)
    peak, source = peak_flops(device, dtype)
    return Throughput(flop_shape(models.unwrapped_policy), critic_shape, head_params, peak, source)


def step_flops(t: Throughput, query_mask: torch.Tensor, lengths: torch.Tensor, epochs_run: int,
               critic_only: bool, prompt_share: torch.Tensor | None = None,
               generated: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Model FLOPs of one step's phases on this process (``query_mask`` (B, P), ``lengths`` (B,) response
    tokens). Forwards over prompt + response compute logits only for the response (B2's ``logits_to_keep``);
    the train phase makes ``epochs_run`` passes of forward + backward (a policy forward only, no backward,
    during critic warm-up). Reward-model forwards are not counted: they run on their own tokenizer.
    ``prompt_share`` (B,): the share of its prompt each row's policy forwards compute — 1/n for a prompt that n
    rows share under ``ppo.packing`` (computed once for them all); None: 1 (padded rows). ``generated``: (N,) ×2,
    prompt and response tokens of every row generation made, when it made more than the step scores (the rounds of
    ``--filter-groups``); None: the step's own rows."""
    prompt = query_mask.sum(dim=1).tolist()
    response = lengths.tolist()
    share = [1.0] * len(prompt) if prompt_share is None else prompt_share.tolist()
    made = (prompt, response) if generated is None else (generated[0].tolist(), generated[1].tolist())
    gen = sum(generation_flops(t.policy, p, r) for p, r in zip(*made))
    policy = sum(forward_flops(t.policy, p * s + r, with_head=False) + 2.0 * t.policy.head_params * r
                 for p, r, s in zip(prompt, response, share))
    if t.critic is not None:
        critic = sum(forward_flops(t.critic, p + r, with_head=False) for p, r in zip(prompt, response))
    else:
        critic = sum(2.0 * t.value_head_params * (r + 1) for r in response)
    train = epochs_run * ((policy if critic_only else train_flops(policy)) + train_flops(critic))
    return {"generate": gen, "logprobs_old": policy, "reference": policy, "values": critic, "train": train}


def prompt_shares(query: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """(B,) 1/n for each row whose prompt (its tokens) n rows of the batch share: what a packed forward computes."""
    keys = [tuple(q[m.bool()].tolist()) for q, m in zip(query, query_mask)]
    counts = {k: keys.count(k) for k in set(keys)}
    return torch.tensor([1.0 / counts[k] for k in keys])


def padding_fraction(query_mask: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Share of the positions a forward over the padded (B, P + T) batch computes that are padding."""
    computed = query_mask.numel() + response_mask.numel()
    return 1.0 - float(query_mask.sum() + response_mask.sum()) / max(computed, 1)


@dataclass
class PhaseTimer:
    """Wall seconds per phase of one step (C2). ``with timer(phase):`` times a block; ``timer.split(part)``
    inside a block charges the seconds since the block began (or the previous split) to ``part``, and a
    block with splits is charged only to its parts (the time after the last split goes to that part).
    Each block, and each part of one, is also the process's phase for the hang watchdog (:mod:`tether.watchdog`):
    ``PHASE`` inside the block, ``PHASE (after PART)`` after a split, ``after PHASE`` once it is left."""

    seconds: dict = field(default_factory=dict)
    _mark: float = 0.0
    _last: str = ""
    _block: str = ""

    @contextmanager
    def __call__(self, phase: str):
        self._mark, self._last, self._block = time.perf_counter(), phase, phase
        mark(phase)
        yield
        self._charge(self._last)
        mark(f"after {phase}")

    def split(self, part: str) -> None:
        self._charge(part)
        mark(f"{self._block} (after {part})")

    def _charge(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._mark
        self._mark, self._last = now, part
