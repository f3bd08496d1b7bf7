"""Set up an SFT run: processes (accelerate), rows and their tokens, the model (LoRA or full, its precision, sharded
or DDP-wrapped), optimisation, the step order — each built by one small function; :func:`setup` returns them as
an :class:`SFTRun`. The same on one CPU process and under ``accelerate launch`` (DDP, or FSDP2 from the launch
config: :mod:`tether.sharding`).
"""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tether.errors import ConfigError, TetherError
from tether.hf import DTYPES
from tether.precision import Precision
from tether.processes import Processes, open_processes
from tether.sft.batches import StepStream, check_packing, packing_layout
from tether.sft.config import SFTConfig
from tether.sft.data import SFTRow, prompt_row, read_rows
from tether.sft.tokens import Example, TextFormat, encode_rows, text_format
from tether.sharding import FsdpSettings

PYTHON = "python:"  # what config.yaml records for a model or data handed over from Python


@dataclass
class Given:
    """What a Python caller handed :class:`~tether.sft.train.SFTTrainer` in place of paths."""

    train_data: object = None    # a datasets.Dataset or a list of rows, in place of data.files
    eval_data: object = None     # ... of data.eval_files
    eval_prompts: object = None  # prompt rows, in place of eval.prompts
    model: nn.Module | None = None
    tokenizer: object = None
    gold: Callable | None = None


@dataclass
class SFTRun:
    """An SFT run's parts. ``model`` is what trains (DDP-wrapped under several processes; FSDP2 shards it in
    place); ``unwrapped`` the transformers model inside (a peft model with LoRA): generation and saving."""

    processes: Processes
    model: nn.Module
    unwrapped: nn.Module
    tokenizer: object
    fmt: TextFormat
    precision: Precision           # every forward runs in precision.autocast() (C5)
    packing: str | None            # None (padded), "rows" or "one_row" (tether.sft.batches)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler   # fp16's loss scaler; a pass-through otherwise
    params: list[nn.Parameter]
    stream: StepStream
    train: list[Example]
    held_out: list[Example]
    eval_rows: list[dict]          # prompts (with their columns) for gold accuracy
    gold: Callable | None          # rule of eval/accuracy
    total_steps: int
    eval_max_new_tokens: int       # eval.max_new_tokens, capped by the model's context (gold_answer_length)
    fsdp: FsdpSettings | None = None
    data_info: dict = field(default_factory=dict)


def read_data(cfg: SFTConfig, given: Given) -> tuple[list[SFTRow], list[SFTRow], dict]:
    """Training and held-out rows (held out by prompt when there is no --eval-data), and what was read."""
    from tether.inputs.splits import split_by_prompt

    rows, stats = read_rows(cfg.data.files, given.train_data, "train_data", cfg.data.skip_invalid)
    if cfg.data.max_rows:
        rows = rows[:cfg.data.max_rows]
    info = {"read": stats.summary()}
    if given.eval_data is not None or cfg.data.eval_files:
        held_out, eval_stats = read_rows(cfg.data.eval_files, given.eval_data, "eval_data", cfg.data.skip_invalid)
        info["held_out_read"] = eval_stats.summary()
    elif cfg.data.eval_fraction > 0 and len({str(r.prompt) for r in rows}) > 1:
        rows, held_out = split_by_prompt(rows, cfg.data.eval_fraction, cfg.seed)
    else:
        held_out = []
    info.update(train_rows=len(rows), held_out_rows=len(held_out))
    return rows, held_out, info


def load_tokenizer_and_model(cfg: SFTConfig, given: Given) -> tuple[object, nn.Module, str]:
    """The tokenizer (with --chat-template-file set) and the model to train: LoRA adapters in fp32 on a base in
    --model-dtype, or a full model in fp32 (the masters; bf16/fp16 compute under autocast). Returns them and the
    model's name for messages."""
    from tether.hf import apply_lora, disable_dropout, load_causal_lm, load_tokenizer, upcast_trainable
    from tether.presets import resolve_model_path

    m = cfg.model
    if given.model is not None:
        if given.tokenizer is None:
            raise ConfigError("SFTTrainer(model=...): give its tokenizer too (tokenizer=...)")
        tokenizer, model, name = given.tokenizer, given.model, m.path
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        path = resolve_model_path(m.path, what="model")
        tokenizer = given.tokenizer or load_tokenizer(path, m.trust_remote_code)
        # A full fine-tune loads fp32: its masters are then the checkpoint's exact values.
        model = load_causal_lm(path, m.dtype if m.lora_r else "fp32", m.trust_remote_code, dropout=True)
        name = str(path)
    if cfg.data.chat_template_file:
        template = Path(cfg.data.chat_template_file)
        if not template.is_file():
            raise ConfigError(f"--chat-template-file {template}: file not found")
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if m.disable_dropout:
        disable_dropout(model)
    if m.lora_r:
        model = apply_lora(model, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules,
                           key="model.lora_target_modules")
    else:
        upcast_trainable(model)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if m.lora_r:
            model.enable_input_require_grads()  # the frozen embeddings' output must carry a gradient
    return tokenizer, model, name


