#!/usr/bin/env python
"""tether ``--advantage grpo`` against TRL's GRPOTrainer, interleaved in one sitting (issue #39 item 5).

Both trainers get the same model directory (a GPT-2 of bench/ppo_step.py's sizes, random init, its character
tokenizer), the same prompt file and the same rule reward (the share of "x" in a reply, ``rules_for_checks:count_x``
in a temporary folder, the module ``../shared/peers/trl_grpo_bench.py`` imports). The settings are the peers'
mapping (../shared/peers/README.md): P prompts × K samples a step, one epoch of M minibatches (M optimizer steps per
batch, so TRL computes old log-probs too), replies of exactly T tokens (EOS banned before T), group z-scored
rewards (std ε 1e-4), k3 KL to the reference in the loss with β 0.04 and no clip, ε 0.2, token-mean loss, AdamW
(torch, not fused) at lr 1e-5, grad-norm clip 1, fp32, no activation checkpointing, no evaluation, 2 threads. Each
run is a fresh process; the runs alternate tether, TRL, tether, ... and each's median seconds per step over steps
2…N is taken. Printed: every pair, the ratio TRL / tether (> 1: tether is faster) as a median with its min–max, the
peak RSS, and what each side really did (sequences and reply tokens a step, optimizer steps a step), checked
equal.

    python bench/vs_trl_grpo.py --trl-python TRL_VENV/bin/python [--size small|medium | --model DIR] [--pairs 3]
                                [--steps 4] [--packing]

TRL's venv: ``python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 && trl-venv/bin/pip install
trl==1.16.0 torch==2.13.0``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_SCRIPT = HERE.parent.parent / "shared" / "peers" / "trl_grpo_bench.py"
P, K, M, T, BETA, LR = 16, 4, 4, 48, 0.04, 1e-5
RULE = '''def count_x(prompts, completions, **_):
    """The share of "x" among a reply's characters (a dense rule reward, the same on both sides)."""
    return [c.count("x") / max(1, len(c)) for c in completions]
