"""What generation made: the :class:`Rollout` record every engine returns (STYLE habit 4) — prompt and response
token ids, their masks, how each response ended. Built complete by :func:`tether.rollout.sampling.generate` (or an
engine's own sampler).

Positions: the query (prompt) has P tokens, left-padded; the response has T tokens, right-padded after
its first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def select_rows(record, index: torch.Tensor):
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
        return select_rows(self, index)

    @staticmethod
    def concat(rollouts: list["Rollout"], pad_id: int) -> "Rollout":
        """Several rollouts' rows as one: prompts left-padded to the widest, responses right-padded to the longest
        (``pad_id``, mask 0); their EOS ids and ``min_new_tokens`` must agree."""
        first = rollouts[0]
        if any(r.eos_ids != first.eos_ids or r.min_new_tokens != first.min_new_tokens for r in rollouts):
            raise ValueError("Rollout.concat: the rollouts were sampled with different EOS ids or min_new_tokens")
        P = max(r.query.shape[1] for r in rollouts)
        T = max(r.response.shape[1] for r in rollouts)
        pad = torch.nn.functional.pad

        def left(x, value):
            return pad(x, (P - x.shape[1], 0), value=value)

        def right(x, value):
            return pad(x, (0, T - x.shape[1]), value=value)

        sampler = None
        if all(r.logprobs_sampler is not None for r in rollouts):
            sampler = torch.cat([right(r.logprobs_sampler, 0.0) for r in rollouts])
        return Rollout(query=torch.cat([left(r.query, pad_id) for r in rollouts]),
                       query_mask=torch.cat([left(r.query_mask, 0) for r in rollouts]),
                       response=torch.cat([right(r.response, pad_id) for r in rollouts]),
                       response_mask=torch.cat([right(r.response_mask, 0) for r in rollouts]),
                       ended_with_eos=torch.cat([r.ended_with_eos for r in rollouts]), eos_ids=first.eos_ids,
                       min_new_tokens=first.min_new_tokens, logprobs_sampler=sampler)

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
