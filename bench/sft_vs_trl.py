#!/usr/bin/env python
"""``tether sft`` against TRL's SFTTrainer, interleaved in one sitting: seconds per step, tokens/s and the loss curve.

Both trainers get the same model, the same tokens and loss mask (tokenised by tether, handed to TRL as
``input_ids`` + ``completion_mask``), the same micro-batches in the same order (the rows of tether's first epoch,
written in its order and read by TRL in file order: ``bench/trl_sft.py``), the same optimiser, schedule, clip and
precision, 2 threads each, each run in a fresh process; pairs alternate tether and TRL. Modes: ``padded`` (both
right-pad each micro-batch) and ``packed`` (tether ``--packing``: rows no longer than the longest sequence; TRL
``padding_free=True``: each micro-batch flattened into one row). Reported per mode: the median seconds per step
(first step dropped) and tokens/s (every sequence token; padding not counted) of each side, by wall clock and by the
process's CPU seconds (all threads; a loaded shared machine disturbs it far less than the wall clock), the ratio
TRL / tether (> 1: tether faster) with its min–max over pairs, the largest per-step loss gap, peak RSS. The tether
side runs :class:`tether.SFTTrainer` step by step in a fresh process (``--tether-run``), as ``tether sft`` does.

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


def tether_config(model_dir: Path, data: Path, out: Path, packed: bool, a) -> dict:
    """The SFTConfig of the tether side: what ``tether sft --model DIR --data FILE --max-steps … --lr-schedule linear
    --eval-fraction 0 --gold none [--packing]`` sets."""
    return {"model": {"path": str(model_dir)}, "output_dir": str(out), "progress": False, "save_every_minutes": 0,
            "data": {"files": [str(data)], "eval_fraction": 0.0, "max_length": a.max_length, "packing": packed},
            "optim": {"max_steps": a.steps, "batch_size": a.batch_size, "grad_accumulation": a.grad_accumulation,
                      "lr": a.lr, "schedule": "linear"}, "eval": {"gold": "none"}}


def tether_process(config_file: str, out_file: str) -> None:
    """The tether side in a fresh process (``--tether-run``): SFTTrainer step by step, wall and CPU seconds each."""
    import resource
    import time

    import torch

    from tether.sft.train import SFTTrainer

    torch.set_num_threads(2)
    trainer = SFTTrainer(json.loads(Path(config_file).read_text()))
    wall, cpu, losses = [], [], []
    for _ in range(trainer.run.total_steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        losses.append(trainer.step().metrics["sft/loss"])
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    trainer.finish()
    Path(out_file).write_text(json.dumps({"seconds_per_step": wall, "cpu_seconds_per_step": cpu, "losses": losses,
                                          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_tether(model_dir: Path, data: Path, out: Path, packed: bool, a) -> dict:
    config = out.with_suffix(".config.json")
    config.write_text(json.dumps(tether_config(model_dir, data, out, packed, a)))
    result = out.with_suffix(".json")
    subprocess.run([sys.executable, __file__, "--tether-run", str(config), str(result)], check=True,
                   capture_output=True, text=True, env=ENV)
    return json.loads(result.read_text())


def run_trl(python: str, model_dir: Path, trl_data: Path, out: Path, packed: bool, a) -> dict:
    cmd = [python, str(HERE / "trl_sft.py"), "--model", str(model_dir), "--data", str(trl_data), "--steps",
           str(a.steps), "--batch-size", str(a.batch_size), "--grad-accumulation", str(a.grad_accumulation),
           "--lr", str(a.lr), "--threads", "2", "--out", str(out)] + (["--padding-free"] if packed else [])
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=ENV)
    return json.loads(out.read_text())


def median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:])


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--tether-run":
        tether_process(sys.argv[2], sys.argv[3])
        return 0
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
                tw, rw = (median_after_first(x["seconds_per_step"]) for x in (ours, theirs))
                tc, rc = (median_after_first(x["cpu_seconds_per_step"]) for x in (ours, theirs))
                gap = max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"]))
                print(f"pair {pair + 1} {mode}: wall tether {tw:.3f} TRL {rw:.3f} s/step (ratio {rw / tw:.2f}); CPU "
                      f"tether {tc:.3f} TRL {rc:.3f} s/step (ratio {rc / tc:.2f}); loss gap {gap:.2e}; "
                      f"load {load()}", flush=True)
    summarise(results, tokens, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tokens_per_step": tokens, "runs": results}, indent=1))
    return 0


def summarise(results: dict, tokens: list[int], a) -> None:
    """Per mode: tokens/s of each side by wall and CPU seconds, the ratios' medians and spreads, the loss gap."""
    per_step = statistics.mean(tokens[1:])
    print()
    for mode, runs in results.items():
        line = [f"{a.model} {mode}:"]
        for clock, key in (("wall", "seconds_per_step"), ("CPU", "cpu_seconds_per_step")):
            t = [median_after_first(x["tether"][key]) for x in runs]
            r = [median_after_first(x["trl"][key]) for x in runs]
            ratios = [b / c for c, b in zip(t, r)]
            line.append(f"{clock}: tether {per_step / statistics.median(t):.0f} tokens/s, TRL "
                        f"{per_step / statistics.median(r):.0f} tokens/s, TRL / tether {statistics.median(ratios):.2f} "
                        f"({min(ratios):.2f}-{max(ratios):.2f});")
        gap = max(abs(x - y) for run in runs for x, y in zip(run["tether"]["losses"], run["trl"]["losses"]))
        line.append(f"largest loss gap {gap:.2e}; peak RSS tether "
                    f"{statistics.median(x['tether']['peak_rss_mib'] for x in runs):.0f} MiB, TRL "
                    f"{statistics.median(x['trl']['peak_rss_mib'] for x in runs):.0f} MiB")
        print(" ".join(line))
        print(f"  loss curve (pair 1): tether {' '.join(f'{x:.4f}' for x in runs[0]['tether']['losses'])}")
        print(f"                       TRL    {' '.join(f'{x:.4f}' for x in runs[0]['trl']['losses'])}")


if __name__ == "__main__":
    sys.exit(main())
