"""A small instruction task of our own for the task-and-check reward (#51; docs/real-models.md): short writing
prompts, each with one verifiable instruction, and the instruction's checker — the reward and the gold of the
measurement. Not a public benchmark's prompts.

    python bench/task_gate_task.py OUT_DIR      # writes OUT_DIR/train.jsonl (72 prompts) and OUT_DIR/eval.jsonl (48)
    python bench/task_gate_task.py --read RUN_DIR ...   # held-out checker gain and the shortcut share, per run
    PYTHONPATH=bench tether ppo ... --reward task_gate_task:check --gold task_gate_task:check
    PYTHONPATH=bench tether ppo ... --reward tether.rules.task_gate:gated:check=task_gate_task:check ...
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PHRASE = "Any other questions?"
INSTRUCTIONS = {
    "phrase": f"Finish your response with this exact phrase {PHRASE}",
    "ps": "At the end of your response, add a postscript starting with P.S.",
    "title": "Give it a title wrapped in double angular brackets, such as <<my title>>.",
}
FORMS = ["note", "story", "letter", "poem"]
TRAIN_TOPICS = ["winter", "honey", "lighthouses", "bicycles", "gardens", "rain", "trains", "cats", "autumn",
                "harbours", "volcanoes", "libraries", "bread", "owls", "bridges", "kites", "deserts", "violins",
                "markets", "snowmen", "islands", "clocks", "forests", "lanterns"]
EVAL_TOPICS = ["spring", "bees", "mountains", "rivers", "dogs", "summer", "coffee", "castles", "boats", "stars",
               "apples", "museums", "rabbits", "storms", "candles", "gardeners"]


def prompts(topics: list[str]) -> list[dict]:
    rows = []
    for i, topic in enumerate(topics):
        for j, (kind, instruction) in enumerate(INSTRUCTIONS.items()):
            form = FORMS[(i + j) % len(FORMS)]
            rows.append({"prompt": f"Write a short {form} about {topic}. {instruction}", "instruction": kind})
    return rows


def check_one(prompt: str, response: str) -> float:
    """1 when the response does what its prompt's instruction says (the checker alone: it reads nothing else)."""
    if "exact phrase" in prompt:
        return float(response.strip().endswith(PHRASE))
    if "postscript" in prompt:
        return float(re.search(r"(^|\n)\s*P\.S\.", response) is not None)
    return float(re.search(r"<<[^<>\n]+>>", response) is not None)


def check(prompts: list[str], responses: list[str], ended_with_eos=None, **_) -> list[float]:
    """The checker as a tether rule; a reply cut by max_new_tokens scores 0."""
    ended = ended_with_eos or [True] * len(responses)
    return [check_one(p, r) if e else 0.0 for p, r, e in zip(prompts, responses, ended)]


def read(run_dir: str) -> str:
    """The run's first and last held-out evaluations judged by the checker (each sample's ``correct``): accuracy,
    the paired gain (exact one-sided McNemar) and how many of the problems the checker newly passes dropped the task
    (tether.diagnostics.shortcut's signals), with those answers."""
    from tether.diagnostics.shortcut import judge, load_evaluations

    evaluations = load_evaluations(run_dir)
    (s0, first), (s1, last) = evaluations[0], evaluations[-1]
    by_check = [[{**s, "score": float(s.get("correct", False))} for s in e] for e in (first, last)]
    f = judge(*by_check, s1, s0)
    acc = [sum(s["score"] for s in e) / len(e) for e in by_check]
    lines = [f"{run_dir}: checker {100 * acc[0]:.0f}% at step {s0} -> {100 * acc[1]:.0f}% at step {s1} "
             f"({f.gained} gained, {f.lost} lost, p = {f.p_gain:.2g}); {len(f.dropped)} of the {f.gained} gains "
             f"dropped the task (kept: {f.gained - len(f.dropped)}, p = {f.p_kept:.2g})"]
    lines += [f"  {d['signals']}: {d['prompt'][:70]!r} -> {d['response'][:100]!r}" for d in f.dropped]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--read":
        print("\n".join(read(r) for r in sys.argv[2:]))
        sys.exit(0)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, topics in (("train", TRAIN_TOPICS), ("eval", EVAL_TOPICS)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts(topics)))
