"""Stage B: PPO against a reward, tethered to a frozen reference by a per-token KL penalty.

:func:`ppo_step` is the algorithm, top to bottom in data-flow order (reference 000 §B.3):

  1. rollout: K samples per prompt, scored (B1,     6. advantages: GAE with the truncation bootstrap (B7), or
     B4, B17); flat groups redrawn (B18)               a critic-free estimator on the groups of K (B17)
  2. old log-probs, training-side forward (B2)      7. whiten GAE's advantages (B8); the off-policy correction's
  3. reference log-probs (B3)                          weights (B19); freeze: the Experience
  4. values V_old(s_t) and V_old(s_T) (a critic)    8. ppo_epochs × shuffled minibatches of groups (B9, B6)
  5. scores → per-token rewards (B5)                9. early stop on approx KL to π_old (B10)
                                                    10. KL controller (B11)

It reads a :class:`~tether.ppo.setup.Run` (processes, models, optimisation, data) and makes the two
records: the :class:`~tether.ppo.draw.StepBatch` (step 1: the rollout and its raw scores) and the :class:`Experience` (end of
step 7), which the epoch loop (:mod:`tether.ppo.update`) only reads; the metrics are
:mod:`tether.ppo.metrics`'. The run loop around it is :mod:`tether.ppo.train`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tether.core.advantages import gae, shaped_rewards, whiten
from tether.core.group import critic_free_advantages
from tether.core.kl import kl_penalty
from tether.ppo.draw import draw_step_batch
from tether.ppo.forward import critic_values, forward_response
from tether.ppo.metrics import (
    global_masked_mean,
    group_metrics,
    objective_metrics,
    overlong_metrics,
    perf_metrics,
    response_metrics,
    sampler_gap_metrics,
    throughput_metrics,
    truncation_mask_metrics,
    value_metrics,
)
from tether.ppo.noop import advantage_metrics, after_update, before_update
from tether.ppo.offpolicy import Batch, correction_metrics, step_correction_weights
from tether.ppo.perf import PhaseTimer
from tether.ppo.records import Experience
from tether.ppo.skips import TrainingForwardLog, training_logprobs
from tether.ppo.sources import RewardScores, postprocess_scores
from tether.ppo.update import ppo_epochs
from tether.rollout.records import Rollout
from tether.rollout.sampling import encode_prompts


def rollout_batch(models, cfg, rows: list[dict], greedy: bool = False) -> tuple[Rollout, list[str]]:
    """Encode prompts, sample responses with the run's rollout engine, decode the valid response tokens.
    ``models``: :class:`~tether.ppo.setup.Models`. Collective when the engine is (FSDP2's gathered policy, a
    tensor-parallel or remote engine: every process calls this). Sampling runs in the precision the log-probs are
    scored in (B1, C5)."""
    query, query_mask = encode_prompts(models.tokenizer, [r["prompt"] for r in rows], cfg.data.max_prompt_length,
                                       models.use_chat_template, cfg.data.system_prompt, cfg.data.prompt_template)
    g = cfg.generation
    device = models.unwrapped_policy.device
    with models.precision.autocast():
        rollout = models.engine.generate(query.to(device), query_mask.to(device), g.max_new_tokens, g.temperature,
                                         greedy=greedy, min_new_tokens=0 if greedy else g.min_new_tokens)
    texts = models.tokenizer.batch_decode([row[m.bool()] for row, m in zip(rollout.response, rollout.response_mask)],
                                          skip_special_tokens=True)
    return rollout, texts


@torch.no_grad()
def ppo_step(run, cfg, step: int) -> dict:
    """One PPO step on ``run`` (:class:`~tether.ppo.setup.Run`). Returns the metrics."""
    p, m, o, d = run.processes, run.models, run.optim, run.data
    timer = PhaseTimer()

    # 1. Rollout (B1) and the reward sources' scores (B4, A9; sequence and dense channels apart): sampled now — an
    # engine holding its own weights takes the current ones first (C3; here, so a resumed run is covered too) — or
    # received from the rollout processes one step ahead (C7). The prompts come from the stream (weighted by the
    # curriculum, B18); with --filter-groups, groups whose scores have no spread are replaced by more draws (B18):
    # alone with none to train on, nothing more is computed.
    if m.engine.syncs_weights and d.ahead is None:
        with timer("weight_sync"):
            m.engine.sync_weights(m.unwrapped_policy)
        run.versions.synced()
    batch = draw_step_batch(run, cfg, timer, lambda n=None: sample_batch(run, cfg, step, timer, n))
    if p.world_size == 1 and not bool(batch.kept.any()):
        return nothing_to_train(run, cfg, step, timer, batch)
    rollout, rewards_raw, response_mask = batch.rollout, batch.rewards_raw, batch.rollout.response_mask.float()

    with timer("score"):  # charged to its parts, SCORE_PHASES (C2)
        # Steps 2-4: old and reference log-probs, values (those a known result makes unneeded left out: skips.py)
        logprobs_old, entropy, logprobs_ref, values_old, last_values = scoring_forwards(run, cfg, rollout, timer)
        # 5b. B16: a row with a non-finite score, log-prob, value or bootstrap value leaves this step's update, and so
        # does a filler row of a flat group (--filter-groups short of groups with spread).
        finite, notes = finite_rows(rewards_raw, (logprobs_old, logprobs_ref, values_old), last_values,
                                    response_mask)
        valid = finite & batch.kept.to(finite.device)
        (response_mask, logprobs_old, logprobs_ref, entropy, values_old, last_values, sequence_raw,
         step_rewards) = zero_rows(valid, response_mask, logprobs_old, logprobs_ref, entropy, values_old,
                                   last_values, rewards_raw.sequence.to(p.device), rewards_raw.dense.to(p.device))
        # 5c. B4's penalties (length, missing EOS, overlong), normalisation, clip (over all processes' kept rows).
        sequence_scores = postprocess_scores(sequence_raw, rollout.lengths, rollout.ended_with_eos, cfg.reward,
                                             d.running_scores, valid, gather=p.all_gather,
                                             max_new_tokens=cfg.generation.max_new_tokens)
        # 5d. Per-token rewards (B5): −β·KL_t on every token (β = 0 here when the KL is a loss term instead,
        # kl.penalty_in), the sequence score on the last one, each step reward on the token that ends its step.
        kl = token_kl(cfg, logprobs_old, logprobs_ref, response_mask)  # (B, T); None: a side not computed (yet)
        beta_reward = o.kl_controller.value if cfg.kl.penalty_in == "reward" else 0.0
        kl_in_reward = torch.zeros_like(response_mask) if kl is None else kl  # None only where β_reward = 0 (skips)
        rewards = (shaped_rewards(sequence_scores, kl_in_reward, beta_reward, response_mask)
                   + step_rewards * response_mask)
        scores = sequence_scores + step_rewards.sum(dim=1)  # what each response earned in all (objective/scores)
        # 6.–7. Advantages (B7, B8, B17): GAE on the critic's values, whitened; or, without a critic, a group
        # (or batch) baseline on the scores (cfg.advantage). Then everything is frozen.
        advantages, returns = estimate_advantages(cfg, p.world_size > 1, rewards, values_old, last_values, scores,
                                                  kl_in_reward, beta_reward, response_mask, valid)
        timer.split("reward")  # steps 5-7: reward sources, per-token rewards, advantages, whitening
    # The training forwards never see a dropped row's input (its NaN would recur: 0·NaN = NaN in the masked
    # losses and their gradients): it is replaced by a kept row, with no weight in any loss.
    experience = Experience(rollout=stand_in_rows(rollout, valid), logprobs_old=logprobs_old,
                            logprobs_ref=logprobs_ref, values_old=values_old, last_values=last_values,
                            scores=scores, kl=kl_in_reward, rewards=rewards, advantages=advantages, returns=returns,
                            valid=valid, is_weights=step_correction_weights(cfg, rollout, logprobs_old,
                                                                            response_mask),  # B19
                            loss_rows=rollout.ended_with_eos.to(valid.device) if cfg.ppo.mask_truncated else None,
                            from_forward=TrainingForwardLog(torch.arange(len(valid), device=valid.device))
                            if m.skips.old_logprobs else None)

    # 8.–9. Epochs of shuffled minibatch updates, with the KL early stop (B9, B10).
    any_kept = bool(p.global_sum(valid.sum()) > 0)
    any_trained, notes = trained_rows_left(p, experience, any_kept, notes)
    trained = before_update(run, cfg, step)  # the engine's weight version; the snapshot for ppo/param_update_norm
    with timer("train"), torch.enable_grad():  # every row dropped: no update (a step on zero gradients moves Adam)
        train_stats, epochs_run = (ppo_epochs(run, cfg, experience, step) if any_trained
                                   else ({"health/skipped_updates": 0, "ppo/updates": 0}, 0))
    trained.update(after_update(run, train_stats))  # the no-op checks (tether.ppo.noop)
    if experience.from_forward is not None and any_trained:  # (a): log π_old as the update's forward computed it
        experience, entropy, kl = with_training_logprobs(cfg, experience, response_mask)

    # 10. KL controller (B11) on this step's per-token KL to the reference, pooled over all processes' tokens.
    # It learns only from rollouts of a policy that has been updated: before the first policy update (step 1,
    # and every critic warm-up step) the KL is exactly 0 and says nothing about β.
    beta_used, kl_mean = o.kl_controller.value, None if kl is None else global_masked_mean(p, kl, response_mask)
    if step > cfg.critic.warmup_steps + 1 and any_kept and kl_mean is not None:  # no row kept: no KL measured
        o.kl_controller.update(kl_mean, n_steps=len(rollout) * p.world_size)

    metrics = step_metrics(run, cfg, step, timer, batch, experience, entropy, kl_mean, beta_used, epochs_run,
                           any_kept)
    return step_result(run, step, batch, {**metrics, **trained}, train_stats, finite, notes)


def trained_rows_left(p, experience: Experience, any_kept: bool, notes: list[str]) -> tuple[bool, list[str]]:
    """Whether any process holds a row the losses train on, and the alert lines with one more when
    ``--mask-truncated`` left none (every kept row cut by max_new_tokens): the update is then skipped — its
    losses would be 0/0 and a step on zero gradients still moves Adam — and the step is not a non-finite stall."""
    if experience.loss_rows is None or not any_kept:
        return any_kept, notes
    trained = experience.valid & experience.loss_rows
    if p.global_sum(trained.sum()) > 0:
        return True, notes
    return False, notes + ["--mask-truncated: every kept row was cut by --max-new-tokens (no EOS), so nothing is "
                           "left to train on: this step's update is skipped"]


def scoring_forwards(run, cfg, rollout: Rollout, timer: PhaseTimer):
    """Steps 2–4 of :func:`ppo_step`: ``(logprobs_old, entropy, logprobs_ref, values_old, last_values)``, (B, T)
    each but ``last_values`` (B,); None for what the run does not compute here (no critic; the old log-probs taken
    from the update's forward, the reference pass at β = 0: :mod:`tether.ppo.skips`)."""
    m, temperature = run.models, cfg.generation.temperature
    # Steps 2-4 compute in the run's precision (C5): policy and reference alike, so that before any update
    # log π_old = log π_ref to the bit and the KL is exactly 0 (to float rounding where log π_old comes from the
    # update's forward: its shapes differ).
    with m.precision.autocast(), scoring_mode(m.fsdp):
        # 2. Old log-probs from the training-side forward (B2): ratio = 1 exactly on the first minibatch. One
        # epoch of one on-policy minibatch (ppo.old_logprobs auto, tether.ppo.skips): that minibatch's own
        # forward gives them after the update, detached; nothing before it reads them, so no pass here.
        logprobs_old = entropy = hidden = None
        if not m.skips.old_logprobs:
            logprobs_old, entropy, hidden = forward_response(m.policy_model, rollout, temperature,
                                                             need_hidden=m.critic_is_head, options=m.forward)
        timer.split("logprobs_old")
        # 3. Reference log-probs (B3): the adapter disabled (LoRA) or the frozen twin. β = 0 throughout and no
        # KL metric asked (kl.reference auto): nothing reads them, no pass, the KL metrics not computed.
        logprobs_ref = None
        if not m.skips.reference:
            with m.policy.reference_model(m.policy_model) as reference:
                logprobs_ref, _, _ = forward_response(reference, rollout, temperature, need_entropy=False,
                                                      options=m.forward)
        timer.split("reference")
        values_all = critic_values(m.critic, rollout, hidden)  # 4. Values V(s_0) … V(s_T), (B, T+1) or None
    values_old, last_values = split_values(values_all, rollout)
    timer.split("values")
    return logprobs_old, entropy, logprobs_ref, values_old, last_values


def step_result(run, step: int, batch, metrics: dict, train_stats: dict, finite: torch.Tensor,
                notes: list[str]) -> dict:
    """What :func:`ppo_step` returns: the step's metrics, the draw's and the updates', the rows dropped as
    non-finite (B16), and two entries the run loop pops (not metrics): ``health/notes``, the alert lines, and
    ``health/non_finite_stall``, whether the step counts toward B16's stop — its updates were all skipped for a
    non-finite loss or gradient norm, or it had no finite row at all; not a step with nothing with spread to learn
    from (``--filter-groups``, every group flat: the phase dynamic sampling exists for)."""
    p = run.processes
    metrics["health/dropped_rows"] = p.global_sum((~finite).sum().float())
    if run.data.ahead is not None:
        metrics["rollout/staleness"] = step - 1 - batch.sampled_at
    notes = notes + batch.metrics.pop("health/notes", [])
    stalled = train_stats["ppo/updates"] == 0 and (train_stats["health/skipped_updates"] > 0
                                                   or p.global_sum(finite.sum().float()) == 0)
    return {**metrics, **batch.metrics, **train_stats, "health/notes": notes, "health/non_finite_stall": stalled}


def nothing_to_train(run, cfg, step: int, timer: PhaseTimer, batch) -> dict:
    """The result of a step with no row to train on and no other process to keep in step (``--filter-groups``
    short of every group): steps 2–10 are skipped — no forward over rows that would weigh nothing, no update, the
    KL controller left alone — and what was drawn is reported as :func:`ppo_step` reports it."""
    mask = batch.rollout.response_mask
    finite, notes = finite_rows(batch.rewards_raw, (mask.float(),), None, mask)  # the scores alone were computed
    metrics = step_metrics(run, cfg, step, timer, batch, None, None, 0.0, run.optim.kl_controller.value, 0, False)
    return step_result(run, step, batch, metrics, {"health/skipped_updates": 0, "ppo/updates": 0}, finite, notes)


def sample_batch(run, cfg, step: int, timer: PhaseTimer, n: int | None = None) -> Batch:
    """One draw of ``n`` prompts (default ``--batch-size``) with K adjacent rows each (a group, B17), sampled now with the KV cache
    until every row ended, EOS vs truncated recorded — or, one step off (``--async-rollout 1``), the batch the rollout
    processes sampled while the previous step trained (:class:`~tether.ppo.offpolicy.OneStepOff`)."""
    m, d = run.models, run.data
    if d.ahead is not None:
        return d.ahead.next(run, cfg, step - 1, timer)
    rows = [row for row in d.prompts.next_batch(n) for _ in range(cfg.samples_per_prompt)]
    with timer("generate"):
        rollout, responses = rollout_batch(m, cfg, rows)
    return Batch(rows, rollout, responses, sampled_at=step - 1)


def estimate_advantages(cfg, distributed: bool, rewards: torch.Tensor, values_old: torch.Tensor | None,
                        last_values: torch.Tensor | None, scores: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                        mask: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 6–7: ``(advantages, returns)``, (B, T) each. With a critic (``values_old`` not None), GAE on the
    per-token ``rewards`` (B7), bootstrapping truncated rows with V(s_T), returns from the un-whitened advantages,
    then whitening over the valid tokens of all ranks (B8). Without one (B17), tether.core.group's estimator on
    the rows' ``scores`` and per-token ``kl`` (β = ``kl_coef``): each row's score against its group's (RLOO, GRPO,
    Dr. GRPO) on its last token, −β·KL_t on every token, rewards-to-go; REINFORCE++ whitens them over all ranks."""
    if values_old is None:
        return critic_free_advantages(cfg.advantage.estimator, scores, kl, kl_coef, mask, cfg.samples_per_prompt,
                                      cfg.gae.gamma, cfg.advantage.std_eps, valid, distributed=distributed)
    advantages, returns = gae(rewards, values_old, mask, cfg.gae.gamma, cfg.gae.lam, last_values)
    if cfg.ppo.whiten_advantages:
        advantages = whiten(advantages, mask, distributed=distributed)
    return advantages, returns


def step_metrics(run, cfg, step: int, timer: PhaseTimer, batch, e: Experience | None, entropy: torch.Tensor | None,
                 kl_mean: float, beta_used: float, epochs_run: int, any_kept: bool) -> dict:
    """The step's metrics (B12, C2, C6) over all processes, from the batch as it was sampled (``batch``:
    :class:`~tether.ppo.draw.StepBatch`; the group metrics of every group drawn, on the scores the estimator sees)
    and the experience (None: no forward ran, :func:`nothing_to_train`). A step that kept no row (``any_kept``
    False: every row non-finite, or dynamic sampling short of every group) has no mean over kept rows or tokens:
    those keys are left out, not written as 0 (a 0 would read as a collapsed entropy, a KL of 0, a score of 0 where
    the drawn groups were solved). Throughput counts every round's generation and the forwards that ran."""
    p, rollout, scores_raw = run.processes, batch.rollout, batch.rewards_raw.total
    curriculum = run.data.prompts.curriculum
    drawn = batch.drawn_scores
    over_kept = {
        **objective_metrics(p, e.scores, scores_raw, e.rewards, None if kl_mean is None else e.kl, e.response_mask,
                            e.valid, kl_mean, beta_used),
        **({"policy/entropy": global_masked_mean(p, entropy, e.response_mask)} if entropy is not None else {}),
        **(value_metrics(p, e.values_old, e.returns, e.response_mask) if e.values_old is not None else {}),
        **logprob_metrics(p, cfg, rollout, e.logprobs_old, e.response_mask),
        **truncation_mask_metrics(p, e.valid, e.loss_rows),
        **advantage_metrics(p, e.advantages, e.response_mask),
    } if any_kept else {"objective/kl_coef": beta_used}
    kept_tokens = rollout.lengths[e.valid.to(rollout.lengths.device)].sum() if e is not None else 0
    return {
        **over_kept,
        **group_metrics(p, drawn, torch.isfinite(drawn), cfg.samples_per_prompt),
        **(curriculum.summary() if curriculum is not None else {}),
        **response_metrics(p, rollout),
        **overlong_metrics(p, rollout, cfg.generation.max_new_tokens, cfg.reward.overlong_buffer,
                           cfg.reward.overlong_penalty_factor),
        **perf_metrics(timer, p.global_sum(batch.generated[1].sum().float()),
                       p.global_sum(torch.as_tensor(kept_tokens).float()), run.models.engine.sync_seconds),
        **throughput_metrics(p, run.perf, timer, rollout, epochs_run, critic_only=step <= cfg.critic.warmup_steps,
                             packed=run.models.forward.packing, generated=batch.generated, forwards=e is not None,
                             skipped=run.models.skips.phases),
        "ppo/epochs_run": epochs_run,
        "ppo/early_stopped": float(epochs_run < cfg.ppo.epochs),
    }


