"""What a step trains on (SPEC B1, B4, B17, B18): prompts drawn from the stream (weighted by the curriculum when
on), K samples each, scored by the reward sources — and, with dynamic sampling (``--filter-groups``, DAPO's), the
groups with no spread in their scores replaced by more draws.

Dynamic sampling. A group whose kept (finite) scores are all equal, or that has fewer than 2 of them, gives every
group baseline advantage 0: its samples teach nothing. Such groups are dropped, and another ``--batch-size``
prompts are drawn and sampled, until this process holds ``--batch-size`` groups with spread or
``difficulty.max_rounds`` extra rounds have run. Every process takes part in every round (generation is collective
with a sharded policy, a tensor-parallel engine or rollout processes), so the rounds end when *every* process is
full: a process already full samples the round too and keeps nothing of it. Each process fills its own share from
its own prompts. Reached the bound short, a step trains on the groups with spread it has; its batch keeps its shape
(the same minibatches on every process), the missing groups filled with flat ones whose rows carry no weight in
any loss (``kept`` False), and ``filter/groups_short`` says how many.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tether.core.group import group_spread
from tether.ppo.perf import PhaseTimer
from tether.ppo.prompts import collate_fields
from tether.ppo.sources import RewardScores, score_rollout
from tether.rollout.records import Rollout


@dataclass
class StepBatch:
    """The step's rows, B = G·K (the K samples of a prompt adjacent), with what generation and the reward sources
    made of them."""

    rows: list[dict]              # B prompt rows, each repeated K times
    rollout: Rollout
    responses: list[str]          # B decoded responses (valid tokens, special tokens skipped)
    rewards_raw: RewardScores
    kept: torch.Tensor            # (B,) bool: False for a filler row of a flat group (no weight in any loss)
    drawn_scores: torch.Tensor | None = None  # (R·B,) the raw scores of every round's rows, the groups as drawn
    sampled_at: int = 0           # policy updates in the weights that sampled it (one step off: one behind)
    metrics: dict = field(default_factory=dict)


def draw_step_batch(run, cfg, timer: PhaseTimer, sample) -> StepBatch:
    """Draw, sample and score the step's batch (module docstring). ``sample()`` draws ``--batch-size`` prompts and
    returns their :class:`~tether.ppo.offpolicy.Batch` (:func:`tether.ppo.step.sample_batch`); an engine with its
    own weights has been synced already. Records every visited prompt's pass rate in the curriculum."""
    k = cfg.samples_per_prompt
    first = _draw_round(run, cfg, timer, sample)
    if not cfg.difficulty.filter_groups:
        return replace(first, drawn_scores=first.rewards_raw.total)
    groups = cfg.batch_size
    flat = _flat_groups(first, k)
    batches, flats, drawn = [first], [flat], [first.rewards_raw.total]
    have = int((~flat).sum())
    rounds, extra_seconds = 0, 0.0
    p = run.processes
    while p.global_min(torch.tensor(float(have))) < groups and rounds < cfg.difficulty.max_rounds:
        rounds += 1
        before = sum(timer.seconds.values())
        batch = _draw_round(run, cfg, timer, sample)
        extra_seconds += sum(timer.seconds.values()) - before
        flat = _flat_groups(batch, k)
        drawn.append(batch.rewards_raw.total)
        if have < groups:
            batches.append(batch)
            flats.append(flat)
            have += int((~flat).sum())
    drawn_groups = groups * (rounds + 1)
    # the first `groups` groups with spread in draw order, then flat ones to fill a short batch
    spread = [(b, g) for b, f in zip(batches, flats) for g in range(len(f)) if not f[g]][:groups]
    short = groups - len(spread)
    filler = [(b, g) for b, f in zip(batches, flats) for g in range(len(f)) if f[g]][:short]
    out = _select_groups(batches, spread + filler, k, run.models.tokenizer.pad_token_id)
    kept = torch.ones(len(out.responses), dtype=torch.bool)
    kept[len(spread) * k:] = False
    metrics = {"filter/prompts_drawn": p.global_sum(torch.tensor(float(drawn_groups))),
               "filter/groups_kept": p.global_sum(torch.tensor(float(len(spread)))),
               "filter/groups_short": p.global_sum(torch.tensor(float(short))),
               "filter/rounds": float(rounds), "perf/seconds_filter": p.global_max(torch.tensor(extra_seconds))}
    if short:
        metrics["health/notes"] = [f"--filter-groups: {short} of {groups} groups with spread missing after "
                                   f"{rounds} extra rounds (difficulty.max_rounds); trained on the "
                                   f"{groups - short} it has"]
    return replace(out, kept=kept, drawn_scores=torch.cat(drawn), metrics=metrics, sampled_at=first.sampled_at)


