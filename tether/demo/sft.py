"""The demo's SFT, batched answer generation and gold accuracy.

SFT runs through Stage 0's trainer (:class:`tether.sft.train.SFTTrainer`, the one SFT implementation): the policy
learns to write ``answer + [EOS]`` after a prompt, the loss the token-mean cross-entropy over those answer and EOS
tokens only,

    L = − (1 / Σ m_t) Σ_t m_t · log π(x_t | x_<t),   m_t = 1 on answer and EOS tokens,

on right-padded micro-batches drawn by reshuffling the problems every epoch (the short last batch left out),
AdamW at a constant ``lr``, the gradient norm clipped at 1. ``generate_answers`` decodes with the KV cache and left
padding; ``gold_accuracy`` scores responses with the gold rule *and* requires that each ended with ``[EOS]`` (see
``tether.demo.task``).
"""

from __future__ import annotations

import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from tether.demo.task import gold_reward
from tether.core.stats import wilson_interval


def sft_config(output_dir: Path, steps: int, batch_size: int, lr: float, seed: int, weight_decay: float,
               progress: bool) -> dict:
    """The demo's SFT as an :class:`~tether.sft.config.SFTConfig`: plain text, every problem trained (the demo
    holds its own dev and held-out problems out), ``steps`` optimiser steps over reshuffled epochs with the short
    last batch left out, constant ``lr``, no checkpoints."""
    return {"output_dir": str(output_dir), "seed": seed, "progress": progress, "save_every_minutes": 0,
            "data": {"eval_fraction": 0.0, "chat_template": "off"},
            "optim": {"lr": lr, "max_steps": steps, "batch_size": batch_size, "drop_last": True,
                      "weight_decay": weight_decay, "schedule": "constant", "max_grad_norm": 1.0}}