def token_kl(cfg, logprobs: torch.Tensor | None, logprobs_ref: torch.Tensor | None, mask: torch.Tensor
             ) -> torch.Tensor | None:
    """(B, T) per-token KL_t estimate of log π_old against log π_ref (B5, kl.estimator), 0 on padding; None when
    either side was not computed (the reference skipped, or log π_old still to come from the update's forward)."""
    if logprobs is None or logprobs_ref is None:
        return None
    return kl_penalty(logprobs, logprobs_ref, cfg.kl.estimator, k3_clip=cfg.kl.k3_clip) * mask


def with_training_logprobs(cfg, experience: Experience, mask: torch.Tensor):
    """After the update, where log π_old was taken from its forward (tether.ppo.skips): ``(experience, entropy,
    kl)`` with log π_old filled in, the entropy and the per-token KL to the reference (None without its pass)."""
    logprobs, entropy = training_logprobs(experience, mask)
    kl = token_kl(cfg, logprobs, experience.logprobs_ref, mask)
    return replace(experience, logprobs_old=logprobs, kl=experience.kl if kl is None else kl), entropy, kl


def logprob_metrics(p, cfg, rollout: Rollout, logprobs_old: torch.Tensor | None, mask: torch.Tensor) -> dict:
    """The sampler gap (C3) and mismatch (B19) metrics of log π_old; none where it was never computed (taken from
    the update's forward, tether.ppo.skips, in a step that ran no update)."""
    if logprobs_old is None:
        return {}
    return {**sampler_gap_metrics(p, rollout, logprobs_old, mask), **correction_metrics(p, cfg, rollout,
                                                                                       logprobs_old, mask)}


