#!/usr/bin/env python
"""Generation against its memory-bandwidth bound (#53 item 4). Decoding a small model reads every weight once per
decode step, so a decode step cannot be faster than weight bytes / memory read bandwidth. This bench measures the
machine's read bandwidth (a reduction over a tensor far larger than the caches), then an engine's
seconds per decode step at several batch sizes (transformers' KV-cached generate through tether.rollout.sampling, or
tether's vLLM engine with --engine vllm; every row forced to the full length:
(t(N new tokens) - t(1 new token)) / (N - 1), so prefill is left out), and prints each as a ratio to the bound.
Median of the repeats, batch sizes interleaved within a repeat. It prints the CPU it ran on; the figures are only as
quiet as the machine was.

Usage: python bench/decode_bound.py [--model PRESET_OR_DIR] [--dtype float32|bfloat16] [--engine transformers|vllm]
       [--batches 1,8,32,96]
       [--new-tokens 48] [--prompt-tokens 48] [--repeats 3] [--threads N]
A ratio near 1 means the engine is as fast as memory allows; far above 1 at batch 1 points at per-step overhead
(Python, kernel launches), and a ratio that grows with the batch means compute, not weights, has become the cost:
the compute bound (2 FLOP per matmul weight per row, at the speed of a matmul probe in the same dtype) and the ratio
to the larger of the two bounds are printed beside it.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from machine import cpu_name

from tether.ppo.perf import peak_flops  # noqa: E402


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a sum over ``gib`` GiB of fp32 (each byte read once)."""
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()  # touch the pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def load(model_arg: str | None, dtype: torch.dtype):
    from tether.hf import load_causal_lm, load_tokenizer
    from tether.presets import resolve_model_path

    if model_arg is None:
        from ppo_step import build_models

        import tempfile
        path = build_models(Path(tempfile.mkdtemp()), "medium")[0]
    else:
        path = resolve_model_path(model_arg, what="policy")
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    return tokenizer, model.to(dtype).eval()


def engine_generate(engine: str, model, tokenizer, rows: int, max_model_len: int, dtype: torch.dtype):
    """``generate(query, mask, max_new_tokens, min_new_tokens=...)`` of the engine a run would use: transformers'
    KV-cached ``model.generate`` (tether.rollout.sampling), or tether's vLLM engine over the same weights."""
    if engine == "transformers":
        from functools import partial

        from tether.rollout.sampling import generate
        return partial(generate, model, tokenizer)
    from tether.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, tokenizer, max_model_len, rows, seed=0, dtype=dtype, sleep=False).generate


def time_generate(generate, tokenizer, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    g = torch.Generator().manual_seed(batch)
    vocab = min(len(tokenizer), 5000)
    query = torch.randint(vocab // 10, vocab, (batch, prompt_tokens), generator=g)
    mask = torch.ones_like(query)
    start = time.perf_counter()
    with torch.no_grad():
        generate(query, mask, new_tokens, min_new_tokens=new_tokens)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="preset or directory (default: bench/ppo_step.py's 10.7M 'medium')")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    ap.add_argument("--batches", default="1,8,32,96")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    tokenizer, model = load(a.model, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    matmul_weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    bandwidth = read_bandwidth()
    bound = weight_bytes / bandwidth
    flops, flops_source = peak_flops(torch.device("cpu"), dtype, seconds=1.0)
    # the engine after the probes: vLLM's CPU worker binds threads and memory to NUMA nodes as it starts
    batches = [int(b) for b in a.batches.split(",")]
    generate = engine_generate(a.engine, model, tokenizer, max(batches), a.prompt_tokens + a.new_tokens, dtype)
    per_step: dict[int, list[float]] = {b: [] for b in batches}
    for b in batches:  # warm-up
        time_generate(generate, tokenizer, b, a.prompt_tokens, 2)
    for _ in range(a.repeats):
        for b in batches:
            full = time_generate(generate, tokenizer, b, a.prompt_tokens, a.new_tokens)
            one = time_generate(generate, tokenizer, b, a.prompt_tokens, 1)
            per_step[b].append((full - one) / (a.new_tokens - 1))
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {a.dtype}, {a.engine}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"weights {weight_bytes / 2**20:.1f} MiB; read bandwidth {bandwidth / 2**30:.2f} GiB/s; "
          f"bound {bound * 1e3:.2f} ms per decode step")
    print(f"matmuls {flops / 1e9:.0f} GFLOP/s ({flops_source}): a decode step of batch b needs at least "
          f"2 x {matmul_weights / 1e6:.1f}M x b FLOP / that")
    print(f"{'batch':>6} {'ms/step':>9} {'x bound':>8} {'compute ms':>11} {'x max(bounds)':>14} {'tokens/s':>9}")
    for b in batches:
        s = statistics.median(per_step[b])
        compute = 2 * matmul_weights * b / flops
        print(f"{b:>6} {s * 1e3:>9.2f} {s / bound:>8.2f} {compute * 1e3:>11.2f} {s / max(bound, compute):>14.2f} "
              f"{b / s:>9.0f}")


if __name__ == "__main__":
    main()
