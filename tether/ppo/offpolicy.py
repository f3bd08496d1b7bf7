"""The off-policy side of a PPO step: the sampler–trainer mismatch and its correction (SPEC B19), and one-step-off
rollout (C7).

**Correction.** The engine's per-token log-probs (``Rollout.logprobs_sampler``: vLLM's, the rollout processes', or
the transformers engine's own when ``--rollout-correction`` asks for them) are kept beside the trainer's old
log-probs (B2); :func:`step_correction_weights` turns the two into the per-token weights of the policy loss
(:mod:`tether.core.correction`), frozen with the rest of the experience; :func:`correction_metrics` reports the
mismatch every step the engine gives log-probs, whatever the mode.

**One step off** (``--async-rollout 1``, the disaggregated layout). :class:`OneStepOff` keeps one batch in flight:
at step t the trainers receive the batch the rollout processes sampled while step t − 1 trained, sync the weights
step t starts from, and send step t + 1's prompts; the rollout processes sample them while step t scores and trains.
Its tokens therefore come from the weights of one update ago (``rollout/staleness`` 1; 0 at the first step, which
has nothing in flight), while PPO's old log-probs are the current weights' (B2): the gap between the two is exactly
what the correction's π_old / π_engine reweights (the engine's log-probs are the behaviour policy's).

A checkpoint saves the batch in flight (it is collected first), so ``--resume`` continues exactly as the straight
run would: the same batch with the same engine log-probs, then the same next request (the trainers' RNG and the
prompt position are saved after it was drawn). Regenerating it instead would not be exact: it was sampled with the
weights of the update before the checkpoint, which the checkpoint does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tether.core.correction import correction_weights, importance_ratio, mismatch_kl, sequence_mismatch
from tether.errors import TetherError
from tether.ppo.metrics import global_masked_mean
from tether.rollout.records import Rollout
from tether.rollout.sampling import encode_prompts


def step_correction_weights(cfg, rollout: Rollout, logprobs_old: torch.Tensor, mask: torch.Tensor
                            ) -> torch.Tensor | None:
    """(B, T) the weights w_t of this step's policy loss (B19), or None with ``--rollout-correction none``.
    ``logprobs_old`` the trainer's (rows dropped by B16 already zeroed), ``mask`` the tokens the losses count."""
    c = cfg.correction
    if c.mode == "none":
        return None
    if rollout.logprobs_sampler is None:
        raise TetherError(f"--rollout-correction {c.mode}: the rollout engine gave no log-probs of its samples")
    return correction_weights(logprobs_old, rollout.logprobs_sampler, mask, c.mode, c.cap, c.bound)


def correction_metrics(p, cfg, rollout: Rollout, logprobs_old: torch.Tensor, mask: torch.Tensor) -> dict:
    """The sampler–trainer mismatch over all processes' kept tokens (B19, D1), when the engine gave log-probs:
    ``rollout/mismatch_kl`` (token mean of k3(π_engine, π_old)), ``rollout/is_weight_mean|max`` (of the
    untruncated ρ = π_old/π_engine), ``rollout/is_truncated_fraction`` (tokens with ρ > correction.cap),
    ``rollout/is_masked_fraction`` (sequences whose mismatch passes correction.bound): what tis / mis do, or would."""
    if rollout.logprobs_sampler is None:
        return {}
    engine, c = rollout.logprobs_sampler, cfg.correction
    tokens = mask.bool()
    ratio = importance_ratio(logprobs_old, engine)
    rows = tokens.any(dim=1)
    over = (sequence_mismatch(logprobs_old, engine, mask) > c.bound) & rows
    return {"rollout/mismatch_kl": global_masked_mean(p, mismatch_kl(logprobs_old, engine), tokens),
            "rollout/is_weight_mean": global_masked_mean(p, ratio, tokens),
            "rollout/is_weight_max": p.global_max(ratio[tokens].max() if tokens.any() else ratio.new_zeros(())),
            "rollout/is_truncated_fraction": global_masked_mean(p, (ratio > c.cap).float(), tokens),
            "rollout/is_masked_fraction": p.global_sum(over.sum()) / max(p.global_sum(rows.sum()), 1.0)}