def sft_train(
    model,
    tokenizer,
    problems: list[dict[str, str]],
    steps: int,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    weight_decay: float = 0.01,
    callback: Callable[[int, float], bool | None] | None = None,
    output_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``problems`` (``{"prompt", "answer"}``) for ``steps`` AdamW steps with
    :class:`~tether.sft.train.SFTTrainer` (see the module docstring); with fewer problems than ``batch_size`` every
    batch is the whole set. ``callback(step, loss)``, if given, runs after every step (1-based), e.g. to evaluate
    along the way; a true return value stops training there. ``output_dir``: where the trainer writes the policy
    (a temporary folder when None). The caller's RNG states (torch, Python) are left as they were. Returns
    ``steps`` (the steps taken), ``seconds`` (training only, callback time excluded), ``steps_per_second``,
    ``final_loss`` (mean of the last ≤ 20 steps) and ``losses`` (one per step).
    """
    from tether.sft.train import SFTTrainer

    if steps < 0 or batch_size < 1 or not problems:
        raise ValueError(f"sft_train: need steps >= 0, batch_size >= 1 and problems, got {steps}, {batch_size}, "
                         f"{len(problems)} problems")
    if steps == 0:
        return {"steps": 0, "seconds": 0.0, "steps_per_second": float("nan"), "final_loss": float("nan"), "losses": []}
    rows = [{"prompt": p["prompt"], "completion": p["answer"]} for p in problems]
    was_training, python_rng = model.training, random.getstate()
    losses, seconds = [], 0.0
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as scratch:
        config = sft_config(Path(output_dir or Path(scratch) / "sft"), steps, min(batch_size, len(rows)), lr, seed,
                            weight_decay, progress)
        trainer = SFTTrainer(config, train_data=rows, model=model, tokenizer=tokenizer)
        for _ in range(steps):
            record = trainer.step()
            losses.append(record.metrics["sft/loss"])
            seconds += record.metrics["perf/seconds_step"]
            if callback is not None and callback(record.step, losses[-1]):
                break
        trainer.finish()
    random.setstate(python_rng)
    model.train(was_training)
    tail = losses[-20:]
    return {
        "steps": len(losses),
        "seconds": seconds,
        "steps_per_second": len(losses) / seconds if seconds > 0 else float("nan"),
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "losses": losses,
    }


def sft_to_accuracy(
    model,
    tokenizer,
    problems: list[dict[str, str]],
    dev: list[dict[str, str]],
    target: float,
    max_steps: int,
    check_every: int = 50,
    pass_k: int = 0,
    fine_every: int = 0,
    **sft_kwargs: Any,
) -> dict[str, Any]:
    """SFT until the dev metric reaches ``target``, checked every ``check_every`` steps: greedy gold
    accuracy on ``dev``, or with ``pass_k`` > 0 the share of dev problems solved by at least one of
    ``pass_k`` samples at temperature 1 (``pass_at_k``, seeded).

    SFT learns addition in sudden jumps whose timing varies with the seed (and wall time with the
    machine), so a fixed step count can leave the policy anywhere from 10% to 85%; stopping at a target
    gives PPO a comparable start. pass@k is the better target for RL: RL can only make likelier what the
    policy already samples, and a greedy target can stop between two jumps, e.g. with a units digit not yet
    learned and written as a near-constant, which no amount of sampling then finds. With ``fine_every`` > 0
    the checks come every ``fine_every`` steps once the metric has reached half the target: a jump can
    carry pass@8 from 56% to 93% in 75 steps (2-digit task, seed 3), and stopped anywhere on that climb
    the policy starts PPO at 65% or at 79% greedy, with a ceiling near 88% either way. ``dev`` must be
    problems the policy is not trained on and not the
    held-out set that later judges PPO (e.g. a slice cut off the train list). Returns ``sft_train``'s
    stats (``seconds`` excludes the dev checks) plus ``reached`` (bool) and ``dev_curve``:
    ``[(step, accuracy), …]``.
    """
    curve: list[tuple[int, float]] = []

    def check(step: int, _loss: float) -> bool:
        close = fine_every > 0 and bool(curve) and curve[-1][1] >= target / 2
        if step % (fine_every if close else check_every) and step != max_steps:
            return False
        if pass_k:
            acc = pass_at_k(model, tokenizer, dev, pass_k, seed=step)
        else:
            acc = gold_accuracy(model, tokenizer, dev)["accuracy"]
        curve.append((step, acc))
        return acc >= target

    stats = sft_train(model, tokenizer, problems, max_steps, callback=check, **sft_kwargs)
    return {**stats, "reached": bool(curve) and curve[-1][1] >= target, "dev_curve": curve}


@contextmanager
def _eval_mode(model) -> Iterator[None]:
    """Eval mode for the duration, then the caller's mode back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def generate_answers(
    model,
    tokenizer,
    prompts: list[str],
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    seed: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One response per prompt: ``{"response": str, "ended_with_eos": bool}``.

    ``model.generate`` with the KV cache on left-padded batches; a batch stops as soon as every row has
    written ``[EOS]`` or ``max_new_tokens`` is reached. Sampling is plain temperature sampling (no top-k /
    top-p); ``seed`` makes it repeatable without touching the global RNG. The response is the text before
    the first ``[EOS]``, decoded without special tokens.
    """
    if not greedy and temperature <= 0:
        raise ValueError(f"generate_answers: temperature must be > 0 when sampling, got {temperature}")
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    # top_k=0 / top_p=1 switch off generate's default top-k of 50: plain temperature sampling
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    if greedy:
        sampling = {"do_sample": False}
    out: list[dict[str, Any]] = []
    cuda = [device.index or 0] if device.type == "cuda" else []  # fork that device's RNG too
    with _eval_mode(model), torch.random.fork_rng(devices=cuda), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        starts = range(0, len(prompts), batch_size)
        for s in tqdm(starts, desc="generate", disable=not progress, leave=False):
            enc = tokenizer(
                prompts[s : s + batch_size],
                add_special_tokens=False,
                padding=True,
                padding_side="left",  # new tokens must follow the prompt directly in every row
                return_tensors="pt",
            ).to(device)
            seqs = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
                use_cache=True,
                **sampling,
            )
            new = seqs[:, enc["input_ids"].shape[1] :].cpu()  # (B, ≤ max_new_tokens)
            for row in new.tolist():
                ended = eos in row
                tokens = row[: row.index(eos)] if ended else row
                out.append({"response": tokenizer.decode(tokens, skip_special_tokens=True), "ended_with_eos": ended})
    return out


def gold_accuracy(
    model,
    tokenizer,
    problems: list[dict[str, str]],
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    seed: int | None = None,
    z: float = 1.96,
) -> dict[str, Any]:
    """Exact-match accuracy under the gold rule, requiring ``[EOS]``, with its Wilson interval.

    Returns ``accuracy``, ``n``, ``correct`` (0/1 per problem), ``low``/``high`` (Wilson, ``z``),
    ``eos_rate`` and ``responses`` (the texts, for sample tables).
    """
    gens = generate_answers(
        model, tokenizer, [p["prompt"] for p in problems], greedy=greedy, temperature=temperature,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
    )
    responses = [g["response"] for g in gens]
    scores = gold_reward([p["prompt"] for p in problems], responses, answer=[p["answer"] for p in problems])
    correct = [int(s == 1.0 and g["ended_with_eos"]) for s, g in zip(scores, gens)]
    n, k = len(correct), sum(correct)
    low, high = wilson_interval(k, n, z)
    return {
        "accuracy": k / n if n else float("nan"),
        "n": n,
        "correct": correct,
        "low": low,
        "high": high,
        "eos_rate": sum(g["ended_with_eos"] for g in gens) / n if n else float("nan"),
        "responses": responses,
    }


def pass_at_k(model, tokenizer, problems: list[dict[str, str]], k: int, seed: int, temperature: float = 1.0) -> float:
    """Share of ``problems`` with at least one correct answer (gold rule, ended with ``[EOS]``) among ``k``
    samples at ``temperature`` (seeded, global RNG untouched)."""
    prompts = [p["prompt"] for p in problems for _ in range(k)]
    gens = generate_answers(model, tokenizer, prompts, greedy=False, temperature=temperature,
                            batch_size=max(256, k * 32), seed=seed)
    answers = [p["answer"] for p in problems for _ in range(k)]
    ok = [g["response"] == a and g["ended_with_eos"] for g, a in zip(gens, answers)]
    return sum(any(ok[i * k:(i + 1) * k]) for i in range(len(problems))) / len(problems) if problems else float("nan")
