"""The expected time of ``tether rlhf`` on this machine, printed before it starts.

How it is estimated (``--estimate``, the default): a calibration runs, on the starting policy, what the stages run —

- generation: the pairs stage's own sampler (its engine, dtype, chat template and system prompt) draws one call of a
  PPO step's rows (after one untimed warm-up call) and one call of a pairs batch;
- an update: one forward + backward of the policy as the stages train it (LoRA when ``--lora-r``) on those PPO rows,
  packed (the prompt once, the replies after it) with the head on the reply tokens only — its seconds per token
  price every stage's training by the tokens it computes.

Each stage is then priced (P = prompt tokens, R = the calibration's mean reply tokens, all counts from the config):

- pairs: ⌈problems × ``--pair-samples`` / pairs batch⌉ pair-batch calls;
- reward model: pairs × epochs × (P + 2R) tokens of updates (a pair packed: its prompt once), and one forward
  (a third of an update) over every pair's two texts for its scale and verdict; the pairs assumed to be half the
  problems at their cap;
- PPO arm: steps × (a generate call + the update's tokens twice: the old, reference and reward-model forwards are
  about one update) plus its evaluations (held-out problems / rows calls each);
- DPO: two texts a pair, unpacked, one epoch per ``dpo`` epoch, and the reference's forward; SFT: its updates.

A guide (reply lengths change as the policy learns, the machine may be shared): each finished stage re-prices the
later stages of its kind by what it took (:func:`repriced_remaining`). Stages already complete are skipped and cost
nothing. ``--estimate false`` skips the calibration and prints the stages alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Units:
    """What the calibration measured: seconds of one generate call of ``rows`` replies and of one of ``pair_rows``;
    seconds of an update per token; the prompt's tokens and the replies' mean tokens."""

    t_gen: float
    t_gen_pairs: float
    t_token: float
    rows: int
    pair_rows: int
    prompt_tokens: int
    reply_tokens: float

    def describe(self) -> str:
        return (f"one generate call of {self.rows} replies {self.t_gen:.2f} s and of {self.pair_rows} "
                f"{self.t_gen_pairs:.2f} s, an update {1000 * self.t_token:.2f} ms a token; prompt "
                f"{self.prompt_tokens} tokens, replies {self.reply_tokens:.0f}")


def calibrate(cfg, out) -> Units:
    """Time the stages' own generation and a packed update on the starting policy (the module docstring)."""
    from tether.hf import DTYPES, quiet_transformers
    from tether.pipeline.stages import sample_config, task_prompt
    from tether.precision import Precision
    from tether.rollout.engines import make_engine
    from tether.sft.evaluate import Prompting, generate_responses
    from tether.sft.sample import load_policy_for_sampling

    c = sample_config(cfg, out / "task", cfg.model.policy, out / "calibration", cfg.seed)
    prompt = task_prompt(cfg)
    rows, pair_rows = cfg.ppo.batch_size * cfg.ppo.samples_per_prompt, c.batch_size * c.samples_per_prompt
    with quiet_transformers():
        model, tokenizer, use_chat = load_policy_for_sampling(c)
        engine = make_engine(c, model, tokenizer)
        prompting = Prompting(use_chat, c.data.system_prompt, c.data.prompt_template, c.data.max_prompt_length)
        device = next(model.parameters()).device
        precision = Precision(DTYPES[c.model.dtype], device.type)

        def generate(n: int):
            t0 = time.perf_counter()
            rollout, _ = generate_responses(engine, tokenizer, [prompt] * n, prompting, cfg.task.max_new_tokens, device,
                                            cfg.task.temperature, precision=precision)
            return rollout, time.perf_counter() - t0

        try:
            generate(rows)  # the engine's first call warms it up
            rollout, t_gen = generate(rows)
            _, t_gen_pairs = generate(pair_rows)
        finally:
            engine.close()
        del model
        t_token = update_seconds_per_token(cfg, rollout)
    prompt_tokens = int(rollout.query_mask[0].sum())
    reply_tokens = float(rollout.response_mask.sum()) / rows
    return Units(t_gen, t_gen_pairs, t_token, rows, pair_rows, prompt_tokens, max(reply_tokens, 1.0))