@dataclass
class Batch:
    """A step's sampled batch: K adjacent rows per prompt, what generation made, the decoded responses."""

    rows: list[dict]
    rollout: Rollout
    responses: list[str]
    sampled_at: int  # policy updates in the weights that sampled it (the steps done when they were synced)


class OneStepOff:
    """One batch in flight between the trainers and the rollout processes (C7; see the module docstring)."""

    bound = 1  # the staleness it allows: never more than one update between sampling and scoring

    def __init__(self):
        self.pending: tuple[list[dict], int] | None = None  # (rows, sampled_at) of the request in flight
        self.ready: Batch | None = None                     # collected, not yet trained on
        self.synced_at: int | None = None                   # the steps done when the engine last took the weights

    def next(self, run, cfg, steps_done: int, timer) -> Batch:
        """This step's batch (``steps_done`` updates are in the weights now), and step t + 1's request sent."""
        if self.ready is None and self.pending is None:  # the first step (or a resume with nothing saved in flight)
            self._request(run, cfg, steps_done, timer)
        with timer("generate"):  # the part of the generation the previous step's training did not hide
            self.collect(run)
        batch, self.ready = self.ready, None
        if steps_done - batch.sampled_at > self.bound:
            raise TetherError(f"async rollout: a batch {steps_done - batch.sampled_at} updates old (bound "
                              f"{self.bound})")
        self._request(run, cfg, steps_done, timer)
        return batch

    def _request(self, run, cfg, steps_done: int, timer) -> None:
        """Draw the next rows, give the engine the current weights (once per update), send the prompts."""
        m, d = run.models, run.data
        rows = [row for row in d.prompts.next_batch() for _ in range(cfg.samples_per_prompt)]
        if self.synced_at != steps_done:
            with timer("weight_sync"):
                m.engine.sync_weights(m.unwrapped_policy)
            run.versions.synced()
            self.synced_at = steps_done
        query, query_mask = encode_prompts(m.tokenizer, [r["prompt"] for r in rows], cfg.data.max_prompt_length,
                                           m.use_chat_template, cfg.data.system_prompt, cfg.data.prompt_template)
        g = cfg.generation
        with timer("generate"):
            m.engine.submit(query, query_mask, g.max_new_tokens, g.temperature, min_new_tokens=g.min_new_tokens)
        self.pending = (rows, steps_done)

    def collect(self, run) -> None:
        """Receive the batch in flight, if any (before an evaluation, a checkpoint or the end, which use the engine
        or save it): it waits, decoded, for the next step."""
        if self.pending is None:
            return
        rows, sampled_at = self.pending
        self.pending = None
        rollout = run.models.engine.collect()
        responses = run.models.tokenizer.batch_decode(
            [row[m.bool()] for row, m in zip(rollout.response, rollout.response_mask)], skip_special_tokens=True)
        self.ready = Batch(rows, rollout, responses, sampled_at)

    def state_dict(self, run) -> dict | None:
        """The batch in flight, collected (collective: every trainer receives its own), for a checkpoint: its rows
        as indices into the prompt rows, its rollout's tensors, its responses and when it was sampled."""
        self.collect(run)
        if self.ready is None:
            return None
        index = {id(row): i for i, row in enumerate(run.data.prompts.rows)}
        b = self.ready
        if any(id(row) not in index for row in b.rows):
            raise TetherError("async rollout: the batch in flight holds a row that is not a prompt row")
        rollout = {f.name: (v.cpu() if isinstance(v := getattr(b.rollout, f.name), torch.Tensor) else v)
                   for f in fields(b.rollout)}
        rollout["eos_ids"] = list(rollout["eos_ids"])
        return {"rows": [index[id(row)] for row in b.rows], "rollout": rollout, "responses": list(b.responses),
                "sampled_at": b.sampled_at}

    def load_state_dict(self, run, state: dict | None) -> None:
        """A checkpoint's batch in flight, ready for the next step (its request was answered before the save)."""
        self.pending, self.synced_at = None, None
        if state is None:
            self.ready = None
            return
        device = run.processes.device
        r = state["rollout"]
        rollout = Rollout(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in r.items()
                             if k != "eos_ids"}, eos_ids=tuple(r["eos_ids"]))
        rows = [run.data.prompts.rows[i] for i in state["rows"]]
        self.ready = Batch(rows, rollout, list(state["responses"]), int(state["sampled_at"]))
