#!/usr/bin/env python
"""GPU check of PPO on a real model in each rollout layout (NOT run yet: written on a machine without CUDA).

Runs a few PPO steps of the ``smollm2-135m-instruct`` preset in bf16 per variant, each its own
``accelerate launch`` over the visible GPUs, and prints per variant: seconds per phase (weight sync split into
gather and transfer), tokens/s, the rollout share, and memory against the planner's figures for the same run:

- ``fsdp2-lora``, ``fsdp2-full``: FSDP2 over every GPU, the transformers engine (generation gathers the policy);
  peak ``torch.cuda.max_memory_allocated`` against ``tether plan --zero 3 --gpus N``'s peak.
- ``colocated-vllm``: the same FSDP2 LoRA run with ``--engine vllm``, one engine per process, started with the
  plan's memory share and sleeping (level 2) while the trainer trains.
- ``disaggregated-vllm``: ``--rollout-processes R`` (R = N / 2; on one GPU a trainer and a rollout process share
  it, with gloo for the weights since NCCL refuses two ranks on one device), vLLM on the rollout processes.
- ``disaggregated-vllm-async``: the same one step off (``--async-rollout 1``): s/step against the synchronous
  variant's, and every step's ``rollout/staleness`` (0, then 1; never more).

The vLLM variants run with ``--rollout-correction tis`` and print the bf16 engine's mismatch to the trainer
(``rollout/mismatch_kl``, the IS weights, the truncated share): the figure B19 corrects, which a CPU cannot show.
Issue 41's GPU-only fixes are checked where they act, each printed with OK or CHECK:

- the weight sync's seconds are the transfer's, not NCCL's enqueue: one more sync timed with the device
  synchronised around it, against the seconds the engine reports (OK within 20% or 50 ms);
- the weights group's backend (NCCL when every member has a GPU of its own), the bytes one sync sends (a bf16 run:
  Linear weights in bf16, about half of the fp32 masters), and, with R >= 1 rollout processes on N >= 2 GPUs,
  the device memory in use on every GPU: each rollout process's vLLM engine on its own GPU, not all on cuda:0.

vLLM allocates outside torch's allocator statistics (sleep mode's pool), so the vLLM variants also report the
device memory in use after the last step (``torch.cuda.mem_get_info``: every process on the GPU), against the
plan's engine row (weights + KV cache per process) plus the trainer's peak. Needs the real-models extra (the
preset's wheel: see tether/presets.py), vLLM for the vLLM variants (skipped without it), and CUDA; without CUDA
it stops at once.

Usage: python bench/gpu_check.py [--steps 4] [--batch-size 8] [--variants fsdp2-lora,colocated-vllm,...]
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 12 plus 30?", "Name a colour of the sky.", "Write one short sentence about cats.",
           "What is 7 times 6?", "Say hello in French.", "Give a word that rhymes with blue."]
VARIANTS = ("fsdp2-lora", "fsdp2-full", "colocated-vllm", "disaggregated-vllm", "disaggregated-vllm-async")


def run_config(a):
    from tether.ppo.config import RunConfig

    cfg = RunConfig()
    cfg.output_dir, cfg.data.prompts = str(Path(a.root) / f"run-{a.variant}"), str(Path(a.root) / "prompts.jsonl")
    cfg.model.policy, cfg.model.dtype = "smollm2-135m-instruct", "bf16"
    cfg.model.lora_r = 0 if a.variant == "fsdp2-full" else 16
    cfg.reward.sources, cfg.reward.gold = ["tether.rules:char_share"], "none"
    cfg.batch_size, cfg.generation.max_new_tokens, cfg.steps = a.batch_size, 64, a.steps
    cfg.generation.engine = "vllm" if "vllm" in a.variant else "transformers"
    cfg.generation.rollout_processes = a.rollout_processes
    cfg.generation.async_rollout = int(a.variant.endswith("async"))
    cfg.correction.mode = "tis" if "vllm" in a.variant else "none"
    cfg.validate()
    return cfg


def issue41_checks(a, run, rows: list[dict]) -> None:
    """Trainer 0, after the steps: the fixes a GPU alone can show (see the module docstring)."""
    import time

    import torch

    from tether.rollout.weights import manifest

    m, p = run.models, run.processes
    engine = m.engine
    if engine.syncs_weights:
        if run.data.ahead is not None:
            run.data.ahead.collect(run)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.sync_weights(m.unwrapped_policy)  # collective where the sync is: every trainer runs these checks
        torch.cuda.synchronize()
        wall, reported = time.perf_counter() - start, engine.sync_seconds.gather + engine.sync_seconds.transfer
        sent = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for spec in
                   manifest(m.unwrapped_policy, getattr(engine, "dtype", None)) for _, shape, dtype, tied in spec
                   if not tied)
        masters = sum(t.numel() * 4 for t in m.unwrapped_policy.parameters())
        if p.is_main:
            ok = abs(wall - reported) <= max(0.2 * wall, 0.05)
            print(f"{a.variant}: weight sync reported {reported:.3f} s, synchronised wall {wall:.3f} s -> "
                  f"{'OK' if ok else 'CHECK (enqueue time?)'}; {sent / 1e6:.1f} MB sent per sync (fp32 masters "
                  f"{masters / 1e6:.1f} MB)")
            link = getattr(engine, "link", None)
            if link is not None:
                print(f"{a.variant}: weights group backend {link.weights_backend}")
    if p.is_main and "rollout/mismatch_kl" in rows[-1]:
        keys = ("rollout/mismatch_kl", "rollout/is_weight_mean", "rollout/is_weight_max", "rollout/is_truncated_fraction",
                "rollout/logprob_gap_mean")
        print(f"{a.variant}: bf16 engine vs trainer, per step: " + "; ".join(
            ", ".join(f"{k.split('/')[1]} {r[k]:.3g}" for k in keys) for r in rows))
    if p.is_main and a.variant.endswith("async"):
        stale = [r.get("rollout/staleness") for r in rows]
        print(f"{a.variant}: rollout/staleness per step {stale} -> {'OK' if stale[0] == 0 and max(stale) <= 1 else 'CHECK'}")
    if p.is_main and a.rollout_processes and torch.cuda.device_count() >= 2:
        used = [(lambda f, t: (t - f) / 1e9)(*torch.cuda.mem_get_info(i)) for i in range(torch.cuda.device_count())]
        print(f"{a.variant}: device memory in use per GPU (GB): {[round(u, 2) for u in used]} (trainers on the first "
              f"{p.world_size}, rollout processes on the next: each rollout GPU should hold its engine)")


def planned(cfg, trainers: int, zero: int) -> tuple[float, list[dict]]:
    """The planner's peak per trainer and its engine rows for this run."""
    from tether.diagnostics.engine_plan import engine_plan
    from tether.diagnostics.plan import PlanConfig, plan
    from tether.diagnostics.shapes import config_shape
    from tether.presets import resolve_model_path

    path = str(resolve_model_path(cfg.model.policy))
    plan_cfg = PlanConfig(model=path, dtype="bf16", batch_size=cfg.batch_size, prompt_length=cfg.data.max_prompt_length,
                          response_length=cfg.generation.max_new_tokens, lora_r=cfg.model.lora_r, critic_lora_r=0,
                          lora_targets="all", zero=zero, gpus=trainers, critic="head", engine=cfg.generation.engine,
                          rollout_processes=cfg.generation.rollout_processes)
    shape = config_shape(path)
    return plan(shape, plan_cfg)["peak"], engine_plan(shape, plan_cfg)


