"""Reward-model training step, packed pairs against padded rows (train-rm's --packing), on a real pair file.

    python bench/rm_packing.py --model smollm2-135m-instruct --pairs runs/pairs-chain-sum.jsonl [--lora-r 16]

Prints, for the same batches of pairs: tokens computed a step and the median seconds of a forward + backward (the BT
loss), packed and padded interleaved, and their ratio; and the largest score gap between the two on the first
batch. The model is the one train-rm builds (a new score head, LoRA when asked).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tether.presets import resolve_model_path
    from tether.rm.backbone import pad_batch
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.packing import pack_pairs, packed_pair_scores
    from tether.rm.train import encode_pairs, load_and_split, load_model, pair_loss

    cfg = RewardTrainingConfig(model=args.model, output_dir="/tmp/unused")
    cfg.data.files, cfg.data.eval_fraction = [args.pairs], 0.1
    if args.lora_r:
        cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules = args.lora_r, 32.0, "all-linear"
    train, _, info = load_and_split(cfg, None)
    model, tokenizer, fmt, pooling = load_model(cfg, resolve_model_path(args.model, what="model"), torch.device("cpu"))
    encoded = encode_pairs(train, tokenizer, fmt, info)
    random.Random(0).shuffle(encoded)
    batches = [encoded[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.repeats)]
    pad = tokenizer.pad_token_id
    autocast = {"device_type": "cpu", "dtype": torch.float32, "enabled": False}
    model.train()

    first = batches[0]
    with torch.no_grad():
        ids, mask = pad_batch([c.ids for c, _ in first] + [r.ids for _, r in first], pad, "right")
        from tether.rm.backbone import pooled_scores

        gap = (packed_pair_scores(model, [c.ids for c, _ in first], [r.ids for _, r in first], pad)
               - pooled_scores(model, ids, mask, pooling)).abs().max().item()

    def step(batch, packed: bool) -> float:
        t0 = time.perf_counter()
        loss, _ = pair_loss(model, [c for c, _ in batch], [r for _, r in batch], cfg, torch.device("cpu"), pad,
                            pooling, None, autocast, packed)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(first, True), step(first, False)  # warm-up
    seconds = {True: [], False: []}
    for batch in batches:
        for packed in (True, False):
            seconds[packed].append(step(batch, packed))
    padded_tokens = statistics.median(2 * len(b) * max(len(t.ids) for p in b for t in p) for b in batches)
    packed_tokens = statistics.median(pack_pairs([c.ids for c, _ in b], [r.ids for _, r in b], pad)[0].tokens
                                      for b in batches)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{args.model}, LoRA r {args.lora_r}, {args.batch_size} pairs a step, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (interleaved)")
    print(f"padded: {padded_tokens:.0f} tokens a step, {med[False]:.2f} s forward + backward")
    print(f"packed: {packed_tokens:.0f} tokens a step, {med[True]:.2f} s forward + backward")
    print(f"speed-up {med[False] / med[True]:.2f}x; largest score gap on the first batch {gap:.2e}")


if __name__ == "__main__":
    main()
