#!/usr/bin/env python
"""Speed and memory of one PPO step, at the settings of the TRL 1.12 baseline in ../shared/peers/.

Tiny GPT-2 policy and reward model built from configs (printable-ASCII character tokenizer), a
separate critic initialised from the reward model (as TRL's example does) or a value head on the
policy; batch 64 prompts of 2–5 words, responses of exactly 48 tokens (EOS not sampled before), 4 epochs
× 4 minibatches, temperature 0.7, β 0.05 (k1), lr 3e-6, vf_coef 0.1. Prints the median over the
measured steps (the first step is warm-up and is dropped) of seconds per phase, tokens per second and
the peak RSS. Figures go in notes, not in tests.

Usage: python bench/ppo_step.py [--size small|medium] [--critic separate|head] [--steps 6] [--fused-adamw] [--no-trim]
"""

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

SIZES = {"small": dict(n_layer=4, n_embd=128, n_head=4), "medium": dict(n_layer=6, n_embd=384, n_head=6)}
WORDS = ("the a model policy value reward cat dog runs jumps over under quick slow red blue green small large "
         "token text story once upon time there was and then it said hello world why how what").split()


def build_tokenizer(out_dir: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(chars + ["[UNK]", "[BOS]", "[EOS]", "[PAD]"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
                                  pad_token="[PAD]", padding_side="left")
    tok.save_pretrained(out_dir)
    return tok


def build_models(root: Path, size: str):
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    from tether.rm.model import RewardModel, choose_format

    policy_dir, rm_dir = root / "policy", root / "rm"
    tok = build_tokenizer(policy_dir)
    config = GPT2Config(vocab_size=len(tok), n_positions=128, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                        **SIZES[size])
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config)
    policy.save_pretrained(policy_dir)
    rm_model = GPT2ForSequenceClassification(GPT2Config(**{**config.to_dict(), "num_labels": 1}))
    build_tokenizer(rm_dir)
    rm = RewardModel(rm_model, tok, choose_format(tok, "plain"))
    rm.save_pretrained(rm_dir)
    n_params = sum(p.numel() for p in policy.parameters())
    return policy_dir, rm_dir, n_params


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--critic", choices=("separate", "head"), default="separate")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fused-adamw", action="store_true", help="torch's fused AdamW kernel (--fused-adamw)")
    p.add_argument("--no-trim", action="store_true", help="compute on the padded batch (ppo.trim_padding off)")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from tether.ppo.config import RunConfig
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, rm_dir, n_params = build_models(root, a.size)
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))).capitalize() for _ in range(128)]
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
        cfg = RunConfig()
        cfg.output_dir = str(root / "run")
        cfg.model.policy, cfg.data.prompts = str(policy_dir), str(root / "prompts.jsonl")
        cfg.reward.sources, cfg.reward.gold = [str(rm_dir)], "none"
        cfg.critic.kind, cfg.critic.model = a.critic, str(rm_dir) if a.critic == "separate" else ""
        cfg.batch_size, cfg.ppo.mini_batches, cfg.ppo.epochs = a.batch_size, 4, 4
        cfg.generation.max_new_tokens = cfg.generation.min_new_tokens = 48
        cfg.generation.temperature, cfg.kl.coef = 0.7, 0.05
        cfg.optim.lr = cfg.optim.critic_lr = 3e-6
        cfg.ppo.vf_coef, cfg.ppo.early_stop = 0.1, False
        cfg.steps, cfg.optim.fused_adamw, cfg.ppo.trim_padding = a.steps, a.fused_adamw, not a.no_trim
        cfg.validate()
        c = setup(cfg)
        rows = [ppo_step(c, cfg, step) for step in range(1, a.steps + 1)]
    measured = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in measured) for k in (
        "perf/seconds_generate", "perf/seconds_weight_sync", "perf/seconds_logprobs_old", "perf/seconds_reference",
        "perf/seconds_values", "perf/seconds_reward", "perf/seconds_score", "perf/seconds_train", "perf/seconds_step",
        "perf/tokens_per_second", "perf/rollout_share", "perf/mfu", "perf/mfu_train", "perf/padding_fraction")}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"tether PPO step: {a.size} GPT-2 ({n_params / 1e6:.2f}M params per model), critic={a.critic}, "
          f"batch {a.batch_size} x 48 tokens, 4 epochs x 4 minibatches, {torch.get_num_threads()} threads")
    print(f"median of {len(measured)} steps (first dropped as warm-up):")
    for k, v in med.items():
        print(f"  {k:28s} {v:10.3f}")
    print(f"  {'peak RSS (MiB)':28s} {peak_mib:10.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"size": a.size, "critic": a.critic, "params": n_params,
                                            "median": med, "peak_rss_mib": peak_mib}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