def scoring_mode(fsdp):
    """The grad mode of the scoring forwards: ``torch.inference_mode`` (12% faster than ``no_grad`` for the 10.7M
    bench policy's 64-row forward, bench/fast_paths.py); what it returns leaves inference mode through the
    functional ops after it (zero_rows, GAE), so the frozen experience holds ordinary tensors the losses may save
    for backward. Under FSDP2 ``no_grad``: its unshard/reshard writes parameter storage that training reuses."""
    return torch.no_grad() if fsdp is not None else torch.inference_mode()


def split_values(values_all: torch.Tensor, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) V(s_0) … V(s_T) → ``values_old`` (B, T), 0 on padding, and ``last_values`` (B,): V(s_T) at each
    row's end for rows cut by max_new_tokens (the bootstrap, B7), 0 for rows that ended with EOS. Selected,
    not multiplied, so that a NaN where nothing is used stays out. No critic (``values_all`` None): (None, None)."""
    if values_all is None:
        return None, None
    mask = rollout.response_mask.bool()
    values_old = torch.where(mask, values_all[:, :-1], 0.0)
    at_end = values_all[torch.arange(len(rollout), device=values_all.device), rollout.lengths]
    last_values = torch.where(rollout.ended_with_eos, 0.0, at_end)
    return values_old, last_values


def zero_rows(valid: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor (B, ...) with the rows where ``valid`` (B,) is False set to 0 (a NaN row becomes 0 too); None
    stays None (no critic, no values)."""
    return tuple(t if t is None else torch.where(valid.view(-1, *[1] * (t.dim() - 1)), t, 0.0) for t in tensors)