def data_digest(examples: list[Example]) -> str:
    """SHA-256 of the tokenised training sequences and their labels, in order (a resume must train on the same)."""
    h = hashlib.sha256()
    for e in examples:
        h.update(torch.tensor(e.ids + [-1] + e.labels, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def make_optimisation(cfg: SFTConfig, model: nn.Module, total_steps: int, precision: Precision) -> tuple:
    """``(params, AdamW, schedule, loss scaler)``: linear warm-up over ``optim.warmup_ratio`` of the steps, then
    constant, linear or cosine to 0 at the last step (transformers' schedules)."""
    from transformers import get_scheduler

    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, eps=o.adam_eps)
    name = "constant_with_warmup" if o.schedule == "constant" else o.schedule  # "constant" ignores warm-up
    scheduler = get_scheduler(name, optimizer, int(o.warmup_ratio * total_steps), total_steps)
    return params, optimizer, scheduler, precision.grad_scaler()


def place_model(processes: Processes, model: nn.Module, optimizer_of) -> tuple[nn.Module, nn.Module, tuple]:
    """The model on this process's device, sharded (FSDP2, in place) or DDP-wrapped (``accelerator.prepare``);
    ``optimizer_of(model)`` builds the optimisation after sharding (FSDP2's parameters are DTensors). Returns
    ``(model that trains, unwrapped model, optimisation)``."""
    from tether.sharding import shard

    if processes.fsdp is not None:
        shard(model, processes.fsdp, processes.device).train()
        return model, model, optimizer_of(model)
    model.to(processes.device)
    params, optimizer, scheduler, scaler = optimizer_of(model)
    wrapped, optimizer = processes.accelerator.prepare(model, optimizer)
    wrapped.train()
    return wrapped, processes.accelerator.unwrap_model(wrapped), (params, optimizer, scheduler, scaler)


def gold_setup(cfg: SFTConfig, given: Given, held_out: list[SFTRow]) -> tuple[list[dict], Callable | None]:
    """The prompts of the gold evaluation (--eval-prompts, else the held-out rows') and its rule (--gold)."""
    from tether.inputs.prompt_rows import load_prompts, prompts_from_data
    from tether.rules.calls import gold_rule

    if given.eval_prompts is not None:
        rows = prompts_from_data(given.eval_prompts, "eval_prompts")
    elif cfg.eval.prompts:
        rows = load_prompts(cfg.eval.prompts)
    else:
        rows = [row for row in map(prompt_row, held_out) if row is not None]  # a text row asks nothing
    return rows, gold_rule(cfg.eval.gold, rows, given.gold) if rows else None


def gold_answer_length(cfg: SFTConfig, tokenizer, fmt: TextFormat, model_config, rows: list[dict],
                       say: bool = True) -> int:
    """``eval.max_new_tokens``, or less when the longest gold prompt plus it would run past the model's positions
    (a note says so: position embeddings indexed past their end fail mid-run)."""
    from tether.hf import context_positions
    from tether.rollout.sampling import encode_prompts

    context, wanted = context_positions(model_config), cfg.eval.max_new_tokens
    if not rows or not context or cfg.eval.max_prompt_length + wanted <= context:
        return wanted
    widths = [encode_prompts(tokenizer, [r["prompt"]], cfg.eval.max_prompt_length, fmt.use_chat_template,
                             fmt.system_prompt, fmt.prompt_template)[0].shape[1] for r in rows[:cfg.eval.n]]
    room = context - max(widths)
    if room < 1:
        raise TetherError(f"--eval-prompts: a prompt of {max(widths)} tokens fills the model's {context} positions; "
                          f"lower eval.max_prompt_length")
    if room < wanted and say:
        print(f"note: gold answers capped at {room} new tokens (--max-new-tokens {wanted} + the longest prompt, "
              f"{max(widths)} tokens, > the model's {context} positions)", file=sys.stderr)
    return min(room, wanted)


def setup(cfg: SFTConfig, given: Given) -> SFTRun:
    """The run of ``cfg`` (checked); ``given``: what Python handed over in place of paths."""
    from transformers.utils import logging as hf_logging

    from tether.runlog import check_trackers, tracker_names

    hf_logging.disable_progress_bar()  # tether shows its own progress
    trackers = tracker_names(cfg)
    check_trackers(trackers)
    processes = open_processes(cfg.output_dir, trackers, cfg.model.dtype, cfg.collective_timeout_minutes)
    precision = Precision(DTYPES[cfg.model.dtype], processes.device.type)
    if processes.fsdp is not None and precision.dtype == torch.float16:
        raise TetherError("--dtype fp16 under FSDP2: not supported (the loss scaler would need a "
                          "cross-process inf check); use bf16, or fp16 with DDP")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # LoRA's initialisation and dropout: the same on every process
    rows, held_rows, info = read_data(cfg, given)
    tokenizer, model, name = load_tokenizer_and_model(cfg, given)
    fmt = text_format(cfg.data, tokenizer, model, name)
    train, info["train"] = encode_rows(tokenizer, rows, fmt)
    held_out, info["held_out"] = encode_rows(tokenizer, held_rows, fmt) if held_rows else ([], {})
    eval_rows, gold = gold_setup(cfg, given, held_rows)
    answer_length = gold_answer_length(cfg, tokenizer, fmt, model.config, eval_rows, processes.is_main) if gold else 0
    layout = packing_layout(model, cfg.data.packing)
    if layout is not None:
        check_packing(model, layout, next(model.parameters()).device)
    o = cfg.optim
    stream = StepStream(train, o.batch_size, o.grad_accumulation, cfg.seed, cfg.data.group_by_length, o.drop_last,
                        processes.rank, processes.world_size)
    total = o.max_steps or o.epochs * stream.steps_per_epoch
    model_, unwrapped, (params, optimizer, scheduler, scaler) = place_model(
        processes, model, lambda m: make_optimisation(cfg, m, total, precision))
    info.update(digest=data_digest(train), steps=total, steps_per_epoch=stream.steps_per_epoch,
                trainable_parameters=sum(p.numel() for p in params), format="chat" if fmt.use_chat_template else "plain",
                packing=layout or "off")
    return SFTRun(processes, model_, unwrapped, tokenizer, fmt, precision, layout, optimizer, scheduler, scaler,
                  params, stream, train, held_out, eval_rows, gold, total, answer_length, processes.fsdp, info)
