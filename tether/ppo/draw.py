"""What a step trains on (SPEC B1, B4, B17, B18): prompts drawn from the stream (weighted by the curriculum when
on), K samples each, scored by the reward sources — and, with dynamic sampling (``--filter-groups``, DAPO's), the
groups with no spread in their scores replaced by more draws.

Dynamic sampling. A group whose scores, as the estimator sees them, are all equal (or that has fewer than 2 finite
ones) gives every group baseline advantage 0: its samples teach nothing. The scores judged are B4's — the raw
scores after the length and missing-EOS penalties, normalisation and clip, plus a dense channel's sum
(:func:`estimator_scores`) — not the raw ones: four right replies of different lengths have spread under a length
penalty, and raw 6..9 clipped to 5 have none. Such groups are dropped, and more prompts are drawn and
sampled, until this process holds ``--batch-size`` groups with spread or ``difficulty.max_rounds`` extra rounds have
run.

Rounds of ``--batch-size`` prompts (``difficulty.oversample`` 1, the default): the first round draws the batch's
prompts, and each extra round as many again, until the batch is full or the rounds run out. A multiple M > 1 makes
the first round M × ``--batch-size``.

One oversampled round (``difficulty.oversample`` 0; DAPO's generation batch larger than its train batch). Where
decoding is bound by reading the weights once per decode step (a GPU, or a CPU below ~8–16 rows), a round's cost is
set by its decode steps, not its rows: three rounds of G prompts cost about three times one round of 3G. Then the
first round draws enough prompts to fill the batch with groups that have spread, as the run knows its flat share —
an average of the recent steps' share of drawn groups with no spread (checkpointed with the prompt stream; the
curriculum's down-weighting of solved prompts shows in it) — and an extra round draws what is still missing, sized
the same way (:func:`prompts_to_draw`). The first step knows nothing and draws ``--batch-size``. Sized rounds draw
each prompt at most once a step: at most the prompts the step has not drawn, and no extra round once it has drawn
them all. It is not the default: on a 2-core CPU a decode step of 96 rows costs 3.6× one of 32 (compute, not the
weights' bytes, sets it there), and the sized round's margin draws more prompts than fixed rounds need, so the real
step's generation took 38 s against 21 s (docs/performance.md). Surplus groups with spread are dropped as the rule
says: the first ``--batch-size`` in draw order are kept.

Every process takes part in every round (generation is collective with a sharded policy, a
tensor-parallel engine or rollout processes), so the rounds end when *every* process is full: a process already
full samples the round too and keeps nothing of it. Each process fills its own share from its own prompts.

Reached the bound short, a step trains on the groups with spread it has (``filter/groups_short`` says how many are
missing). One process alone trains on those alone: no forward runs over a row that would weigh nothing, and the step
makes fewer minibatch updates of the usual size. With several processes every process's batch keeps its shape (the
same minibatches, so the same collectives, on every process): the missing groups are filled with flat ones whose
rows carry no weight in any loss (``kept`` False).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import torch

from tether.core.group import group_spread
from tether.ppo.perf import PhaseTimer
from tether.ppo.prompts import collate_fields
from tether.ppo.sources import RewardScores, postprocess_scores, score_rollout
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
    drawn_scores: torch.Tensor | None = None  # (R·B,) every round's rows' scores as the estimator sees them (B4)
    generated: tuple[torch.Tensor, torch.Tensor] | None = None  # (R·B,) ×2: every round's prompt, response tokens
    sampled_at: int = 0           # policy updates in the weights that sampled it (one step off: one behind)
    metrics: dict = field(default_factory=dict)


def draw_step_batch(run, cfg, timer: PhaseTimer, sample) -> StepBatch:
    """Draw, sample and score the step's batch (module docstring). ``sample()`` draws ``--batch-size`` prompts and
    returns their :class:`~tether.ppo.offpolicy.Batch` (:func:`tether.ppo.step.sample_batch`); an engine with its
    own weights has been synced already. Records one curriculum visit per prompt the step sampled."""
    run.data.prompts.begin_step()
    first = (first_round_size(cfg, run.data.prompts.flat_share, _undrawn(run, cfg, []))
             if cfg.difficulty.filter_groups else None)
    rounds = [_draw_round(run, cfg, timer, sample, first)]
    out, metrics = _filled(run, cfg, timer, sample, rounds) if cfg.difficulty.filter_groups else (rounds[0], {})
    record_visits(run, cfg, rounds)
    generated = (torch.cat([b.rollout.query_mask.sum(dim=1).cpu() for b in rounds]),
                 torch.cat([b.rollout.lengths.cpu() for b in rounds]))
    return replace(out, drawn_scores=torch.cat([b.drawn_scores for b in rounds]), generated=generated,
                   metrics=metrics, sampled_at=rounds[0].sampled_at)


def _filled(run, cfg, timer: PhaseTimer, sample, rounds: list[StepBatch]) -> tuple[StepBatch, dict]:
    """Dynamic sampling after the first round (``rounds``, appended to): the step's groups with spread, in draw
    order, and its ``filter/`` metrics."""
    k, groups, p = cfg.samples_per_prompt, cfg.batch_size, run.processes
    flat = _flat_groups(rounds[0].drawn_scores, k)
    batches, flats = [rounds[0]], [flat]
    have = int((~flat).sum())
    extra, extra_seconds = 0, 0.0
    while p.global_min(torch.tensor(float(have))) < groups and extra < cfg.difficulty.max_rounds:
        if not cfg.difficulty.oversample and _undrawn(run, cfg, rounds) <= 0:
            break  # a sized step has drawn every prompt once: it trains on what it has
        extra += 1
        before = sum(timer.seconds.values())
        drawn_flat = p.global_sum(torch.tensor(float(sum(int(f.sum()) for f in flats))))
        drawn_groups = p.global_sum(torch.tensor(float(sum(len(f) for f in flats))))
        missing = int(p.global_max(torch.tensor(float(max(groups - have, 0)))))  # every process draws alike
        size = extra_round_size(cfg, missing, drawn_flat / drawn_groups, _undrawn(run, cfg, rounds))
        batch = _draw_round(run, cfg, timer, sample, size)
        extra_seconds += sum(timer.seconds.values()) - before
        rounds.append(batch)
        if have < groups:  # a full process samples the round too (collective) and keeps nothing of it
            flat = _flat_groups(batch.drawn_scores, k)
            batches.append(batch)
            flats.append(flat)
            have += int((~flat).sum())
    # the first `groups` groups with spread in draw order; flat filler only where several processes must keep
    # one shape (alone with no group with spread the flat groups stay: ppo_step then runs no forward at all)
    spread = [(b, g) for b, f in zip(batches, flats) for g in range(len(f)) if not f[g]][:groups]
    short = groups - len(spread)
    n_filler = short if p.world_size > 1 or not spread else 0
    filler = [(b, g) for b, f in zip(batches, flats) for g in range(len(f)) if f[g]][:n_filler]
    out = _select_groups(batches, spread + filler, k, run.models.tokenizer.pad_token_id)
    kept = torch.ones(len(out.responses), dtype=torch.bool)
    kept[len(spread) * k:] = False
    all_flats = torch.cat([_flat_groups(b.drawn_scores, k) for b in rounds])
    step_flat = p.global_sum(all_flats.sum().float()) / p.global_sum(torch.tensor(float(len(all_flats))))
    stream = run.data.prompts
    stream.flat_share = step_flat if stream.flat_share is None else 0.5 * stream.flat_share + 0.5 * step_flat
    metrics = {"filter/prompts_drawn": p.global_sum(torch.tensor(float(len(all_flats)))),
               "filter/flat_share": step_flat, "filter/first_round_prompts": float(len(rounds[0].rows) // k),
               "filter/groups_kept": p.global_sum(torch.tensor(float(len(spread)))),
               "filter/groups_short": p.global_sum(torch.tensor(float(short))),
               "filter/rounds": float(extra), "perf/seconds_filter": p.global_max(torch.tensor(extra_seconds))}
    if short:
        metrics["health/notes"] = [f"--filter-groups: {short} of {groups} groups with spread missing after "
                                   f"{extra} extra rounds (difficulty.max_rounds); trained on the "
                                   f"{groups - short} it has"]
    return replace(out, kept=kept), metrics


def _undrawn(run, cfg, rounds: list[StepBatch]) -> int:
    """Prompts per process the step has not drawn yet (every process draws as many a round)."""
    drawn = sum(len(b.rows) for b in rounds) // cfg.samples_per_prompt
    return (len(run.data.prompts.rows) // run.processes.world_size) - drawn


def first_round_size(cfg, flat_share: float | None, undrawn: int) -> int:
    """Prompts per process of a step's first round under ``--filter-groups`` (module docstring): sized rounds draw
    at most the ``undrawn`` prompts (a step's prompts stay distinct), and never fewer than ``--batch-size``."""
    groups = cfg.batch_size
    cap = max(groups, min(groups * (cfg.difficulty.max_rounds + 1), undrawn))
    if cfg.difficulty.oversample:
        return min(math.ceil(groups * cfg.difficulty.oversample), cap)
    if flat_share is None:
        return groups
    return prompts_to_draw(groups, flat_share, cap)


def extra_round_size(cfg, missing: int, flat_share: float, undrawn: int) -> int:
    """Prompts per process of an extra round, short of ``missing`` groups with spread: sized from this step's flat
    share so far, at least ``--batch-size`` (a round's decode steps cost the same for fewer rows) unless fewer
    prompts are left undrawn in the step."""
    groups = cfg.batch_size
    if cfg.difficulty.oversample:
        return groups
    cap = min(groups * (cfg.difficulty.max_rounds + 1), undrawn)
    return min(max(groups, prompts_to_draw(missing, flat_share, cap)), cap)


def prompts_to_draw(needed: int, flat_share: float, cap: int, z: float = 1.5) -> int:
    """The fewest prompts n whose groups with spread reach ``needed`` with some margin, each group flat with
    probability f = ``flat_share`` independently: the smallest n with

        n (1 - f) - z sqrt(n f (1 - f)) >= needed,

    (the binomial count's mean less z standard deviations; z = 1.5: short about one time in fifteen), at least
    ``needed``, at most ``cap``. f is held to at most 0.95, where a round would need 20 prompts a group."""
    f = min(max(float(flat_share), 0.0), 0.95)
    n = max(needed, 1)
    while n < cap and n * (1 - f) - z * math.sqrt(n * f * (1 - f)) < needed:
        n += 1
    return min(n, cap)


def _draw_round(run, cfg, timer: PhaseTimer, sample, n: int | None = None) -> StepBatch:
    """One draw of ``n`` prompts (default ``--batch-size``): K samples each, scored, and judged as the estimator
    sees the scores."""
    m, d = run.models, run.data
    sampled = sample() if n in (None, cfg.batch_size) else sample(n)
    rows, rollout, responses = sampled.rows, sampled.rollout, sampled.responses
    with timer("reward"):  # the reward sources (B4, A9): sequence scores and a process RM's dense step rewards
        rewards_raw = score_rollout(d.sources, [r["prompt"] for r in rows], responses, collate_fields(rows),
                                    rollout, m.tokenizer)
    if cfg.reward.shuffle:
        rewards_raw = shuffled(rewards_raw)
    return StepBatch(rows=rows, rollout=rollout, responses=responses, rewards_raw=rewards_raw,
                     kept=torch.ones(len(rows), dtype=torch.bool), sampled_at=sampled.sampled_at,
                     drawn_scores=estimator_scores(run, cfg, rollout, rewards_raw))


def estimator_scores(run, cfg, rollout: Rollout, raw: RewardScores) -> torch.Tensor:
    """(B,) the scores a group baseline would see for these rows (B4, B17): the sequence channel after the length,
    missing-EOS and soft overlong penalties, normalisation and clip
    (:func:`~tether.ppo.sources.postprocess_scores` over this draw's finite rows of all processes), plus the dense
    channel's sum; NaN where the raw scores are not finite (B16). Running normalisation reads a copy of the running moments: judging moves nothing, and the step's own
    scoring updates them once, as without dynamic sampling. Collective (every process judges every round)."""
    p = run.processes
    finite = torch.isfinite(raw.total)
    on = p.device
    sequence = postprocess_scores(raw.sequence.to(on), rollout.lengths.to(on), rollout.ended_with_eos.to(on),
                                  cfg.reward, copy.deepcopy(run.data.running_scores), finite.to(on),
                                  gather=p.all_gather, max_new_tokens=cfg.generation.max_new_tokens).cpu()
    return torch.where(finite, sequence + raw.dense.sum(dim=1), torch.nan)


def record_visits(run, cfg, rounds: list[StepBatch]) -> None:
    """The curriculum's visits of this step (B18), gathered from every process (one table on each): every prompt
    sampled in any round, with its pass rate; a prompt drawn twice in the step makes one visit
    (:meth:`~tether.ppo.curriculum.Curriculum.record`)."""
    d, k, p = run.data, cfg.samples_per_prompt, run.processes
    curriculum = d.prompts.curriculum
    if curriculum is None:
        return
    index = {id(row): i for i, row in enumerate(d.prompts.rows)}  # the stream's rows themselves, by identity
    indices = [index[id(row)] for b in rounds for row in b.rows[::k]]
    rates = torch.cat([curriculum.pass_rates(b.rewards_raw.total, k) for b in rounds])
    if p.world_size > 1:  # every process drew as many rounds of as many prompts: equal shapes
        indices = p.all_gather(torch.tensor(indices, dtype=torch.long, device=p.device)).cpu().tolist()
        rates = p.all_gather(rates.to(p.device)).cpu()
    curriculum.record(indices, rates.tolist())


def shuffled(scores: RewardScores) -> RewardScores:
    """The control arm's reward (``reward.shuffle``): the sequence scores (and which row a rule failed on) permuted
    across the rows with the process's torch RNG (checkpointed: a resumed run permutes alike). The dense channel (a
    per-step PRM's rewards on the tokens that end steps) stays with its tokens."""
    order = torch.randperm(len(scores.sequence))
    where = {int(new): old for new, old in enumerate(order.tolist())}  # row new takes row old's score
    errors = {new: scores.errors[old] for new, old in where.items() if old in scores.errors}
    return RewardScores(sequence=scores.sequence[order], dense=scores.dense, errors=errors)


def _flat_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(G,) bool: groups with no spread among their finite ``scores`` (B,), as :func:`tether.core.group.tied`
    judges it for the estimators, or with fewer than 2 finite scores (no signal either way)."""
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
