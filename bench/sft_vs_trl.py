#!/usr/bin/env python
"""``tether sft`` against TRL's SFTTrainer, interleaved in one sitting: seconds per step, tokens/s and the loss curve.

Both trainers get the same model, the same tokens and loss mask (tokenised by tether, handed to TRL as
``input_ids`` + ``completion_mask``), the same micro-batches in the same order (the rows of tether's first epoch,
written in its order and read by TRL in file order: ``bench/trl_sft.py``), the same optimiser, schedule, clip and
precision, 2 threads each, each run in a fresh process; pairs alternate tether and TRL. Modes: ``padded`` (both
right-pad each micro-batch) and ``packed`` (tether ``--packing``: rows no longer than the longest sequence; TRL
``padding_free=True``: each micro-batch flattened into one row). Reported per mode: the median seconds per step
(first step dropped) and tokens/s (every sequence token; padding not counted) of each side, the ratio TRL / tether
(> 1: tether faster) with its min–max over pairs, the largest per-step loss gap between the two curves, peak RSS.

Models: ``small`` / ``medium`` (a GPT-2 of 0.8M / 10.7M parameters built from a config, the demo's character
tokenizer, as bench/ppo_step.py), or ``smollm2`` (SmolLM2-135M-Instruct through its chat template; the
real-models extra). Data: GSM8K train problems (question → worked answer), ``../shared/data/gsm8k/train.jsonl``.

usage: python bench/sft_vs_trl.py --trl-python /work/trl-venv/bin/python [--model medium] [--steps 8]
       [--batch-size 8] [--grad-accumulation 1] [--max-length 512] [--pairs 3] [--modes padded,packed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SIZES = {"small": (4, 128, 4), "medium": (6, 384, 6)}  # layers, width, heads
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def prepare(root: Path, model: str, rows: int, a) -> tuple[Path, Path, Path, list[int]]:
    """The model directory, tether's rows file, TRL's tokenised file (tether's order) and the tokens per step."""
    from tether.demo.task import build_policy, build_tokenizer
    from tether.hf import load_tokenizer
    from tether.presets import resolve_model_path
    from tether.sft.batches import StepStream
    from tether.sft.config import DataConfig
    from tether.sft.data import load_rows
    from tether.sft.tokens import IGNORE_INDEX, encode_rows, text_format

    data = root / "rows.jsonl"
    lines = GSM8K.read_text(encoding="utf-8").splitlines()[:rows]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if model == "smollm2":
        model_dir = resolve_model_path("smollm2-135m-instruct", what="model")
    else:
        model_dir = root / "model"
        tokenizer = build_tokenizer(model_dir)
        layers, width, heads = SIZES[model]
        build_policy(tokenizer, seed=0, n_layer=layers, n_embd=width, n_head=heads,
                     n_positions=a.max_length).save_pretrained(model_dir)
    from types import SimpleNamespace

    from transformers import GenerationConfig

    tokenizer = load_tokenizer(model_dir)
    model = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model_dir))  # what text_format reads
    fmt = text_format(DataConfig(max_length=a.max_length), tokenizer, model, str(model_dir))
    examples, _ = encode_rows(tokenizer, load_rows([str(data)])[0], fmt)
    stream = StepStream(examples, a.batch_size, a.grad_accumulation, seed=0)
    ordered, tokens = [], []
    for _ in range(a.steps):
        micro, _ = stream.next_step()
        step = [examples[i] for m in micro for i in m]
        ordered += step
        tokens.append(sum(len(e.ids) for e in step))
    trl_data = root / "trl.jsonl"
    trl_data.write_text("".join(json.dumps({"input_ids": e.ids, "completion_mask": [int(x != IGNORE_INDEX)
                                                                                   for x in e.labels]}) + "\n"
                                for e in ordered), encoding="utf-8")
    return Path(model_dir), data, trl_data, tokens


