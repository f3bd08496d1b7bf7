"""Where a PPO step's time went (C2), read from ``metrics.jsonl``: mean seconds per phase, the rollout share, and
the rollout layout the phases were measured in (C4). Shown by ``tether doctor`` and ``tether report``."""

from __future__ import annotations

import math


def config_value(run_config: dict, key: str):
    """The value at dotted ``key`` (e.g. ``kl.coef``) of a nested config dict, None when absent."""
    node = run_config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# (phase, metric key) in step order (C2); "score" is the sum of old log-probs … reward, for runs made
# before the scoring phase was split.
PHASES = [("generate", "perf/seconds_generate"), ("weight sync", "perf/seconds_weight_sync"),
          ("old log-probs", "perf/seconds_logprobs_old"), ("reference", "perf/seconds_reference"),
          ("values", "perf/seconds_values"), ("reward", "perf/seconds_reward"), ("train", "perf/seconds_train")]
SCORE_SPLIT = ("perf/seconds_logprobs_old", "perf/seconds_reference", "perf/seconds_values", "perf/seconds_reward")


def phase_seconds(rows: list[dict]) -> dict:
    """Mean seconds per step of each phase in :data:`PHASES` that the rows carry, in step order; runs from
    before the split of scoring give one "score" phase instead of its parts. Empty without timings."""
    def mean(key):
        xs = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(xs) / len(xs) if xs else None

    split = any(mean(key) is not None for key in SCORE_SPLIT)
    phases = [(n, k) for n, k in PHASES if split or k not in SCORE_SPLIT]
    if not split:
        phases.insert(2, ("score", "perf/seconds_score"))
    return {name: m for name, key in phases if (m := mean(key)) is not None}


def rollout_layout(run_config: dict) -> str:
    """Where the run's rollouts were sampled (C4), from its config.yaml; "" for a run saved before the keys."""
    engine, tp = config_value(run_config, "generation.engine"), config_value(run_config, "generation.engine_tp") or 1
    if engine is None:
        return ""
    rollouts = config_value(run_config, "generation.rollout_processes") or 0
    if rollouts:
        return f"disaggregated, {rollouts} rollout process{'es' if rollouts > 1 else ''} ({engine})"
    return f"colocated, {engine}" + (f" TP={tp}" if tp > 1 else "")


def format_phases(phases: dict, layout: str = "") -> str:
    """One line: mean seconds per phase, each one's share of the step, and the rollout share (C2) of the layout
    (disaggregated: "generate" is the trainers' wait for the rollout processes)."""
    total = sum(phases.values())
    if not total:
        return ""
    parts = ", ".join(f"{name} {s:.3g} s ({100 * s / total:.0f}%)" for name, s in phases.items())
    share = 100 * phases.get("generate", 0.0) / total
    where = f"{layout}; " if layout else ""
    return (f"time per step: {total:.3g} s = {parts}; rollout share {share:.0f}% ({where}healthy <= 40% with a fast "
            "engine)")
