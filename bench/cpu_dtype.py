#!/usr/bin/env python
"""Is bf16 autocast faster than fp32 on this CPU? A LoRA policy's minibatch update (forward + backward + AdamW) and
its no-grad scoring forward, at recipe 4's shapes (SmolLM2-135M-Instruct + LoRA r 16 on all linear layers, 32 rows ×
~40 prompt + 8 reply tokens, packing off), fp32 against ``torch.autocast(bfloat16)`` over fp32 masters — what
``--model-dtype fp32|bf16`` runs — interleaved in one process, median of --repeats. Prints the CPU's flags that
decide it (AMX: bf16 tiles, ~8× fp32; avx512_bf16: bf16 dot products only).

Usage: python bench/cpu_dtype.py [--policy smollm2-135m-instruct] [--rows 32] [--tokens 48] [--repeats 3]
(any causal LM path or preset; the tiny GPT-2 of the tests with --policy tiny).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return " ".join(have) or "none of avx2/avx512/amx"


def build(policy: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if policy == "tiny":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000))
        targets = ["c_attn", "c_proj", "c_fc"]
    else:
        from tether.presets import resolve_model_path

        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(policy), dtype=torch.float32)
        targets = "all-linear"
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.policy)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (args.rows, args.tokens))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def update(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(ids).logits
        loss = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def score(bf16: bool) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(ids).logits.float().log_softmax(-1)

    times = {(name, bf16): [] for name in ("update", "score") for bf16 in (False, True)}
    for fn, name in ((update, "update"), (score, "score")):
        fn(False), fn(True)  # warm-up: first calls pay for allocation and kernel selection
    for _ in range(args.repeats):
        for fn, name in ((update, "update"), (score, "score")):
            for bf16 in (False, True):
                start = time.perf_counter()
                fn(bf16)
                times[(name, bf16)].append(time.perf_counter() - start)
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.policy} + LoRA r 16, {args.rows} rows × {args.tokens} tokens, median of {args.repeats}")
    for name in ("update", "score"):
        fp32, bf16 = (statistics.median(times[(name, b)]) for b in (False, True))
        print(f"  {name:6s}  fp32 {fp32:7.2f} s   bf16 autocast {bf16:7.2f} s   bf16 / fp32 = {bf16 / fp32:.2f}")


if __name__ == "__main__":
    main()
