"""SFT's evaluation (S3): held-out loss and perplexity, and gold accuracy of greedy answers on held-out prompts with
the rules PPO's evaluation uses (``--gold``: :func:`tether.rules.calls.gold_rule`, called by
:func:`tether.rules.calls.call_rule` with ``ended_with_eos``), prompted exactly as ``tether ppo`` prompts the policy
(chat template, ``--system-prompt``, ``--prompt-template``: :func:`tether.rollout.sampling.encode_prompts`), so
that a gain from SFT and one from RL are measured on one scale.

Metrics: ``eval/loss`` = −(1/N) Σ log π(x_t | x_<t) over the N labelled tokens of the held-out rows,
``eval/perplexity`` = exp(``eval/loss``), ``eval/tokens`` = N; ``eval/accuracy`` (the rule's mean verdict, > 0.5
counted right), ``eval/correct`` (per-prompt 0/1 in prompt order, for paired comparisons), ``eval/prompts``,
``eval/eos_fraction`` (answers that ended with EOS), ``eval/response_length`` (tokens).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from tether.core.losses import token_nll
from tether.rollout.sampling import encode_prompts
from tether.sft.batches import make_batch


@dataclass(frozen=True)
class Prompting:
    """How prompts are encoded for generation: as ``tether ppo`` encodes them."""

    use_chat_template: bool
    system_prompt: str = ""
    prompt_template: str = "{prompt}"
    max_prompt_length: int = 512


def generate_responses(engine, tokenizer, prompts: list, prompting: Prompting, max_new_tokens: int, device,
                       temperature: float = 1.0, greedy: bool = False, precision=None):
    """Encode ``prompts``, sample (or greedy-decode) with ``engine`` (a :mod:`tether.rollout.engines` engine) in
    ``precision``, decode the response tokens up to EOS. Returns ``(Rollout, texts)``."""
    query, mask = encode_prompts(tokenizer, prompts, prompting.max_prompt_length, prompting.use_chat_template,
                                 prompting.system_prompt, prompting.prompt_template)
    with precision.autocast() if precision is not None else contextlib.nullcontext():
        rollout = engine.generate(query.to(device), mask.to(device), max_new_tokens, temperature, greedy=greedy)
    texts = tokenizer.batch_decode([row[m.bool()] for row, m in zip(rollout.response, rollout.response_mask)],
                                   skip_special_tokens=True)
    return rollout, texts


@torch.no_grad()
def held_out_loss(run, batch_size: int) -> dict:
    """``eval/loss``, ``eval/perplexity`` and ``eval/tokens`` over the held-out sequences (in batches of similar
    length; packed as training packs)."""
    if not run.held_out:
        return {}
    model, device = run.unwrapped, run.processes.device
    was_training = model.training
    model.eval()
    order = sorted(range(len(run.held_out)), key=lambda i: (len(run.held_out[i].ids), i))
    nll_sum, tokens = 0.0, 0
    try:
        for start in range(0, len(order), batch_size):
            batch = make_batch([run.held_out[i] for i in order[start:start + batch_size]], run.tokenizer,
                               run.packing)
            with run.precision.autocast():
                logits = model(**batch.model_inputs(device)).logits  # (N, L, V)
            loss, n = token_nll(logits, batch.labels.to(device))
            nll_sum, tokens = nll_sum + loss.item() * n, tokens + n
    finally:
        model.train(was_training)
    mean = nll_sum / tokens
    return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 700.0)), "eval/tokens": tokens}


@torch.no_grad()
def gold_accuracy(run, cfg) -> tuple[dict, list[dict]]:
    """Greedy answers to the first ``eval.n`` gold prompts, judged by the gold rule; ``(metrics, samples)``."""
    from tether.inputs.prompt_rows import collate_fields
    from tether.rollout.engines import TransformersEngine
    from tether.rules.calls import call_rule, completion_ids, with_completion_ids

    rows = run.eval_rows[:cfg.eval.n]
    if run.gold is None or not rows:
        return {}, []
    f = run.fmt
    prompting = Prompting(f.use_chat_template, f.system_prompt, f.prompt_template, cfg.eval.max_prompt_length)
    engine = TransformersEngine(run.unwrapped, run.tokenizer, run.fsdp)  # the trained module itself, gathered once
    samples, correct_all, lengths, ended_all = [], [], [], []
    for start in range(0, len(rows), cfg.eval.batch_size):
        chunk = rows[start:start + cfg.eval.batch_size]
        prompts = [r["prompt"] for r in chunk]
        rollout, responses = generate_responses(engine, run.tokenizer, prompts, prompting, run.eval_max_new_tokens,
                                                run.processes.device, greedy=True, precision=run.precision)
        fields = with_completion_ids(collate_fields(chunk), completion_ids(rollout))
        verdicts = call_rule(run.gold, prompts, responses, fields, rollout.ended_with_eos)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            right, ended, length = bool(verdicts[i] > 0.5), bool(rollout.ended_with_eos[i]), int(rollout.lengths[i])
            samples.append({"prompt": prompt, "response": response, "correct": right, "length": length,
                            "truncated": not ended})
            correct_all.append(right)
            ended_all.append(ended)
            lengths.append(length)
    n = len(correct_all)
    return {"eval/accuracy": sum(correct_all) / n, "eval/correct": "".join("1" if c else "0" for c in correct_all),
            "eval/prompts": n, "eval/eos_fraction": sum(ended_all) / n,
            "eval/response_length": sum(lengths) / n}, samples
