#!/usr/bin/env python
"""Seconds of a PPO step with and without the forwards a step can leave out (issue 53 items 2-3, tether/ppo/skips.py).

GRPO on a GPT-2 built from a config (bench/ppo_step.py's models: character tokenizer, `--size small|medium`), K = 4
samples of `--prompts` prompts of 8-12 words (~60 characters), responses of exactly 48 tokens, one epoch of one
minibatch, beta = 0, a rule reward (no reward-model forward in the timing). Three arms, set up once each and stepped
in turn (interleaved: repeat r steps every arm once before repeat r+1), after one warm-up step each:

  before   this round's defaults: padded rows (--no-packing), the old-log-prob pass and the reference pass
  packed   packing (the K > 1 default now), both passes still run (--old-logprobs forward --kl-reference always)
  skips    today's defaults: packed, log pi_old from the update's forward, no reference pass at beta = 0

Prints the median of `--repeats` (3) of each arm's wall seconds per step and of its scoring and train phases, the
ratios, and the CPU's model name from /proc/cpuinfo. Figures go in docs, never in tests.

Usage: python bench/forward_skips.py [--size small|medium] [--prompts 8] [--repeats 3]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from machine import cpu_name

WORDS = ["the", "a", "model", "policy", "value", "reward", "cat", "dog", "runs", "jumps", "over", "under", "quick", "slow", "red", "blue", "green", "small", "large", "token", "text", "story", "once", "upon", "time", "there", "was", "and", "then", "it", "said", "hello", "world", "why", "how", "what"]
ARMS = {"before": {"packing": False, "old_logprobs": "forward", "reference": "always"},
        "packed": {"packing": None, "old_logprobs": "forward", "reference": "always"},
        "skips": {"packing": None, "old_logprobs": "auto", "reference": "auto"}}


def make_config(root: Path, policy_dir: Path, prompts: Path, n_prompts: int, arm: dict):
    from tether.ppo.config import RunConfig

    cfg = RunConfig()
    cfg.output_dir = str(root / "run")
    cfg.model.policy, cfg.data.prompts = str(policy_dir), str(prompts)
    cfg.reward.sources, cfg.reward.gold = ["tether.rules:char_share:char=e"], "none"
    cfg.advantage.estimator, cfg.samples_per_prompt, cfg.batch_size = "grpo", 4, n_prompts
    cfg.ppo.epochs, cfg.ppo.mini_batches, cfg.kl.coef = 1, 1, 0.0
    cfg.generation.max_new_tokens = cfg.generation.min_new_tokens = 48
    cfg.generation.temperature, cfg.optim.lr = 0.7, 3e-6
    cfg.data.eval_fraction, cfg.eval.at_start, cfg.progress = 0.0, False, False
    cfg.ppo.packing, cfg.ppo.old_logprobs, cfg.kl.reference = arm["packing"], arm["old_logprobs"], arm["reference"]
    cfg.validate()
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("small", "medium"), default="small")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (x 4 samples)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from ppo_step import build_models

    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    seconds = {arm: {"step": [], "score": [], "train": []} for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, _, n_params = build_models(root, a.size)
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 12))).capitalize()[:70] for _ in range(256)]
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
        runs = {}
        for arm, settings in ARMS.items():
            cfg = make_config(root / arm, policy_dir, root / "prompts.jsonl", a.prompts, settings)
            runs[arm] = (setup(cfg), cfg)
            ppo_step(runs[arm][0], cfg, 1)  # warm-up
        for r in range(a.repeats):
            for arm, (run, cfg) in runs.items():
                start = time.perf_counter()
                m = ppo_step(run, cfg, r + 2)
                seconds[arm]["step"].append(time.perf_counter() - start)
                seconds[arm]["score"].append(m["perf/seconds_score"])
                seconds[arm]["train"].append(m["perf/seconds_train"])
        packed = {arm: run.models.forward.packing for arm, (run, _) in runs.items()}
        skipped = {arm: (run.models.skips.old_logprobs, run.models.skips.reference) for arm, (run, _) in runs.items()}
    med = {arm: {k: statistics.median(v) for k, v in s.items()} for arm, s in seconds.items()}
    print(f"tether PPO step, forwards left out: {a.size} GPT-2 ({n_params / 1e6:.2f}M params), GRPO K=4 x "
          f"{a.prompts} prompts, 48 new tokens, 1 epoch x 1 minibatch, beta 0, {torch.get_num_threads()} threads")
    print(f"CPU: {cpu_name()}; median of {a.repeats}, interleaved, after one warm-up step per arm")
    for arm in ARMS:
        print(f"  {arm:7s} packed={packed[arm]!s:5s} skips(old, ref)={skipped[arm]}  step {med[arm]['step']:7.3f} s"
              f"  (score {med[arm]['score']:.3f}, train {med[arm]['train']:.3f})  runs {seconds[arm]['step']}")
    for base in ("before", "packed"):
        print(f"  step {base} / skips: {med[base]['step'] / med['skips']['step']:.3f}x;  scoring phase "
              f"{med[base]['score'] / max(med['skips']['score'], 1e-9):.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"size": a.size, "params": n_params, "cpu": cpu_name(),
                                            "seconds": seconds, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
