#!/usr/bin/env python
"""Is a task in a model's reach? The base policy's held-out pass rate greedy, sampled at each temperature, pass@K and
the share of flat groups (all K samples scored alike: no signal for a group baseline), per task and difficulty.

Before any RL run (#38 item 2): a group baseline learns only where some samples of a prompt succeed and some fail,
so pick the task and temperature where the sampled pass rate is in the middle (15–60%) — a flat group has
probability pᴷ + (1 − p)ᴷ. The prompts are the held-out rows ``tether ppo --prompts rg:…`` evaluates on
(:func:`tether.tasks.split_rows`, default sizes), asked as ``tether ppo`` asks them (chat template, system prompt),
scored by the task's own check (:func:`tether.tasks.reasoning_gym_correct`: exact, a cut reply is wrong).

Needs vLLM (the vLLM environment, docs/sampling.md) and the tasks extra.

Usage: python bench/calibrate_task.py --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=1 [--task ...]
       [--model smollm2-135m-instruct] [--system-prompt S] [--n 64] [-k 8] [--temperatures 0.7,1.0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

SYSTEM = "Answer briefly. End your reply with 'The answer is X.'"  # recipe 4's


def judge(rows, outputs) -> list[list[float]]:
    """Per prompt, the 0/1 verdicts of its samples (a sample cut by max_tokens is wrong)."""
    from tether.tasks import reasoning_gym_correct

    verdicts = []
    for row, out in zip(rows, outputs):
        texts = [c.text for c in out.outputs]
        ended = [c.finish_reason == "stop" for c in out.outputs]
        n = len(texts)
        verdicts.append(reasoning_gym_correct([row["prompt"]] * n, texts, ended_with_eos=ended,
                                              **{k: [row[k]] * n for k in ("answer", "rg_task", "rg_metadata")}))
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", action="append", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--system-prompt", default=SYSTEM)
    parser.add_argument("--n", type=int, default=64, help="held-out prompts per task")
    parser.add_argument("-k", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from tether.presets import resolve_model_path
    from tether.tasks import split_rows

    path = str(resolve_model_path(args.model, what="policy"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0,
              generation_config="vllm", kv_cache_memory_bytes=2 * 2**30)
    print(f"{args.model}, system prompt {args.system_prompt!r}, {args.max_tokens} tokens, K = {args.k}")
    print("| task | n | greedy | " + " | ".join(f"T = {t}: sampled, pass@{args.k}, flat groups"
                                                for t in args.temperatures.split(",")) + " |")
    for task in args.task:
        started = time.perf_counter()
        rows = split_rows(task, 2000, 200)[1][:args.n]  # the held-out rows tether ppo evaluates on
        prompts = [tokenizer.apply_chat_template(
            ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
            + [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True) for r in rows]
        greedy = judge(rows, llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                                          use_tqdm=False))
        cells = [f"{sum(v[0] for v in greedy) / len(rows):.0%}"]
        for t in args.temperatures.split(","):
            params = SamplingParams(temperature=float(t), top_p=1.0, top_k=0, max_tokens=args.max_tokens, n=args.k)
            verdicts = judge(rows, llm.generate(prompts, params, use_tqdm=False))
            sampled = sum(map(sum, verdicts)) / (len(rows) * args.k)
            pass_k = sum(max(v) > 0 for v in verdicts) / len(rows)
            flat = sum(min(v) == max(v) for v in verdicts) / len(rows)
            cells.append(f"{sampled:.0%}, {pass_k:.0%}, {flat:.0%}")
        print(f"| {task} | {len(rows)} | " + " | ".join(cells) + f" |  ({time.perf_counter() - started:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
