"""The expected time of ``tether rlhf`` on this machine, printed before it starts.

How it is estimated (``--estimate``, the default): a calibration times one sampled generate call of a PPO step's
rows (``--batch-size`` × ``--samples-per-prompt`` replies, up to ``--max-new-tokens``) from the starting policy, and
one forward + backward pass of the policy on those sequences. Each stage is priced in those two units:

- pairs: (problems × ``--pair-samples`` / rows) generate calls;
- reward model: pairs × epochs × 2 sequences / rows updates, the pairs assumed to be half the problems at their cap;
- PPO arm: steps × (a generate call + 2 updates: the reference, old and reward-model scores ≈ one, the update one)
  + its evaluations (held-out problems / rows generate calls each);
- SFT (with ``--sft-steps``), DPO: their updates.

A rough guide (reply lengths change as the policy learns, the machine may be shared): stages already complete are
skipped and cost nothing. ``--estimate false`` skips the calibration and prints the stages alone.
"""

from __future__ import annotations

import math
import time

import torch


def calibrate(cfg, prompt: str) -> tuple[float, float, int]:
    """``(seconds of one generate call, seconds of one forward + backward, rows)`` on the starting policy."""
    from tether.hf import load_causal_lm, load_tokenizer, quiet_transformers
    from tether.presets import resolve_model_path

    path = resolve_model_path(cfg.model.policy, what="policy")
    rows = cfg.ppo.batch_size * cfg.ppo.samples_per_prompt
    with quiet_transformers():  # its load reports and generate's notes are no part of the estimate
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, cfg.model.dtype, False)
        enc = tokenizer([prompt] * rows, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(**enc, do_sample=True, temperature=cfg.task.temperature,
                                 max_new_tokens=cfg.task.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.train()
        embeddings = None
        if cfg.model.lora_r:  # a LoRA update computes the activations' gradients, not the frozen weights' ones
            model.requires_grad_(False)
            embeddings = model.get_input_embeddings()(seq).detach().requires_grad_(True)
        inputs = {"inputs_embeds": embeddings} if embeddings is not None else {"input_ids": seq}
        model(**inputs, labels=seq).loss.backward()  # (rows, T): one update's forward + backward
    return t_gen, time.perf_counter() - t0, rows


def training_problems(cfg) -> int:
    """The training problems the task stage will write: an rg: task's split holds fewer than ``--task-train`` when
    its problem space is small (two one-digit terms: 100 of the 2000 asked for)."""
    if cfg.task.prompts.startswith("rg:"):
        from tether.tasks import split_rows

        return len(split_rows(cfg.task.prompts, cfg.task.task_train, cfg.ppo.eval_n, cfg.task.task_seed)[0])
    with open(cfg.task.prompts, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


def stage_seconds(cfg, kind: str, t_gen: float, t_upd: float, rows: int, steps: int = 0) -> float | None:
    """A stage's expected seconds from the two calibrated units (the module docstring's prices); ``steps``: a PPO
    arm's own (0 = ``ppo.steps``)."""
    problems = cfg.pairs.prompts or training_problems(cfg)
    pairs = problems * 0.5 * (cfg.pairs.max_per_prompt or cfg.pairs.samples_per_prompt)
    if cfg.pairs.max_pairs:
        pairs = min(pairs, cfg.pairs.max_pairs)
    if kind == "pairs":
        return math.ceil(problems * cfg.pairs.samples_per_prompt / rows) * t_gen
    if kind == "rm":
        return pairs * cfg.rm.epochs * 2 / rows * t_upd
    if kind == "ppo":
        steps = steps or cfg.ppo.steps
        evals = 1 + steps // cfg.ppo.eval_every
        return steps * (t_gen + 2 * t_upd) + evals * math.ceil(cfg.ppo.eval_n / rows) * t_gen
    if kind == "dpo":
        return pairs * 2 * 2 / rows * t_upd + math.ceil(cfg.ppo.eval_n / rows) * t_gen
    if kind == "sft" and cfg.sft.steps:
        return cfg.sft.steps * t_upd
    return 0.0 if kind == "task" else None


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "not estimated"
    return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"


def estimate_stages(cfg, plan: list, done: set[str]) -> tuple[dict, tuple | None]:
    """``({stage name: expected seconds or None}, units)`` for the stages not done; units None (and no figures)
    without ``--estimate``."""
    units = None
    if cfg.estimate and any(st.name not in done for st in plan):
        from tether.pipeline.stages import task_prompt

        units = calibrate(cfg, task_prompt(cfg))
    return {st.name: stage_seconds(cfg, st.kind, *units, st.arm[4] if st.arm else 0) if units else None
            for st in plan if st.name not in done}, units


def estimate_lines(cfg, plan: list, done: set[str], estimated: dict, units: tuple | None) -> list[str]:
    """One line per stage (what it does, its expected time or 'complete, skipped'), then the total and how it was
    estimated."""
    lines, total, unknown = [], 0.0, 0
    for st in plan:
        if st.name in done:
            lines.append(f"{st.name:<22} complete, skipped")
            continue
        seconds = estimated[st.name]
        total += seconds or 0.0
        unknown += seconds is None
        lines.append(f"{st.name:<22} {fmt(seconds) if units else '':<14} {st.what}")
    if units:
        t_gen, t_upd, rows = units
        more = f" + {unknown} stage(s) not estimated" if unknown else ""
        lines.append(f"expected time on this machine: {fmt(total)}{more} (calibrated now: one generate call of "
                     f"{rows} replies {t_gen:.2f} s, one forward + backward {t_upd:.2f} s; stages priced in those "
                     "units, docs/commands.md: a rough guide)")
    return lines


def repriced_remaining(plan: list, estimated: dict, actual: dict) -> float | None:
    """Seconds the stages not yet run should take, each kind's estimate scaled by what that kind's completed stages
    took against their estimates (the calibration's generate is transformers' on one batch, and a stage's real
    batches, engine and reply lengths differ: the first stage of a kind prices the rest of it). None without
    estimates."""
    kinds = {st.name: st.kind for st in plan}
    ratio = {}
    for name, seconds in actual.items():
        if estimated.get(name):
            ratio.setdefault(kinds[name], []).append(seconds / estimated[name])
    left = [st for st in plan if st.name not in actual and estimated.get(st.name) is not None]
    if not any(v is not None for v in estimated.values()):
        return None
    return sum(estimated[st.name] * (sum(ratio[st.kind]) / len(ratio[st.kind]) if st.kind in ratio else 1.0)
               for st in left)
