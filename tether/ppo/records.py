"""The typed records of one PPO step, in the order the step makes them (STYLE habit 4).

- :class:`~tether.rollout.records.Rollout` — what generation made (the rollout layer's record): prompt and
  response token ids, their masks, how each response ended.
- :class:`Experience` — what scoring added to a rollout: old and reference log-probs, old values, scores,
  per-token KL and rewards, advantages and returns. Built complete once, after GAE and whitening, and
  frozen for the whole epoch loop (B7): nothing is filled in later.

Positions: the query (prompt) has P tokens, left-padded; the response has T tokens, right-padded after
its first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from tether.rollout.records import Rollout, select_rows


@dataclass(frozen=True)
class Experience:
    """A rollout with everything scoring added (B2–B8): the frozen inputs of the epoch loop.
    A minibatch is ``experience.select(index)``."""

    rollout: Rollout
    logprobs_old: torch.Tensor     # (B, T) log π_old(a_t|s_t), training-side forward (B2)
    logprobs_ref: torch.Tensor     # (B, T) log π_ref(a_t|s_t) (B3)
    values_old: torch.Tensor | None   # (B, T) V_old(s_t), 0 on padding; None without a critic (B17)
    last_values: torch.Tensor | None  # (B,) V_old(s_T) for truncated rows, 0 for rows that ended with EOS (B7)
    scores: torch.Tensor           # (B,) sequence scores after penalties, normalisation and clip (B4)
    kl: torch.Tensor               # (B, T) per-token KL_t estimate, 0 on padding (B5)
    rewards: torch.Tensor          # (B, T) r̃_t = −β·KL_t, plus the score on the last token (B5)
    advantages: torch.Tensor       # (B, T) Â_t, whitened when configured (B7, B8)
    returns: torch.Tensor          # (B, T) R_t = Â_t + V_old(s_t) before whitening (B7); no critic: rewards-to-go
    valid: torch.Tensor | None = None  # (B,) bool: False = row dropped from the update (non-finite, B16)
    is_weights: torch.Tensor | None = None  # (B, T) w_t of the off-policy correction (B19); None: --rollout-correction none
    loss_rows: torch.Tensor | None = None  # (B,) bool: False = a kept row the losses skip (--mask-truncated); None: all
    # log π_old taken from the update's own forward (ppo.old_logprobs auto, tether.ppo.skips): logprobs_old is None
    # until then, and each micro-batch's forward records its rows here; None: the separate pass ran
    from_forward: "TrainingForwardLog | None" = None

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, T) the tokens the losses average over: the rollout's mask, zero on dropped rows. The forward
        passes keep using ``rollout.response_mask`` (the attention mask of what was generated)."""
        mask = self.rollout.response_mask
        return mask if self.valid is None else mask * self.valid[:, None].to(mask.dtype)

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, T) the tokens the losses and their normaliser count: :attr:`response_mask`, zero also on the rows
        ``loss_rows`` leaves out (DAPO's overlong filtering: a truncated row keeps its place and its part in the
        scores, advantages and metrics, and weighs nothing in any loss)."""
        mask = self.response_mask
        return mask if self.loss_rows is None else mask * self.loss_rows[:, None].to(mask.dtype)

    def select(self, index: torch.Tensor) -> "Experience":
        return select_rows(self, index)

    def trimmed(self) -> "Experience":
        """:meth:`Rollout.trimmed` for the rollout and every (B, T) field (the padding columns are all zero
        in each, masked out of every loss)."""
        rollout = self.rollout.trimmed()
        width = rollout.response.shape[1]
        per_token = {f.name: v[:, :width] for f in fields(self)
                     if isinstance(v := getattr(self, f.name), torch.Tensor) and v.dim() == 2}
        return replace(self, rollout=rollout, **per_token)