'''


def build(root: Path, size: str, model_dir: str | None = None) -> int:
    """The shared model directory ``root/policy`` (``model_dir`` copied, or bench/ppo_step.py's random GPT-2 of
    ``size``), prompt file and rule module; returns the parameter count."""
    sys.path.insert(0, str(HERE))
    from ppo_step import WORDS, build_models
    from transformers import AutoModelForCausalLM

    if model_dir:
        shutil.copytree(model_dir, root / "policy")
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(root / "policy").parameters())
    else:
        n_params = build_models(root, size)[2]
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))).capitalize() for _ in range(256)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
    (root / "rules_for_checks.py").write_text(RULE)
    shutil.copy(TRL_SCRIPT, root / "trl_grpo_bench.py")
    return n_params


def tether_child(root: Path, steps: int, packing: bool, out: Path) -> None:
    """One tether run in this process, through the same setup and step as `tether ppo`."""
    import torch

    torch.set_num_threads(2)
    sys.path.insert(0, str(root))
    from tether.ppo.config import RunConfig
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    cfg = RunConfig()
    cfg.output_dir, cfg.progress, cfg.save_every_minutes = str(root / f"run-{os.getpid()}"), False, 0
    cfg.model.policy, cfg.data.prompts = str(root / "policy"), str(root / "prompts.jsonl")
    cfg.data.chat_template = "off"
    cfg.reward.sources, cfg.reward.gold, cfg.reward.clip = ["rules_for_checks:count_x"], "none", 0.0
    cfg.batch_size, cfg.samples_per_prompt, cfg.steps = P, K, steps
    cfg.generation.max_new_tokens = cfg.generation.min_new_tokens = T
    cfg.advantage.estimator, cfg.advantage.std_eps = "grpo", 1e-4
    cfg.kl.coef, cfg.kl.estimator, cfg.kl.penalty_in, cfg.kl.k3_clip = BETA, "k3", "loss", 0.0
    cfg.ppo.epochs, cfg.ppo.mini_batches, cfg.ppo.grad_accumulation = 1, M, 1
    cfg.ppo.clip_range, cfg.ppo.early_stop, cfg.ppo.packing = 0.2, False, packing
    cfg.optim.lr, cfg.optim.max_grad_norm = LR, 1.0
    cfg.validate()
    c = setup(cfg)
    generated, generate = [], c.models.engine.generate

    def counted(*args, **kwargs):  # the sequences each step really sampled
        rollout = generate(*args, **kwargs)
        generated.append(len(rollout))
        return rollout

    c.models.engine.generate = counted
    rows = [ppo_step(c, cfg, step) for step in range(1, steps + 1)]
    measured = rows[1:] or rows
    out.write_text(json.dumps({
        "median_s_per_step": statistics.median(r["perf/seconds_step"] for r in measured),
        "step_times_s": [r["perf/seconds_step"] for r in rows],
        "seqs_per_step": generated, "completion_tokens_per_seq": [r["response/length_mean"] for r in rows],
        "opt_steps_per_step": [r["ppo/updates"] for r in rows],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_tether(root: Path, steps: int, packing: bool, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", str(root), "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd + (["--packing"] if packing else []), check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "2"})
    return json.loads(out.read_text())


def run_trl(python: str, root: Path, steps: int, out: Path) -> dict:
    cmd = [python, str(root / "trl_grpo_bench.py"), "--model", str(root / "policy"), "--prompts",
           str(root / "prompts.jsonl"), "--steps", str(steps), "--prompts-per-step", str(P), "--num-generations",
           str(K), "--mini-batches", str(M), "--grad-accum", "1", "--max-completion-length", str(T),
           "--fixed-length", "1", "--beta", str(BETA), "--lr", str(LR), "--temperature", "1.0", "--threads", "2",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode:
        sys.exit(f"vs_trl_grpo: TRL run failed:\n{done.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {"median_s_per_step": r["median_s_per_step_excl_first"], "step_times_s": r["step_times_s"],
            "seqs_per_step": r["seqs_per_step"], "completion_tokens_per_seq": r["completion_tokens_per_seq"],
            "opt_steps_per_step": r["opt_steps_per_step"], "peak_rss_mib": r["peak_rss_mib"],
            "versions": r["versions"], "old_logps_forward": r["old_logps_forward"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", help="python of a virtual environment with trl==1.16.0")
    p.add_argument("--size", choices=("small", "medium"), default="small")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is dropped)")
    p.add_argument("--model", help="a local causal-LM directory to use instead of a random GPT-2 of --size (full "
                   "fine-tuning on both sides: the peers' TRL script has no LoRA)")
    p.add_argument("--packing", action="store_true", help="tether's --packing (each prompt once per K replies)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        tether_child(Path(a.child), a.steps, a.packing, Path(a.out))
        return 0
    if not a.trl_python:
        p.error("--trl-python is required")
    if not TRL_SCRIPT.is_file():
        print(f"vs_trl_grpo: {TRL_SCRIPT} not found (the peers' folder beside the clone)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tether-vs-trl-grpo-") as tmp:
        root = Path(tmp)
        n_params = build(root, a.size, a.model)
        print(f"{a.model or a.size + ' GPT-2'}, {n_params / 1e6:.2f}M params; {P} prompts x {K} samples x {T} "
              f"tokens a step, 1 epoch x {M} minibatches, k3 KL in the loss (beta {BETA}), fp32, 2 threads"
              f"{', tether --packing' if a.packing else ''}", flush=True)
        pairs = []
        for i in range(a.pairs):
            ours = run_tether(root, a.steps, a.packing, root / f"tether{i}.json")
            theirs = run_trl(a.trl_python, root, a.steps, root / f"trl{i}.json")
            for side in (ours, theirs):  # both did what the settings say, measured
                assert set(side["seqs_per_step"]) == {P * K} and set(side["opt_steps_per_step"]) == {M}, side
                assert set(side["completion_tokens_per_seq"]) == {T}, side
            pairs.append((ours, theirs))
            print(f"pair {i + 1}: tether {ours['median_s_per_step']:.2f} s/step ({ours['peak_rss_mib']:.0f} MiB), "
                  f"TRL {theirs['median_s_per_step']:.2f} s/step ({theirs['peak_rss_mib']:.0f} MiB), "
                  f"TRL/tether {theirs['median_s_per_step'] / ours['median_s_per_step']:.2f}", flush=True)
        ratios = [t["median_s_per_step"] / o["median_s_per_step"] for o, t in pairs]
        versions = pairs[-1][1]["versions"]
        print(f"TRL {versions['trl']} (transformers {versions['transformers']}), old log-probs forward: "
              f"{pairs[-1][1]['old_logps_forward']}; every step of both: {P * K} sequences of {T} reply tokens, "
              f"{M} optimizer steps (measured)")
        print(f"TRL / tether seconds per step: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {len(ratios)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
