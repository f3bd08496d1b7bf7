#!/usr/bin/env python
"""Rollout speed of the two engines (C3): tokens per second of `transformers` generate and of vLLM at batch 64 x 48
new tokens, with each engine's start-up and weight-sync cost, on the bench's 10.7M GPT-2 (bench/ppo_step.py's
"medium") or a preset such as smollm2-135m-instruct. Each repeat perturbs the policy's weights (as an update
would), syncs them into the engine and samples; engines alternate within a repeat, median of the repeats. The
vLLM rollout's sampled-token log-probs are checked against the trainer's forward (the gap is printed).

Needs vLLM in the environment (docs/sampling.md); without it only the transformers engine is measured. On a CUDA
machine it runs there (fp32; vLLM with sleep mode between rollouts): the GPU figure issue #14 asks for, not yet
run (no GPU was lent).

Usage: python bench/rollout.py [--size medium|small | --model PRESET_OR_DIR] [--batch 64] [--new-tokens 48]
       [--repeats 3] [--json FILE]
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from ppo_step import SIZES, WORDS, build_models  # noqa: E402


def policy_and_prompts(root: Path, a):
    from tether.hf import load_causal_lm, load_tokenizer
    from tether.presets import resolve_model_path
    from tether.rollout.sampling import encode_prompts

    path = resolve_model_path(a.model, what="policy") if a.model else build_models(root, a.size)[0]
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))).capitalize() for _ in range(a.batch)]
    query, query_mask = encode_prompts(tokenizer, prompts, 64, False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a GPU: the prepared GPU check
    return model.to(device).eval(), tokenizer, query.to(device), query_mask.to(device)


def make(name: str, model, tokenizer, a):
    from tether.rollout.engines import TransformersEngine

    if name == "transformers":
        return TransformersEngine(model, tokenizer)
    from tether.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, tokenizer, max_model_len=64 + a.new_tokens, rows=a.batch, seed=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--model", default="", help="a preset name or model directory instead of --size")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        import vllm  # noqa: F401
        names = ["transformers", "vllm"]
    except ImportError:
        names = ["transformers"]
        print("vLLM is not installed: measuring the transformers engine only (docs/sampling.md)")

    from tether.ppo.forward import forward_response

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, query, query_mask = policy_and_prompts(Path(tmp), a)
        n_params = sum(p.numel() for p in model.parameters())
        engines, startup = {}, {}
        for name in names:
            t = time.perf_counter()
            engines[name] = make(name, model, tokenizer, a)
            startup[name] = time.perf_counter() - t
        seconds = {name: {"sync": [], "generate": []} for name in names}
        gap = float("nan")
        for repeat in range(a.repeats):
            with torch.no_grad():  # an "update": every weight moves a little
                for param in model.parameters():
                    param.mul_(1 + 1e-3 * torch.randn_like(param))
            for name in (names if repeat % 2 == 0 else names[::-1]):
                engine = engines[name]
                t = time.perf_counter()
                engine.sync_weights(model)
                seconds[name]["sync"].append(time.perf_counter() - t)
                torch.manual_seed(repeat)
                t = time.perf_counter()
                rollout = engine.generate(query, query_mask, a.new_tokens, 0.7, min_new_tokens=a.new_tokens)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # kernels are asynchronous: time what they did, not their launch
                seconds[name]["generate"].append(time.perf_counter() - t)
                assert int(rollout.lengths.sum()) == a.batch * a.new_tokens
                if rollout.logprobs_sampler is not None:
                    with torch.no_grad():
                        logprobs, _, _ = forward_response(model, rollout, 0.7)
                    gap = float(((rollout.logprobs_sampler - logprobs).abs() * rollout.response_mask).max())
    tokens = a.batch * a.new_tokens
    label = a.model or f"{a.size} GPT-2"
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{torch.get_num_threads()} CPU threads"
    print(f"rollout engines: {label} ({n_params / 1e6:.1f}M params), batch {a.batch} x {a.new_tokens} new tokens, "
          f"{where}, median of {a.repeats}")
    print(f"  {'engine':14s} {'start-up s':>10s} {'sync s':>8s} {'generate s':>10s} {'tokens/s':>9s}")
    figures = {}
    for name in names:
        sync, gen = statistics.median(seconds[name]["sync"]), statistics.median(seconds[name]["generate"])
        figures[name] = {"startup_s": startup[name], "sync_s": sync, "generate_s": gen, "tokens_per_s": tokens / gen,
                         "generate_all_s": seconds[name]["generate"]}
        print(f"  {name:14s} {startup[name]:10.1f} {sync:8.3f} {gen:10.2f} {tokens / gen:9.0f}")
    if len(names) == 2:
        ratio = figures["transformers"]["generate_s"] / figures["vllm"]["generate_s"]
        print(f"  vLLM / transformers tokens/s: {ratio:.2f}x; vLLM sampled-token log-prob gap vs the trainer: {gap:.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": label, "params": n_params, "batch": a.batch,
                                            "new_tokens": a.new_tokens, "engines": figures, "logprob_gap": gap},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