def _draw_round(run, cfg, timer: PhaseTimer, sample) -> StepBatch:
    """One draw of ``--batch-size`` prompts: K samples each, scored; their pass rates go to the curriculum."""
    m, d, k = run.models, run.data, cfg.samples_per_prompt
    sampled = sample()
    rows, rollout, responses = sampled.rows, sampled.rollout, sampled.responses
    with timer("reward"):  # the reward sources (B4, A9): sequence scores and a process RM's dense step rewards
        rewards_raw = score_rollout(d.sources, [r["prompt"] for r in rows], responses, collate_fields(rows),
                                    rollout, m.tokenizer)
    if cfg.reward.shuffle:
        rewards_raw = shuffled(rewards_raw)
    curriculum = d.prompts.curriculum
    if curriculum is not None:
        index = {id(row): i for i, row in enumerate(d.prompts.rows)}  # the stream's rows themselves, by identity
        indices = [index[id(row)] for row in rows[::k]]
        rates = curriculum.pass_rates(rewards_raw.total, k)
        p = run.processes
        if p.world_size > 1:  # one table on every process: everyone's visits
            indices = p.all_gather(torch.tensor(indices, dtype=torch.long, device=p.device)).cpu().tolist()
            rates = p.all_gather(rates.to(p.device)).cpu()
        curriculum.record(indices, rates.tolist())
    return StepBatch(rows=rows, rollout=rollout, responses=responses, rewards_raw=rewards_raw,
                     kept=torch.ones(len(rows), dtype=torch.bool), sampled_at=sampled.sampled_at)


def shuffled(scores: RewardScores) -> RewardScores:
    """The control arm's reward (``reward.shuffle``): the sequence scores (and which row a rule failed on) permuted
    across the rows with the process's torch RNG (checkpointed: a resumed run permutes alike). The dense channel (a
    per-step PRM's rewards on the tokens that end steps) stays with its tokens."""
    order = torch.randperm(len(scores.sequence))
    where = {int(new): old for new, old in enumerate(order.tolist())}  # row new takes row old's score
    errors = {new: scores.errors[old] for new, old in where.items() if old in scores.errors}
    return RewardScores(sequence=scores.sequence[order], dense=scores.dense, errors=errors)


def _flat_groups(batch: StepBatch, k: int) -> torch.Tensor:
    """(G,) bool: groups with no spread among their finite scores, or fewer than 2 of them (no signal either way)."""
    scores = batch.rewards_raw.total
    finite = torch.isfinite(scores)
    spread = group_spread(torch.where(finite, scores, 0.0), k, finite)
    return spread["no_spread"] | ~spread["counted"]


def _select_groups(batches: list[StepBatch], picks: list[tuple[StepBatch, int]], k: int, pad_id: int) -> StepBatch:
    """The groups ``picks`` ((batch, group index) pairs, in order) as one batch: rows, texts, scores (row numbers of
    rule errors renumbered) and a rollout padded to the widest prompt (left) and response (right)."""
    rows, responses, rollouts, sequence, dense, errors = [], [], [], [], [], {}
    width = max(b.rollout.response.shape[1] for b in batches)
    for batch, g in picks:
        rows_g = list(range(g * k, (g + 1) * k))
        for r in rows_g:
            if r in batch.rewards_raw.errors:
                errors[len(rows) + r - g * k] = batch.rewards_raw.errors[r]
        rows += [batch.rows[r] for r in rows_g]
        responses += [batch.responses[r] for r in rows_g]
        rollouts.append(batch.rollout.select(torch.arange(g * k, (g + 1) * k, device=batch.rollout.query.device)))
        sequence.append(batch.rewards_raw.sequence[g * k:(g + 1) * k])
        d = batch.rewards_raw.dense[g * k:(g + 1) * k]
        dense.append(torch.nn.functional.pad(d, (0, width - d.shape[1])))
    rollout = Rollout.concat(rollouts, pad_id)
    return StepBatch(rows=rows, rollout=rollout, responses=responses,
                     rewards_raw=RewardScores(sequence=torch.cat(sequence),
                                              dense=torch.cat(dense)[:, :rollout.response.shape[1]], errors=errors),
                     kept=torch.ones(len(rows), dtype=torch.bool))