def update_seconds_per_token(cfg, rollout) -> float:
    """Seconds a token of one forward + backward of the policy in the stages' dtype (LoRA adapters when
    ``--lora-r``) on the rollout packed — the prompt once, each reply after it — with log-probs of the reply tokens
    only, as PPO's packed update computes them."""
    from tether.core.packing import pack_units
    from tether.hf import apply_lora, block_mask_for, load_causal_lm, transformers_model
    from tether.presets import resolve_model_path

    model = load_causal_lm(resolve_model_path(cfg.model.policy, what="policy"), cfg.model.dtype, False)
    if cfg.model.lora_r:  # as the stages wrap it: every linear layer, the adapter in fp32
        model = apply_lora(model, cfg.model.lora_r, float(cfg.model.lora_alpha), 0.0, "all-linear")
    model.train()
    prompt = rollout.query[0][rollout.query_mask[0].bool()]
    replies = [row[mask.bool()] for row, mask in zip(rollout.response, rollout.response_mask)]
    replies = [r if len(r) else prompt[-1:] for r in replies]
    packed = pack_units([prompt], [replies], pad_id=0)
    mask = block_mask_for(model, packed.attention_mask)
    index = torch.cat(packed.suffix_index[0])
    targets = packed.input_ids.reshape(-1)[index]

    def update() -> float:
        t0 = time.perf_counter()
        hidden = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                       output_hidden_states=True, use_cache=False).hidden_states[-1]
        logits = transformers_model(model).get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[index])
        torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).mean().backward()
        return time.perf_counter() - t0

    update()  # the first pass pays for allocations and lazy set-up, as a stage's first step does once
    return update() / packed.tokens


def training_problems(cfg) -> int:
    """The training problems the task stage will write: an rg: task's split holds fewer than ``--task-train`` when
    its problem space is small (two one-digit terms: 100 of the 2000 asked for)."""
    if cfg.task.prompts.startswith("rg:"):
        from tether.tasks import split_rows

        return len(split_rows(cfg.task.prompts, cfg.task.task_train, cfg.ppo.eval_n, cfg.task.task_seed)[0])
    with open(cfg.task.prompts, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


def held_out_problems(cfg) -> int:
    """The held-out problems every evaluation generates for (an rg: task's split may hold fewer than ``--eval-n``)."""
    if cfg.task.prompts.startswith("rg:"):
        from tether.tasks import split_rows

        return len(split_rows(cfg.task.prompts, cfg.task.task_train, cfg.ppo.eval_n, cfg.task.task_seed)[1])
    return cfg.ppo.eval_n


def stage_seconds(cfg, kind: str, u: Units, steps: int = 0) -> float | None:
    """A stage's expected seconds from the calibrated units (the module docstring's prices); ``steps``: a PPO
    arm's own (0 = ``ppo.steps``)."""
    problems = cfg.pairs.prompts or training_problems(cfg)
    pairs = problems * 0.5 * (cfg.pairs.max_per_prompt or cfg.pairs.samples_per_prompt)
    if cfg.pairs.max_pairs:
        pairs = min(pairs, cfg.pairs.max_pairs)
    P, R = u.prompt_tokens, u.reply_tokens
    evaluation = math.ceil(held_out_problems(cfg) / u.rows) * u.t_gen
    if kind == "pairs":
        return math.ceil(problems * cfg.pairs.samples_per_prompt / u.pair_rows) * u.t_gen_pairs
    if kind == "rm":
        return pairs * u.t_token * (cfg.rm.epochs * (P + 2 * R) + 2 * (P + R) / 3)
    if kind == "ppo":
        steps = steps or cfg.ppo.steps
        update = cfg.ppo.batch_size * (P + cfg.ppo.samples_per_prompt * R) * u.t_token
        return steps * (u.t_gen + 2 * update) + (1 + steps // cfg.ppo.eval_every) * evaluation
    if kind == "dpo":
        return pairs * 2 * (P + R) * u.t_token * (1 + 1 / 3) + evaluation
    if kind == "sft" and cfg.sft.steps:
        return cfg.sft.steps * u.rows * (P + R) * u.t_token
    return 0.0 if kind == "task" else None


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "not estimated"
    return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"


def estimate_stages(cfg, out, plan: list, done: set[str]) -> tuple[dict, Units | None]:
    """``({stage name: expected seconds or None}, units)`` for the stages not done (calibrated in ``out``); units None
    (and no figures) without ``--estimate``."""
    units = None
    if cfg.estimate and any(st.name not in done for st in plan):
        units = calibrate(cfg, out)
    return {st.name: stage_seconds(cfg, st.kind, units, st.arm[4] if st.arm else 0) if units else None
            for st in plan if st.name not in done}, units


def estimate_lines(cfg, plan: list, done: set[str], estimated: dict, units: Units | None) -> list[str]:
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
        more = f" + {unknown} stage(s) not estimated" if unknown else ""
        lines.append(f"expected time on this machine: {fmt(total)}{more} (calibrated now: {units.describe()}; "
                     "stages priced in those units, docs/commands.md: a guide, re-priced as stages finish)")
    return lines


def repriced_remaining(plan: list, estimated: dict, actual: dict) -> float | None:
    """Seconds the stages not yet run should take, each kind's estimate scaled by what that kind's completed stages
    took against their estimates (a stage's reply lengths drift as the policy learns, and the machine's load is not
    the calibration's: the first stage of a kind prices the rest of it). None without estimates."""
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
