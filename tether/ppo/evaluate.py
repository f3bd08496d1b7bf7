"""Evaluation on held-out prompts (B13): mean reward, the gold metric where a rule exists, the KL of
each response to the reference, and sample responses for ``samples/step_K.jsonl``."""

from __future__ import annotations

import math
import time

import torch

from tether.core.kl import kl_penalty
from tether.diagnostics.text import word_f1
from tether.errors import TetherError
from tether.ppo.forward import forward_response
from tether.ppo.prompts import collate_fields
from tether.rules.calls import NOT_APPLICABLE, call_rule, completion_ids, with_completion_ids
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
    started = time.perf_counter()
    with gathered(model, m.fsdp):  # a sharded policy gathered once for all the chunks
        metrics, samples = _evaluate_rows(run, cfg, rows, model)
    metrics.update(against_reference(d, step, metrics, samples))
    return {**metrics, "perf/seconds_eval": time.perf_counter() - started}, samples


def against_reference(d, step: int, metrics: dict, samples: list[dict]) -> dict:
    """The step-0 evaluation's answers are the reference policy's (nothing trained yet): kept in ``d``
    (:class:`~tether.ppo.setup.Data`). Later evaluations of the same prompts report ``eval/reference_overlap``, the
    mean word-bag F1 of each answer with the reference's answer to the same prompt, and ``eval/reward_gain``, the
    held-out reward's change since step 0 — together the doctor's view of a shortcut: the reward up while the
    answers stop resembling what the task drew from the policy (a check satisfied, the task dropped). Each sample
    gets its ``reference`` answer beside it. {} without a step-0 evaluation."""
    answers = [s["response"] for s in samples]
    if step == 0 and d.reference_answers is None:
        d.reference_answers = {"answers": answers, "reward": metrics.get("eval/reward")}
        return {}
    reference = d.reference_answers
    if reference is None or len(reference["answers"]) != len(answers):
        return {}
    for sample, ref in zip(samples, reference["answers"]):
        sample["reference"] = ref
    out = {"eval/reference_overlap": sum(map(word_f1, answers, reference["answers"])) / max(len(answers), 1)}
    if isinstance(reference.get("reward"), float) and isinstance(metrics.get("eval/reward"), float):
        out["eval/reward_gain"] = metrics["eval/reward"] - reference["reward"]
    return out


def _evaluate_rows(run, cfg, rows: list[dict], model) -> tuple[dict, list[dict]]:
    m, d = run.models, run.data
    # A local vLLM engine takes every held-out prompt at once (it schedules its own batches); the others a rollout's
    # rows at a time (K samples of each prompt), their memory being sized for that.
    size = len(rows) if m.engine.name == "vllm" else cfg.rows_per_step
    kl_rows = len(rows) if cfg.eval.kl_n == 0 else min(cfg.eval.kl_n, len(rows))
    samples, scores_all, correct_all, kls = [], [], [], []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        prompts, fields = [r["prompt"] for r in chunk], collate_fields(chunk)
        rollout, responses = rollout_batch(m, cfg, chunk, greedy=cfg.eval.greedy)
        fields = with_completion_ids(fields, completion_ids(rollout))  # for rules that ask (TRL's)
        kl = sequence_kl(run, cfg, model, rollout, max(0, min(kl_rows - start, len(chunk))))
        kls += kl
        # Rules get the EOS flags: the math rules never credit a reply cut by max_new_tokens.
        scores = score_responses(d.sources, prompts, responses, fields, rollout.ended_with_eos)
        correct, gold_failed = judge_gold(cfg, d.gold, prompts, responses, fields, rollout.ended_with_eos)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            sample = {"prompt": prompt, "response": response, "score": float(scores[i]),
                      "kl": kl[i] if i < len(kl) else None,
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
               # the spread over the prompts: the doctor judges a reward's rise against it (diagnostics.heldout)
               "eval/reward_std": float(scores.std()) if len(scores) > 1 else float("nan"),
               "eval/kl_sequence": sum(kls) / len(kls) if kls else float("nan"),
               "eval/response_length": sum(s["length"] for s in samples) / len(samples),
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


def sequence_kl(run, cfg, model, rollout, n: int) -> list[float]:
    """Σ_t KL_t of the first ``n`` rows of ``rollout`` to the reference (``kl.estimator``), a policy and a reference
    forward over them, a rollout's rows at a time, in the run's precision as the step scores them (C5)."""
    m, out = run.models, []
    for start in range(0, n, cfg.rows_per_step):
        part = rollout.select(torch.arange(start, min(start + cfg.rows_per_step, n), device=rollout.query.device))
        with m.precision.autocast():
            logprobs, _, _ = forward_response(model, part, cfg.generation.temperature, need_entropy=False,
                                              options=m.forward)
            with m.policy.reference_model(model) as reference:
                logprobs_ref, _, _ = forward_response(reference, part, cfg.generation.temperature,
                                                      need_entropy=False, options=m.forward)
        kl = kl_penalty(logprobs, logprobs_ref, cfg.kl.estimator, k3_clip=cfg.kl.k3_clip)
        out += (kl * part.response_mask).sum(dim=1).tolist()
    return out


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
