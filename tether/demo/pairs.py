"""Preference pairs for the demo's reward model: real samples of the SFT policy, labelled by the gold rule.

For each prompt the policy is sampled ``samples_per_prompt`` times at a temperature. A sample is correct
when its text equals the answer *and* it ended with ``[EOS]`` (``tether.demo.task``); everything else —
a wrong number, extra text, a response cut off by ``max_new_tokens`` — is wrong. Every distinct correct
text is paired, as ``chosen``, with every distinct wrong text of the same prompt, as ``rejected``.
Duplicates are dropped so that a common mistake does not appear many times (which would also leak
between the RM's train and held-out splits). A wrong sample whose text equals a correct one (possible
only when it lacked EOS) cannot be told apart as text and is skipped. An empty (or blank) reply — the
policy ending at once — is wrong but is not paired either: a preference file with an empty side is
refused by ``tether train-rm``'s reader, and ``pairs.jsonl`` must be readable by it as written.
Prompts whose samples were all correct or all wrong give no pair.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tether.demo.sft import generate_answers
from tether.demo.task import gold_reward


def make_preference_pairs(
    model,
    tokenizer,
    problems: list[dict[str, str]],
    samples_per_prompt: int,
    temperature: float,
    seed: int,
    max_new_tokens: int = 8,
    batch_size: int = 512,
    max_pairs_per_prompt: int | None = None,
    progress: bool = True,
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Sample, label with the gold rule, pair correct ≻ wrong per prompt; returns ``(pairs, stats)``.

    ``pairs``: ``{"prompt", "chosen", "rejected"}`` rows (response texts without special tokens), in
    problem order, at most ``max_pairs_per_prompt`` per prompt (earliest samples first). ``stats``:
    ``n_prompts``, ``n_samples``, ``sample_accuracy`` (correct share of all samples), ``eos_rate``,
    ``prompts_with_both`` (prompts with a correct and a differently written wrong sample: those that gave
    pairs), ``prompts_all_correct``, ``prompts_all_wrong``, ``skipped_same_text``, ``skipped_empty`` (distinct
    empty or blank wrong replies left out, counted per prompt), ``n_pairs``, ``seconds``.
    """
    if samples_per_prompt < 2:
        raise ValueError(f"samples_per_prompt must be >= 2 to pair samples, got {samples_per_prompt}")
    start = time.perf_counter()
    k = samples_per_prompt
    prompts = [p["prompt"] for p in problems for _ in range(k)]  # each prompt's k samples are contiguous
    answers = [p["answer"] for p in problems for _ in range(k)]
    gens = generate_answers(
        model, tokenizer, prompts, greedy=False, temperature=temperature, max_new_tokens=max_new_tokens,
        batch_size=batch_size, seed=seed, progress=progress,
    )
    scores = gold_reward(prompts, [g["response"] for g in gens], answer=answers)
    correct_flags = [s == 1.0 and g["ended_with_eos"] for s, g in zip(scores, gens)]

    pairs: list[dict[str, str]] = []
    both = all_correct = all_wrong = skipped = empty = 0
    for i, prob in enumerate(problems):
        rows = range(i * k, (i + 1) * k)
        correct = list(dict.fromkeys(gens[j]["response"] for j in rows if correct_flags[j]))  # distinct, in order
        wrong_all = list(dict.fromkeys(gens[j]["response"] for j in rows if not correct_flags[j]))
        wrong = [w for w in wrong_all if w not in correct and w.strip()]
        blank = sum(1 for w in wrong_all if not w.strip())
        empty += blank
        skipped += len(wrong_all) - len(wrong) - blank
        if not any(correct_flags[j] for j in rows):
            all_wrong += 1
        elif all(correct_flags[j] for j in rows):
            all_correct += 1
        if not (correct and wrong):
            continue
        both += 1
        mine = [{"prompt": prob["prompt"], "chosen": c, "rejected": w} for c in correct for w in wrong]
        pairs.extend(mine[:max_pairs_per_prompt])
    n = len(gens)
    stats = {
        "n_prompts": len(problems),
        "n_samples": n,
        "sample_accuracy": sum(correct_flags) / n if n else float("nan"),
        "eos_rate": sum(g["ended_with_eos"] for g in gens) / n if n else float("nan"),
        "prompts_with_both": both,
        "prompts_all_correct": all_correct,
        "prompts_all_wrong": all_wrong,
        "skipped_same_text": skipped,
        "skipped_empty": empty,
        "n_pairs": len(pairs),
        "seconds": time.perf_counter() - start,
    }
    return pairs, stats


def write_pairs(path: Path, pairs: list[dict[str, str]]) -> None:
    """``pairs`` as JSONL rows ``{"prompt", "chosen", "rejected"}``: the file ``tether train-rm --pairs`` reads."""
    Path(path).write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
