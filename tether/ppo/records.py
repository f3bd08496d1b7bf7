"""The typed records of one PPO step, in the order the step makes them (STYLE habit 4).

- :class:`Rollout` — what generation made: prompt and response token ids, their masks, how each response
  ended. Built complete by :func:`tether.ppo.rollout.generate`.
- :class:`Experience` — what scoring added to a rollout: old and reference log-probs, old values, scores,
  per-token KL and rewards, advantages and returns. Built complete once, after GAE and whitening, and
  frozen for the whole epoch loop (B7): nothing is filled in later.

Positions: the query (prompt) has P tokens, left-padded; the response has T tokens, right-padded after
its first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def _select(record, index: torch.Tensor):
    """The rows ``index`` of every tensor field of ``record`` (nested records too), as a new record."""
    def pick(v):
        if isinstance(v, torch.Tensor):
            return v[index]
        return v.select(index) if hasattr(v, "select") else v

    return type(record)(**{f.name: pick(getattr(record, f.name)) for f in fields(record)})


@dataclass(frozen=True)
class Rollout:
    """What generation made for one batch of prompts."""

    query: torch.Tensor            # (B, P) prompt token ids, left-padded
    query_mask: torch.Tensor       # (B, P) 1 on prompt tokens
    response: torch.Tensor         # (B, T) sampled token ids, pad after the first EOS
    response_mask: torch.Tensor    # (B, T) 1 up to and including the first EOS
    ended_with_eos: torch.Tensor   # (B,) bool: False = cut by max_new_tokens (truncated)
    eos_ids: tuple[int, ...] = ()  # the token ids that end a response
    min_new_tokens: int = 0        # EOS was kept out of the first min_new_tokens samples (scored so too, B1)
    logprobs_sampler: torch.Tensor | None = None  # (B, T) what an engine with its own weights reported; never trained on

    def __len__(self) -> int:
        return self.query.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)  # (B,) response tokens up to and including EOS

    def select(self, index: torch.Tensor) -> "Rollout":
        return _select(self, index)

    def trimmed(self) -> "Rollout":
        """The same rows without the columns that are padding in every row: the prompt's leading columns
        (left padding) and the response's trailing ones. Positions come from the attention mask, so every
        forward computes the same values on fewer columns."""
        first = int(self.query_mask.any(dim=0).float().argmax())  # (P,) -> first column with a token
        width = int(self.lengths.max()) if len(self) else 0
        sampler = None if self.logprobs_sampler is None else self.logprobs_sampler[:, :width]
        return replace(self, query=self.query[:, first:], query_mask=self.query_mask[:, first:],
                       response=self.response[:, :width], response_mask=self.response_mask[:, :width],
                       logprobs_sampler=sampler)


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

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, T) the tokens the losses average over: the rollout's mask, zero on dropped rows. The forward
        passes keep using ``rollout.response_mask`` (the attention mask of what was generated)."""
        mask = self.rollout.response_mask
        return mask if self.valid is None else mask * self.valid[:, None].to(mask.dtype)

    def select(self, index: torch.Tensor) -> "Experience":
        return _select(self, index)

    def trimmed(self) -> "Experience":
        """:meth:`Rollout.trimmed` for the rollout and every (B, T) field (the padding columns are all zero
        in each, masked out of every loss)."""
        rollout = self.rollout.trimmed()
        width = rollout.response.shape[1]
        per_token = {f.name: v[:, :width] for f in fields(self)
                     if isinstance(v := getattr(self, f.name), torch.Tensor) and v.dim() == 2}
        return replace(self, rollout=rollout, **per_token)
