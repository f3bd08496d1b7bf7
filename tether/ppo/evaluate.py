"""Evaluation on held-out prompts (B13): mean reward, the gold metric where a rule exists, the KL of
each response to the reference, and sample responses for ``samples/step_K.jsonl``."""

from __future__ import annotations

import math

import torch

from tether.core.kl import kl_penalty
from tether.errors import TetherError
from tether.ppo.forward import forward_response
from tether.ppo.prompts import collate_fields
from tether.ppo.rule_calls import NOT_APPLICABLE, call_rule
from tether.ppo.sources import score_responses
from tether.ppo.step import rollout_batch
from tether.sharding import gathered


@torch.no_grad()
def evaluate(run, cfg, step: int) -> tuple[dict, list[dict]]:
    """Mean reward and gold accuracy on held-out prompts (B13), with per-response samples.
    ``run``: :class:`~tether.ppo.setup.Run`; evaluation runs where it is called (the main process)."""
    m, d = run.models, run.data
    rows = (d.eval_rows or [])[: cfg.eval.n]
    if not rows:
        return {}, []
    model = m.unwrapped_policy
    # Evaluation follows a step's update: an engine with its own weights must take them first (C3).
    m.engine.sync_weights(model)
    with gathered(model, m.fsdp):  # a sharded policy gathered once for all the chunks
        return _evaluate_rows(run, cfg, rows, model)


def _evaluate_rows(run, cfg, rows: list[dict], model) -> tuple[dict, list[dict]]:
    m, d = run.models, run.data
    samples, scores_all, correct_all = [], [], []
    for start in range(0, len(rows), cfg.rows_per_step):  # a rollout's rows at a time (K samples of each prompt)
        chunk = rows[start:start + cfg.rows_per_step]
        prompts, fields = [r["prompt"] for r in chunk], collate_fields(chunk)
        rollout, responses = rollout_batch(m, cfg, chunk, greedy=cfg.eval.greedy)
        with m.precision.autocast():  # C5: as the step scores them
            logprobs, _, _ = forward_response(model, rollout, cfg.generation.temperature)
            with m.policy.reference_model(model) as reference:
                logprobs_ref, _, _ = forward_response(reference, rollout, cfg.generation.temperature)
        kl = kl_penalty(logprobs, logprobs_ref, cfg.kl.estimator, k3_clip=cfg.kl.k3_clip)
        kl = (kl * rollout.response_mask).sum(dim=1)
        # Rules get the EOS flags: the math rules never credit a reply cut by max_new_tokens.
        scores = score_responses(d.sources, prompts, responses, fields, rollout.ended_with_eos)
        correct, gold_failed = judge_gold(cfg, d.gold, prompts, responses, fields, rollout.ended_with_eos)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            sample = {"prompt": prompt, "response": response, "score": float(scores[i]), "kl": float(kl[i]),
                      "length": int(rollout.response_mask[i].sum()), "truncated": not bool(rollout.ended_with_eos[i])}
            if correct is not None:
                sample["correct"] = bool(correct[i] > 0.5)  # NaN (the gold rule failed on the row): not correct
            if i in gold_failed:
                sample["gold_failed"] = gold_failed[i]
            samples.append(sample)
        scores_all.append(scores)
        if correct is not None:
            correct_all.append(correct)
    scores = torch.cat(scores_all)
    scores = scores[torch.isfinite(scores)]  # rows a rule failed on or a NaN score are left out (B16)
    metrics = {"eval/reward": float(scores.mean()) if len(scores) else float("nan"), "eval/n": len(samples),
               "eval/kl_sequence": sum(s["kl"] for s in samples) / len(samples),
               "eval/distinct_responses": distinct_fraction([s["response"] for s in samples])}
    if correct_all:
        gold = torch.cat(correct_all)
        correct = (gold > 0.5).tolist()  # a row the gold rule failed on (NaN) counts as not correct
        metrics["eval/accuracy"] = sum(correct) / len(correct)
        metrics["eval/gold_failed"] = int((~torch.isfinite(gold)).sum())
        # Per-problem results in prompt order, the same prompts at every evaluation: the gold band pairs
        # evaluations problem by problem (an exact McNemar test), which an accuracy alone cannot (D1).
        metrics["eval/correct"] = "".join("1" if c else "0" for c in correct)
    return metrics, samples


def judge_gold(cfg, gold, prompts, responses, fields, ended_with_eos) -> tuple[torch.Tensor | None, dict[int, str]]:
    """The gold rule's (B,) verdicts, NaN on the rows it failed on, and ``{row: why}`` for those (B16, #38): it
    raised on the row, returned a non-number, None or a non-finite value. A result of the wrong length, or a failure
    on every row, is a one-line error naming ``--gold``. No gold rule: (None, {})."""
    if gold is None:
        return None, {}
    errors, not_applicable = {}, set()
    try:
        verdicts = call_rule(gold, prompts, responses, fields, ended_with_eos, errors, not_applicable)
    except TetherError as e:
        raise TetherError(f"--gold {cfg.reward.gold}: {e}") from None
    failed = {i: errors.get(i, NOT_APPLICABLE if i in not_applicable else f"returned {v}")
              for i, v in enumerate(verdicts.tolist()) if not math.isfinite(v)}
    return torch.where(torch.isfinite(verdicts), verdicts, math.nan), failed  # +Inf is no verdict either


def distinct_fraction(responses: list[str]) -> float:
    """Distinct responses ÷ responses, ignoring surrounding whitespace: near 1 when different prompts get different
    answers; 1/n when the policy gives every prompt the same one (a constant guess that a reward or gold rule
    can still partly credit — the doctor's ``eval_distinct`` band)."""
    return len({r.strip() for r in responses}) / len(responses) if responses else float("nan")