def run_tether(model_dir: Path, data: Path, out: Path, packed: bool, a) -> tuple[list[float], list[float], float]:
    cmd = [sys.executable, "-m", "tether", "sft", "--model", str(model_dir), "--data", str(data), "--output-dir",
           str(out), "--max-steps", str(a.steps), "--batch-size", str(a.batch_size), "--grad-accumulation",
           str(a.grad_accumulation), "--lr", str(a.lr), "--lr-schedule", "linear", "--eval-fraction", "0",
           "--max-length", str(a.max_length), "--save-every-minutes", "0", "--progress", "false", "--gold", "none"]
    subprocess.run(cmd + (["--packing"] if packed else []), check=True, capture_output=True, text=True, env=ENV)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((out / "tether_sft.json").read_text())
    return [r["perf/seconds_step"] for r in rows], [r["sft/loss"] for r in rows], meta["run"]["peak_rss_mb"]


def run_trl(python: str, model_dir: Path, trl_data: Path, out: Path, packed: bool, a
            ) -> tuple[list[float], list[float], float]:
    cmd = [python, str(HERE / "trl_sft.py"), "--model", str(model_dir), "--data", str(trl_data), "--steps",
           str(a.steps), "--batch-size", str(a.batch_size), "--grad-accumulation", str(a.grad_accumulation),
           "--lr", str(a.lr), "--threads", "2", "--out", str(out)] + (["--padding-free"] if packed else [])
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=ENV)
    result = json.loads(out.read_text())
    return result["seconds_per_step"], result["losses"], result["peak_rss_mib"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", required=True, help="python of a virtual environment with trl==1.16.0")
    p.add_argument("--model", choices=[*SIZES, "smollm2"], default="medium")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--modes", default="padded,packed")
    p.add_argument("--json", help="write every run's figures here")
    a = p.parse_args()
    modes = a.modes.split(",")
    rows_needed = a.steps * a.batch_size * a.grad_accumulation  # one epoch of full micro-batches
    results = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, trl_data, tokens = prepare(root, a.model, rows_needed, a)
        print(f"{a.model}: {a.steps} steps x {a.batch_size} x {a.grad_accumulation} GSM8K rows, "
              f"{statistics.mean(tokens):.0f} tokens a step; load {load()}", flush=True)
        for pair in range(a.pairs):
            for mode in modes:
                packed = mode == "packed"
                ours = run_tether(model_dir, data, root / f"tether_{mode}_{pair}", packed, a)
                theirs = run_trl(a.trl_python, model_dir, trl_data, root / f"trl_{mode}_{pair}.json", packed, a)
                results[mode].append({"tether": ours, "trl": theirs, "load": load()})
                t, r = statistics.median(ours[0][1:]), statistics.median(theirs[0][1:])
                gap = max(abs(x - y) for x, y in zip(ours[1], theirs[1]))
                print(f"pair {pair + 1} {mode}: tether {t:.3f} s/step, TRL {r:.3f} s/step, ratio {r / t:.2f}, "
                      f"loss gap {gap:.2e}; load {load()}", flush=True)
    tokens_per_step = statistics.mean(tokens[1:])
    print()
    for mode, runs in results.items():
        t = [statistics.median(x["tether"][0][1:]) for x in runs]
        r = [statistics.median(x["trl"][0][1:]) for x in runs]
        ratios = [b / c for c, b in zip(t, r)]
        gap = max(abs(x - y) for run in runs for x, y in zip(run["tether"][1], run["trl"][1]))
        print(f"{a.model} {mode}: tether {tokens_per_step / statistics.median(t):.0f} tokens/s "
              f"({statistics.median(t):.3f} s/step), TRL {tokens_per_step / statistics.median(r):.0f} tokens/s "
              f"({statistics.median(r):.3f} s/step); TRL / tether = {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(runs)} pairs); largest loss gap {gap:.2e}; "
              f"peak RSS tether {statistics.median(x['tether'][2] for x in runs):.0f} MiB, "
              f"TRL {statistics.median(x['trl'][2] for x in runs):.0f} MiB")
        print(f"  loss curve (pair 1): tether {' '.join(f'{x:.4f}' for x in runs[0]['tether'][1])}")
        print(f"                       TRL    {' '.join(f'{x:.4f}' for x in runs[0]['trl'][1])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tokens_per_step": tokens, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
