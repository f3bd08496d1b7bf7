"""Where a LoRA run's sampler gap comes from: the fold of the adapter into bf16 weights, or the engine's kernels.

A vLLM engine samples from the policy with the adapter folded in (W + s·B·A, cast to the engine's dtype), while the
trainer computes W·x + s·B·A·x under bf16 autocast over fp32 masters (docs/precision.md). Where s·B·A is below the
bf16 spacing of W the fold rounds most of it away. This script measures, on a run's own held-out answers and one of
its checkpoints, the mean |Δ log-prob| per reply token of each numeric path against the trainer's:

    python bench/lora_fold_gap.py RUN_DIR [--step 20] [--n 48]

in transformers only (no vLLM): if the folded bf16 forward is as close to the trainer as fp32 is, a larger gap that
the run logs (``rollout/logprob_gap_mean``) comes from the engine's kernels, not from the fold.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch


def answer_logprobs(model, tokenizer, texts: list[str], starts: list[int], autocast: bool) -> torch.Tensor:
    """Log-probs of each text's reply tokens (from position ``start``), concatenated."""
    out = []
    for text, start in zip(texts, starts):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits.float()
        out.append(logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[start - 1:, 0])
    return torch.cat(out)


def main() -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import yaml

    from tether.presets import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, default=20, help="the evaluation's samples/step_K.jsonl and checkpoint")
    ap.add_argument("--n", type=int, default=48, help="answers scored")
    args = ap.parse_args()
    run = Path(args.run_dir)
    config = yaml.safe_load((run / "config.yaml").read_text())
    torch.manual_seed(0)
    path = resolve_model_path(config["model"]["policy"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in (run / "samples" / f"step_{args.step}.jsonl").open()][:args.n]
    system = config["data"].get("system_prompt") or ""
    texts, starts = [], []
    for r in rows:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                   "content": r["prompt"]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        starts.append(len(tokenizer(prompt).input_ids))
        texts.append(prompt + r["response"] + (tokenizer.eos_token or ""))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run / "checkpoints" / f"step_{args.step:06d}" / "policy")).eval()
    trainer = answer_logprobs(model, tokenizer, texts, starts, autocast=True)
    fp32 = answer_logprobs(model, tokenizer, texts, starts, autocast=False)
    with model.disable_adapter():
        reference = answer_logprobs(model, tokenizer, texts, starts, autocast=True)
    folded = copy.deepcopy(model).merge_and_unload()
    folded_bf16 = answer_logprobs(copy.deepcopy(folded).to(torch.bfloat16), tokenizer, texts, starts, autocast=False)
    folded_autocast = answer_logprobs(folded, tokenizer, texts, starts, autocast=True)
    lost = total = 0.0
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight, delta = module.base_layer.weight.data, module.get_delta_weight("default")
            kept = (weight + delta).to(torch.bfloat16).float() - weight.to(torch.bfloat16).float()
            lost, total = lost + (kept - delta).norm().item() ** 2, total + delta.norm().item() ** 2
    gap = lambda a: (a - trainer).abs().mean().item()
    print(f"{run}, step {args.step}: {trainer.numel()} reply tokens of {len(rows)} held-out answers")
    print("mean |log-prob - the trainer's (bf16 autocast, adapter beside the fp32 base)| per reply token:")
    print(f"  fp32, adapter beside                          {gap(fp32):.4f}")
    print(f"  adapter folded in fp32, bf16 autocast         {gap(folded_autocast):.4f}")
    print(f"  adapter folded, weights rounded to bf16       {gap(folded_bf16):.4f}   (what a bf16 engine holds)")
    print(f"  the reference (adapter off)                   {gap(reference):.4f}   (how far training moved)")
    print(f"relative error of the folded adapter after rounding to bf16: {(lost / total) ** 0.5:.2f} of its norm")


if __name__ == "__main__":
    main()
