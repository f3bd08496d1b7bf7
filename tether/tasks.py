"""Tasks with a verifier from a published package: reasoning-gym's procedural generators (offline arithmetic, string
and logic tasks with difficulty knobs) as prompt rows, and their own ``score_answer`` as a reward / gold rule.

A task is named ``rg:DATASET[:key=value,...]`` (``rg:chain_sum:min_terms=2,max_terms=2,max_digits=1``); the values are
read as JSON where they parse (numbers, lists, booleans) and as strings otherwise. Rows are
``{"prompt": question, "answer": gold, "rg_task": the task name, "rg_metadata": JSON}``: every column reaches rules
as a keyword list, so :func:`reasoning_gym_score` rebuilds the entry and asks the dataset's own ``score_answer``
(written by reasoning-gym's authors, not here) about the reply's final answer. What is ours is reading that final
answer out of a free-text reply (:func:`final_answer`) and refusing credit to a reply cut by max_new_tokens.

Install: ``pip install reasoning-gym`` (the ``tasks`` extra); without it a task name is a one-line error.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from tether.errors import ConfigError

INSTALL = "pip install -e '.[tasks]' (reasoning-gym)"


def parse_task(name: str) -> tuple[str, dict]:
    """``rg:DATASET[:k=v,...]`` → (dataset, config); a one-line error for anything else."""
    parts = name.split(":", 2)
    if len(parts) < 2 or parts[0] != "rg" or not parts[1]:
        raise ConfigError(f"task {name!r}: expected rg:DATASET[:key=value,...] (a reasoning-gym dataset)")
    config = {}
    for item in (parts[2].split(",") if len(parts) == 3 and parts[2] else []):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"task {name!r}: {item!r} is not key=value")
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value
    return parts[1], config


@lru_cache(maxsize=32)
def _dataset(name: str, size: int = 1, seed: int = 0):
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(f"task {name!r}: reasoning-gym is not installed ({e}); {INSTALL}") from None
    dataset, config = parse_task(name)
    try:
        return reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        raise ConfigError(f"task {name!r}: reasoning-gym refused it ({type(e).__name__}: {e})") from None


def task_rows(name: str, n: int, seed: int) -> list[dict]:
    """``n`` prompt rows of the task, generated with ``seed`` (the same seed gives the same rows)."""
    dataset = _dataset(name, n, seed)
    return [{"prompt": e["question"], "answer": str(e["answer"]), "rg_task": name,
             "rg_metadata": json.dumps(e.get("metadata", {}), default=str)} for e in dataset]


def split_rows(name: str, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct training and held-out rows: a pool of distinct prompts generated with ``seed``, ``n_eval`` of them
    held out (never trained on) and up to ``n_train`` of the rest for training (fewer when the task's problem space
    is small: chain sums of two one-digit numbers are 190 problems). A held-out share under half the pool is kept
    so that training has prompts left."""
    pool, seen = [], set()
    for row in task_rows(name, 2 * (n_train + n_eval) + 16, seed):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            pool.append(row)
    n_eval = min(n_eval, len(pool) // 2)
    return pool[n_eval:n_eval + n_train], pool[:n_eval]


ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S | re.I)
ANSWER_IS = re.compile(r"answer\b[^.\n]*?\bis\b[:\s]*(.+)", re.I)  # "answer is N", "answer to the sum is N"
ANSWER_COLON = re.compile(r"answer:\s*(.+)", re.I)


def final_answer(reply: str) -> str:
    """The final answer of a free-text reply: the last ``<answer>…</answer>``, else what follows the last
    "answer … is" (within one sentence) / "Answer:" on its line, else the last non-empty line; without a trailing full stop, surrounding
    quotes, ``**`` or ``$``."""
    for pattern in (ANSWER_TAG, ANSWER_IS, ANSWER_COLON):
        found = pattern.findall(reply)
        if found:
            answer = found[-1]
            break
    else:
        lines = [line for line in reply.strip().splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    previous = None
    while answer != previous:  # "**12**.", "'cat'." ...: peel decorations and a final full stop, in any order
        previous = answer
        answer = re.sub(r"[.。]+$", "", answer.strip().strip("*\"'`$").strip())
    return answer


def reasoning_gym_score(prompts, responses, answer, rg_task, rg_metadata, ended_with_eos=None, **columns
                        ) -> list[float]:
    """The reward: reasoning-gym's own ``score_answer`` of each reply's :func:`final_answer` against its row's entry
    (1.0 right; some datasets give partial credit in between); 0 for a reply cut by max_new_tokens."""
    eos = ended_with_eos if ended_with_eos is not None else [True] * len(responses)
    out = []
    for prompt, reply, gold, task, metadata, ended in zip(prompts, responses, answer, rg_task, rg_metadata, eos):
        if not ended:
            out.append(0.0)
            continue
        entry = {"question": prompt, "answer": gold, "metadata": json.loads(metadata) if metadata else {}}
        out.append(float(_dataset(task).score_answer(final_answer(reply), entry)))
    return out


def reasoning_gym_correct(prompts, responses, **columns) -> list[float]:
    """The gold rule: 1 when reasoning-gym scores the final answer fully right (1.0), else 0 (partial credit is not
    correct)."""
    return [1.0 if s >= 1.0 else 0.0 for s in reasoning_gym_score(prompts, responses, **columns)]