def worker(a) -> None:
    import torch

    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step
    from tether.rollout.layout import launch_layout

    cfg = run_config(a)
    if launch_layout(cfg).is_rollout:
        from tether.rollout.server import serve

        serve(cfg)
        return
    run = setup(cfg)
    torch.cuda.reset_peak_memory_stats()
    rows = [ppo_step(run, cfg, step) for step in range(1, a.steps + 1)]
    peak = torch.cuda.max_memory_allocated()
    issue41_checks(a, run, rows)
    free, total = torch.cuda.mem_get_info()
    p = run.processes
    peaks = p.gather_objects(peak)
    if p.is_main:
        trainers = p.world_size
        plan_peak, engines = planned(cfg, trainers, zero=3 if run.models.fsdp is not None else 0)
        last = rows[1:] or rows
        mean = {k: sum(r[k] for r in last) / len(last) for k in rows[0] if k.startswith("perf/")}
        keys = ("seconds_step", "seconds_generate", "seconds_weight_sync", "seconds_weight_gather",
                "seconds_weight_transfer", "seconds_score", "seconds_train", "tokens_per_second", "rollout_share")
        print(f"{a.variant}: {trainers} trainer(s), {a.rollout_processes} rollout process(es), mean of {len(last)} "
              f"steps: " + ", ".join(f"{k} {mean['perf/' + k]:.3f}" for k in keys))
        print(f"{a.variant}: peak allocated per trainer (GB): {[round(x / 1e9, 3) for x in peaks]}; plan peak "
              f"{plan_peak / 1e9:.3f}; device in use after the last step {(total - free) / 1e9:.3f} of "
              f"{total / 1e9:.1f} (every process on the GPU)")
        for e in (e for e in engines if e["this_run"]):
            share = e["vllm_gpu_memory_utilization"]
            print(f"{a.variant}: plan, {e['layout']} / {e['process']}: engine weights {e['engine_weights'] / 1e9:.3f}, "
                  f"KV cache {e['kv_cache'] / 1e9:.3f}, sync blocks {e['sync_blocks'] / 1e9:.3f} GB"
                  + (f"; vLLM started at gpu_memory_utilization {share:.3f}" if share else ""))
    p.close()  # every trainer waits for the others (and the rollout processes are told to stop)


def launch(a, variant: str, root: str, n: int) -> int:
    """One variant as its own accelerate launch; returns the exit code."""
    disaggregated = variant.startswith("disaggregated")
    processes = max(2, n) if disaggregated else n
    rollouts = max(1, n // 2) if disaggregated else 0
    config = "disaggregated.yaml" if disaggregated else "fsdp2.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",  # port 0: a free one
           str(REPO / "examples" / "accelerate" / config), "--num_processes", str(processes),
           "--main_process_port", "0", __file__, "--worker", "--variant", variant, "--root", root,
           "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--rollout-processes", str(rollouts)]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "4"}).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--rollout-processes", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_check.py: needs CUDA (no GPU visible); nothing was run", file=sys.stderr)
        return 2
    n, failed = torch.cuda.device_count(), []
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "prompts.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in PROMPTS * 8))
        for variant in a.variants.split(","):
            if "vllm" in variant and importlib.util.find_spec("vllm") is None:
                print(f"bench/gpu_check.py: {variant} skipped: vLLM is not installed (pip install vllm)")
                continue
            if launch(a, variant, root, n):
                print(f"bench/gpu_check.py: the {variant} run failed (output above)", file=sys.stderr)
                failed.append(variant)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
