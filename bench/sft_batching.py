#!/usr/bin/env python
"""How to batch SFT sequences of different lengths on this machine, each way exact (no sequence sees another):
tokens/s of ``tether sft`` (every sequence token, padding not counted) with

- ``padded``: random micro-batches right-padded to their longest sequence (the baseline);
- ``grouped``: ``--group-by-length`` (micro-batches of similar lengths: less padding, other micro-batches);
- ``packed``: ``--packing`` (the same micro-batches as padded, packed first-fit into rows no longer than their
  longest sequence, a block-diagonal causal mask per row);
- ``one_row``: the same micro-batches packed into one row each (what varlen flash-attention kernels want; on SDPA
  the dense block-diagonal mask costs the row's length squared).

Runs in this process, interleaved (each repeat times every mode once, in turn), after one warm-up step each: wall
seconds and the process's CPU seconds (all threads; what a loaded shared machine disturbs least); the padding
fraction is of the positions computed. Data: GSM8K train (question → worked answer), the model as in
bench/sft_vs_trl.py.

usage: python bench/sft_batching.py [--model medium] [--steps 6] [--batch-size 8] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("padded", "grouped", "packed", "one_row")


def trainer_for(mode: str, model_dir: Path, data: Path, root: Path, a):
    from tether.sft.train import SFTTrainer

    cfg = {"model": {"path": str(model_dir)}, "output_dir": str(root / f"{mode}-{os.urandom(4).hex()}"),
           "progress": False, "save_every_minutes": 0,
           "data": {"files": [str(data)], "eval_fraction": 0.0, "max_length": a.max_length,
                    "packing": mode in ("packed", "one_row"), "group_by_length": mode == "grouped"},
           "optim": {"batch_size": a.batch_size, "max_steps": a.steps + 1, "lr": 1e-4}, "eval": {"gold": "none"}}
    trainer = SFTTrainer(cfg)
    if mode == "one_row":
        trainer.run.packing = "one_row"
    return trainer


def main() -> int:
    import torch

    from sft_vs_trl import SIZES, prepare

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*SIZES, "smollm2"], default="medium")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    a.grad_accumulation = 1
    torch.set_num_threads(a.threads)
    seconds = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    tokens = {m: [] for m in MODES}  # grouped batches differ from the others' (and their lengths): compare per token
    padding = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, _, _ = prepare(root, a.model, a.steps * a.batch_size * 4, a)
        for repeat in range(a.repeats):
            for mode in MODES:
                trainer = trainer_for(mode, model_dir, data, root, a)
                trainer.step()  # warm-up
                cpu_started = time.process_time()
                rows = [trainer.step().metrics for _ in range(a.steps)]
                cpu[mode].append(time.process_time() - cpu_started)
                seconds[mode].append(sum(r["perf/seconds_step"] for r in rows))
                padding[mode].append(statistics.mean(r["perf/padding_fraction"] for r in rows))
                tokens[mode].append(sum(r["perf/tokens_per_second"] * r["perf/seconds_step"] for r in rows))
                print(f"repeat {repeat + 1} {mode}: {tokens[mode][-1] / seconds[mode][-1]:.0f} tokens/s, "
                      f"{tokens[mode][-1] / cpu[mode][-1]:.0f} tokens/CPU-s, padding {padding[mode][-1]:.1%}; "
                      f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    print()
    def rate(mode: str, clock: dict) -> float:
        return statistics.median(t / s for t, s in zip(tokens[mode], clock[mode]))

    for mode in MODES:
        wall, per_cpu = rate(mode, seconds), rate(mode, cpu)
        print(f"{a.model} {mode:8s}: {wall:.0f} tokens/s, {per_cpu:.0f} tokens/CPU-s (medians of {a.repeats}); "
              f"x padded: wall {wall / rate('padded', seconds):.2f}, CPU {per_cpu / rate('padded', cpu):.2f}; "
              f"padding {statistics.mean(padding[mode]):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
