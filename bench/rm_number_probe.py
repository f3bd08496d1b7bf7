#!/usr/bin/env python
"""What did a chain-sum reward model learn: the arithmetic, or a number prior? (docs/real-models.md, recipe 5)

For held-out problems "a + b =" / "a - b =" (a run's greedy evaluation, ``RUN_DIR/samples/step_0.jsonl``: the
prompts and the base model's own replies), the reward model scores "The answer is N." for every N in a range.
Printed: how often its favourite N is the right one, the right N's median rank, and how often it scores the right
answer above the base model's reply where that reply was wrong. A reward model that knows the arithmetic puts the
right N first; one that learned the replies' surface has a favourite (or a disfavoured) number whatever the problem.

    python bench/rm_number_probe.py RM_DIR RUN_DIR [--n 40] [--low -9] [--high 18]
    python bench/rm_number_probe.py RM_DIR --task rg:chain_sum:... [--split train]

With ``--task``, the problems are the task's rows as ``tether ppo`` splits them (``--split train``: the prompts PPO
trains on, the ones a reward model from the policy's own samples must score right; ``eval``: the held-out ones).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

PROBLEM = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*$")


def gold_of(prompt: str) -> int | None:
    """a ± b of a prompt that ends with "a + b =" or "a - b ="; None for any other prompt (never evaluated as code)."""
    match = PROBLEM.search(prompt)
    if match is None:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    return a + b if op == "+" else a - b


def main() -> None:
    import torch

    from tether.rm.model import RewardModel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rm_dir")
    ap.add_argument("run_dir", nargs="?", help="a run whose samples/step_0.jsonl gives the problems and base replies")
    ap.add_argument("--task", help="instead of RUN_DIR: the task's rows (rg:...), split as tether ppo splits them")
    ap.add_argument("--split", choices=["train", "eval"], default="eval")
    ap.add_argument("--task-train", type=int, default=2000)
    ap.add_argument("--task-eval", type=int, default=200)
    ap.add_argument("--n", type=int, default=40, help="problems probed")
    ap.add_argument("--low", type=int, default=-9)
    ap.add_argument("--high", type=int, default=18)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rm = RewardModel.from_pretrained(args.rm_dir)
    if args.task:
        from tether.tasks import split_rows

        train, held_out = split_rows(args.task, args.task_train, args.task_eval)
        rows = [{"prompt": r["prompt"], "correct": True} for r in (train if args.split == "train" else held_out)]
    elif args.run_dir:
        rows = [json.loads(line) for line in (Path(args.run_dir) / "samples" / "step_0.jsonl").open()]
    else:
        ap.error("give RUN_DIR or --task")
    rows = [r for r in rows if gold_of(r["prompt"]) is not None][:args.n]
    numbers = list(range(args.low, args.high + 1))
    favourite_right, ranks, right_over_wrong, wrong = 0, [], 0, 0
    favourites: dict[int, int] = {}
    for r in rows:
        gold = gold_of(r["prompt"])
        scores = rm.score([r["prompt"]] * len(numbers), [f"The answer is {n}." for n in numbers]).tolist()
        order = sorted(numbers, key=lambda n: -scores[numbers.index(n)])
        favourites[order[0]] = favourites.get(order[0], 0) + 1
        favourite_right += order[0] == gold
        ranks.append(order.index(gold) + 1 if gold in numbers else len(numbers))
        if not r.get("correct", False) and gold in numbers:
            wrong += 1
            right_over_wrong += scores[numbers.index(gold)] > float(rm.score([r["prompt"]], [r["response"]])[0])
    common = sorted(favourites.items(), key=lambda kv: -kv[1])[:3]
    which = f"{args.split} rows of {args.task}" if args.task else "held-out problems"
    print(f"{len(rows)} {which}; N in {args.low}..{args.high} ({len(numbers)} candidates)")
    print(f"  its favourite N is the right one:      {favourite_right} of {len(rows)}")
    print(f"  the right N's median rank:             {statistics.median(ranks):g} of {len(numbers)}")
    print(f"  its favourites:                        " + ", ".join(f"{n} ({c}×)" for n, c in common))
    if not args.task:
        print(f"  right answer over the base's wrong reply: {right_over_wrong} of {wrong}")


if __name__ == "__main__":
    main()