def stand_in_rows(rollout: Rollout, valid: torch.Tensor) -> Rollout:
    """``rollout`` with each dropped row (``valid`` False) replaced by a kept row of this process, cycling through
    them, so that the training forwards compute on finite inputs only; the rows keep their places (the same
    minibatches, the same collectives on every process). With no kept row here the rows stay as they are: their
    update is then skipped if they make it non-finite (B16)."""
    if bool(valid.all()) or not bool(valid.any()):
        return rollout
    kept = valid.nonzero().flatten()
    rows = torch.arange(len(valid), device=valid.device)
    return rollout.select(torch.where(valid, rows, kept[rows % len(kept)]))


def finite_rows(rewards_raw: RewardScores, per_token: tuple, last_values: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, list[str]]:
    """(B,) bool: rows whose scores (both channels), bootstrap value V(s_T) and per-token tensors (on their valid
    tokens) are all finite (B16), and one alert line naming the dropped rows and why (a rule that raised says so).
    Without a critic the values and the bootstrap are None and not checked."""
    score_ok = torch.isfinite(rewards_raw.total).to(mask.device)
    checked = [(torch.isfinite(x) | (mask == 0)).all(dim=1) for x in per_token if x is not None]
    token_ok = torch.stack(checked).all(dim=0) if checked else torch.ones_like(score_ok)  # none computed (skips)
    bootstrap_ok = torch.isfinite(last_values) if last_values is not None else torch.ones_like(score_ok)
    valid = score_ok & token_ok & bootstrap_ok
    if valid.all():
        return valid, []
    errors = rewards_raw.errors

    def reason(i: int) -> str:
        if not score_ok[i]:
            return errors.get(i) or "non-finite score"
        return "non-finite log-prob or value" if not token_ok[i] else "non-finite bootstrap value V(s_T)"

    reasons = [f"row {i}: {reason(i)}" for i in (~valid).nonzero().flatten().tolist()]
    return valid, [f"dropped {len(reasons)} of {len(valid)} rows from the update (" + "; ".join(reasons) + ")"]
