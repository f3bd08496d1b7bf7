#!/usr/bin/env python
"""How often do tether's own math rule (tether.rules:math_correct) and Hugging Face's math-verify
(tether.rules:math_verify_correct) give the same verdict? On GSM8K's and SVAMP's gold answers (each reference
solution against its own answer and against the next problem's), on the 5,276 recorded GSM8K solutions of four
GPT-3 models (gsm8k/example_model_solutions.jsonl, with OpenAI's is_correct labels), and on SmolLM2-135M-Instruct's
greedy replies to SVAMP and GSM8K test problems in recipe 2's setting (generated here, cached in --samples).

Prints one table row per set (verdict counts, agreement, and each rule's agreement with is_correct where the data
has it) and writes every disagreement to --out (JSON) to be read. Needs ../shared/data and math-verify
(pip install 'tether[math-verify]'); SmolLM2 needs the real-models wheels (docs/real-models.md).

  python bench/math_verify_agreement.py --smollm2 100,50 --samples /tmp/smollm2_replies.jsonl --out /tmp/mv.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tether.rules import gold_integer, math_correct, math_verify_correct

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SYSTEM = ("You are a math tutor. Solve the word problem in at most three short sentences, then end with "
          "'The answer is N.'")  # recipe 2's system turn (examples/recipe2-ppo-svamp.yaml)


def gsm8k_rows() -> list[dict]:
    rows = []
    for split in ("train", "test"):
        rows += [json.loads(line) for line in (DATA / "gsm8k" / f"{split}.jsonl").read_text().splitlines()]
    return rows


def svamp_rows() -> list[dict]:
    return json.loads((DATA / "svamp" / "SVAMP.json").read_text())


def gold(answer) -> str:
    """The gold answer as a tether run's ``answer`` column holds it: GSM8K's "… #### N" and SVAMP's 8.0 reduced to
    the integer (tether.ppo.prompts), the form both rules get in training and evaluation."""
    return str(gold_integer(answer))


def gold_answer_sets() -> dict[str, list[tuple[str, str, bool | None]]]:
    """(response, gold, label) triples: each reference solution (GSM8K) or answer as written (SVAMP) against its own
    gold answer (label True) and against the next problem's (label None: right only when the two answers agree),
    and the recorded GPT-3 solutions against their problem's gold (label: OpenAI's is_correct)."""
    gsm, svamp = gsm8k_rows(), svamp_rows()
    sets = {"gsm8k gold solutions": [(r["answer"], gold(r["answer"]), True) for r in gsm],
            "gsm8k gold, next problem's answer": [(r["answer"], gold(n["answer"]), None) for r, n in zip(gsm, gsm[1:])],
            "svamp gold answers": [(str(r["Answer"]), gold(r["Answer"]), True) for r in svamp],
            "svamp gold, next problem's answer": [(str(r["Answer"]), gold(n["Answer"]), None)
                                                  for r, n in zip(svamp, svamp[1:])]}
    test = {r["question"]: r["answer"] for r in gsm}
    solved = [json.loads(line) for line in (DATA / "gsm8k" / "example_model_solutions.jsonl").read_text().splitlines()]
    sets["gsm8k recorded GPT-3 solutions"] = [
        (row[model]["solution"], gold(test[row["question"]]), bool(row[model]["is_correct"]))
        for row in solved for model in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")]
    return sets


def smollm2_replies(n_svamp: int, n_gsm8k: int, cache: Path) -> dict[str, list[tuple[str, str, bool | None]]]:
    """SmolLM2-135M-Instruct's greedy replies (recipe 2: its chat template, the tutor system turn, 96 new tokens) to
    the first SVAMP problems and GSM8K test problems, cached in ``cache`` (one JSON object per reply)."""
    wanted = {"svamp": n_svamp, "gsm8k": n_gsm8k}
    done = [json.loads(line) for line in cache.read_text().splitlines()] if cache.is_file() else []
    have = {s: sum(1 for d in done if d["set"] == s) for s in wanted}
    if any(have[s] < n for s, n in wanted.items()):
        done = generate(wanted, cache)
    out = {}
    for name in wanted:  # a reply cut by max_new_tokens scores 0 under both rules; its text is read here as if ended
        rows = [d for d in done if d["set"] == name][:wanted[name]]
        ended = sum(d["ended"] for d in rows)
        out[f"smollm2 {name} replies ({ended} of {len(rows)} ended)"] = [(d["response"], d["answer"], None)
                                                                         for d in rows]
    return out


def generate(wanted: dict[str, int], cache: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.presets import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = [("svamp", f"{r['Body'].strip()} {r['Question'].strip()}", gold(r["Answer"]))
                for r in svamp_rows()[:wanted["svamp"]]]
    test = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()]
    problems += [("gsm8k", r["question"], gold(r["answer"])) for r in test[:wanted["gsm8k"]]]
    out, start = [], time.perf_counter()
    for i in range(0, len(problems), 16):
        chunk = problems[i:i + 16]
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                               tokenize=False, add_generation_prompt=True) for _, q, _ in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=96, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for (name, question, answer), row in zip(chunk, ids[:, batch["input_ids"].shape[1]:]):
            ended = bool((row == tokenizer.eos_token_id).any())
            out.append({"set": name, "prompt": question, "answer": answer, "ended": ended,
                        "response": tokenizer.decode(row, skip_special_tokens=True)})
        print(f"  generated {len(out)}/{len(problems)} ({time.perf_counter() - start:.0f} s)", flush=True)
    cache.write_text("".join(json.dumps(d) + "\n" for d in out), encoding="utf-8")
    return out


def compare(name: str, triples: list[tuple[str | None, str, bool | None]]) -> tuple[dict, list[dict]]:
    """Both rules on every (response, gold, label). Returns the counts and the disagreements."""
    responses, golds = [t[0] for t in triples], [t[1] for t in triples]
    start = time.perf_counter()
    ours = math_correct([""] * len(triples), responses, answer=golds)
    seconds_ours = time.perf_counter() - start
    start = time.perf_counter()
    theirs = math_verify_correct([""] * len(triples), responses, answer=golds)
    seconds_theirs = time.perf_counter() - start
    counts = {"set": name, "n": len(triples), "both right": 0, "both wrong": 0, "tether only": 0,
              "math-verify only": 0, "math-verify no verdict": 0, "s tether": seconds_ours,
              "s math-verify": seconds_theirs}
    labelled = [t[2] for t in triples if t[2] is not None]
    agree_label = {"tether": 0, "math-verify": 0}
    differ = []
    for (response, gold, label), a, b in zip(triples, ours, theirs):
        if b is None:
            counts["math-verify no verdict"] += 1
        elif a == b:
            counts["both right" if a else "both wrong"] += 1
        else:
            counts["tether only" if a else "math-verify only"] += 1
        if label is not None:
            agree_label["tether"] += (a > 0.5) == label
            agree_label["math-verify"] += (b is not None and b > 0.5) == label
        if b is None or a != b:
            differ.append({"set": name, "gold": gold[-80:], "response": response[-300:], "tether": a,
                           "math-verify": b, "label": label})
    counts["agreement"] = (counts["both right"] + counts["both wrong"]) / max(len(triples), 1)
    if labelled:
        counts.update({f"{k} = label": v / len(labelled) for k, v in agree_label.items()})
    return counts, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", default="0,0", help="SVAMP,GSM8K problems to sample SmolLM2 replies for (0,0: none)")
    ap.add_argument("--samples", type=Path, default=Path("smollm2_replies.jsonl"), help="cache of SmolLM2's replies")
    ap.add_argument("--out", type=Path, default=Path("math_verify_disagreements.json"))
    args = ap.parse_args()
    sets = gold_answer_sets()
    n_svamp, n_gsm8k = (int(x) for x in args.smollm2.split(","))
    if n_svamp or n_gsm8k:
        sets.update(smollm2_replies(n_svamp, n_gsm8k, args.samples))
    table, differ = [], []
    for name, triples in sets.items():
        counts, found = compare(name, triples)
        table.append(counts)
        differ += found
    keys = ["set", "n", "both right", "both wrong", "tether only", "math-verify only", "math-verify no verdict",
            "agreement", "tether = label", "math-verify = label", "s tether", "s math-verify"]
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for row in table:
        print("| " + " | ".join(f"{row[k]:.4f}" if isinstance(row.get(k), float) else str(row.get(k, "–"))
                                 for k in keys) + " |")
    args.out.write_text(json.dumps(differ, indent=1), encoding="utf-8")
    print(f"{len(differ)} disagreements written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
