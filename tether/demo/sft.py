"""Supervised fine-tuning of the demo policy, batched answer generation and gold accuracy.

SFT teaches the policy to write ``answer + [EOS]`` after a prompt; the loss is the token-mean cross-entropy
over those answer and EOS tokens only (prompt and padding positions carry the label -100):

    L = − (1 / Σ m_t) Σ_t m_t · log π(x_t | x_<t),   m_t = 1 on answer and EOS tokens.

``generate_answers`` decodes with the KV cache and left padding; ``gold_accuracy`` scores responses with
the gold rule *and* requires that each ended with ``[EOS]`` (see ``tether.demo.task``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tether.demo.task import gold_reward
from tether.core.stats import wilson_interval

IGNORE_INDEX = -100  # label of positions that do not enter the loss (PyTorch's cross_entropy default)


def sft_tensors(tokenizer, problems: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + answer + [EOS]`` rows for SFT.

    Returns ``input_ids`` (N, T), ``attention_mask`` (N, T) and ``labels`` (N, T): labels equal the
    input ids on answer and EOS positions and -100 on prompt and padding positions (labels are aligned
    with the inputs; ``answer_loss`` shifts them). Right padding keeps every prompt at positions 0..,
    as in generation, where the demo's fixed-width prompts need no padding.
    """
    # The Rust tokenizer directly (the transformers wrapper costs ~4x more on 50k short strings), with its
    # padding switched off for the call: a padded call through the wrapper (generation) leaves padding on in
    # the backend, and 3-digit answers then came back as [PAD] + digits, a [PAD] the model was trained to write.
    backend = tokenizer.backend_tokenizer
    padding = backend.padding
    backend.no_padding()
    try:
        prompts = [e.ids for e in backend.encode_batch([p["prompt"] for p in problems], add_special_tokens=False)]
        answers = [e.ids for e in backend.encode_batch([p["answer"] for p in problems], add_special_tokens=False)]
    finally:
        if padding is not None:
            backend.enable_padding(**{k: v for k, v in padding.items() if k != "pad_type_id"},
                                   pad_type_id=padding["pad_type_id"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
    ids, mask, labels = [], [], []
    for p, a in zip(prompts, answers):  # plain lists and one tensor call each: far faster than row writes
        n_pad = width - len(p) - len(a) - 1
        ids.append(p + a + [eos] + [pad] * n_pad)
        mask.append([1] * (width - n_pad) + [0] * n_pad)
        labels.append([IGNORE_INDEX] * len(p) + a + [eos] + [IGNORE_INDEX] * n_pad)
    input_ids = torch.tensor(ids, dtype=torch.long)  # (N, T)
    attention_mask = torch.tensor(mask, dtype=torch.long)  # (N, T)
    labels = torch.tensor(labels, dtype=torch.long)  # (N, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions; logits (B, T, V) predict labels (B, T) one later."""
    pred = logits[:, :-1].reshape(-1, logits.shape[-1])  # (B·(T−1), V): position t predicts token t+1
    target = labels[:, 1:].reshape(-1)  # (B·(T−1),)
    return F.cross_entropy(pred.float(), target, ignore_index=IGNORE_INDEX)


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
) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``problems`` for ``steps`` AdamW steps (constant ``lr``, grad-norm clip 1).

    Batches are drawn by reshuffling the problems every epoch (seeded, without touching the global RNG);
    with fewer problems than ``batch_size`` every batch is the whole set. ``callback(step, loss)``, if
    given, runs after every step (1-based), e.g. to evaluate along the way; a true return value stops
    training there. Returns ``steps`` (the steps taken),
    ``seconds`` (training only, callback time excluded), ``steps_per_second``, ``final_loss`` (mean of
    the last ≤ 20 steps) and ``losses`` (one per step).
    """
    if steps < 0 or batch_size < 1 or not problems:
        raise ValueError(f"sft_train: need steps >= 0, batch_size >= 1 and problems, got {steps}, {batch_size}, "
                         f"{len(problems)} problems")
    data = sft_tensors(tokenizer, problems)
    n = data["input_ids"].shape[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    was_training = model.training
    model.train()
    order = torch.randperm(n, generator=gen)
    cursor, losses, in_callback = 0, [], 0.0
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="sft", disable=not progress, leave=False)
    for step in bar:
        if cursor + batch_size > n:  # new epoch; the tail of the old order is dropped
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        mask = data["attention_mask"][idx]  # (B, T)
        width = int(mask.sum(1).max())  # trim columns that are padding in every row
        batch = {k: v[idx, :width].to(device) for k, v in data.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
        loss = answer_loss(logits, batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if callback is not None:
            t0 = time.perf_counter()
            stop = callback(step + 1, losses[-1])
            in_callback += time.perf_counter() - t0
            if stop:
                break
    bar.close()
    seconds = time.perf_counter() - start - in_callback
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
