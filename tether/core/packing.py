"""Padding-free packing with a shared prefix: several token sequences in one row of a batch, each attending only
to itself — and, for the K responses of one prompt, to that prompt, stored once. Pure functions on tensors.

A *unit* is a prefix (a prompt's tokens) and zero or more suffixes (its responses). Packed, a unit is laid out as
``prefix, suffix_1, …, suffix_K``; several units may share a row. Token j may be attended to by token i when both
belong to one unit, j ≤ i, and j lies in the prefix or in i's own segment:

    allowed(i, j) = unit(i) = unit(j)  ∧  j ≤ i  ∧  (seg(j) = 0 ∨ seg(j) = seg(i))          (segment 0 = the prefix)

Positions restart with each unit (0 … |prefix|−1), and each suffix continues from the prefix's end (|prefix| …),
exactly as if each suffix had been appended to its prefix alone: a causal LM computes on a packed row what it
computes on the K padded rows ``prefix + suffix_k``, without the prefix's K−1 copies or any padding between them.
Padding positions at a row's end attend to themselves only (a fully masked row would give NaN in softmax).

Layout of the result (``N`` rows of ``L`` positions): ``input_ids`` (N, L), ``position_ids`` (N, L),
``attention_mask`` (N, 1, L, L) bool (True = may attend; additive masks are the caller's to derive), and for every
unit the flat index (into N·L) of each of its tokens: ``prefix_index[u]`` (|prefix|,) and ``suffix_index[u][k]``
(|suffix_k|,).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    input_ids: torch.Tensor                  # (N, L) token ids, pad_id after each row's last unit
    position_ids: torch.Tensor               # (N, L) restarting per unit; suffixes continue from their prefix
    attention_mask: torch.Tensor             # (N, 1, L, L) bool: allowed(i, j) above
    prefix_index: list[torch.Tensor]         # per unit: (|prefix|,) flat indices into N·L
    suffix_index: list[list[torch.Tensor]]   # per unit, per suffix: (|suffix_k|,) flat indices into N·L

    @property
    def tokens(self) -> int:
        """Positions computed, padding included (N·L)."""
        return self.input_ids.numel()


def first_fit_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Units (by index) assigned to rows: first-fit over the units longest first, a row holding at most ``budget``
    tokens (a unit longer than the budget gets a row of its own). Deterministic for given lengths."""
    rows: list[list[int]] = []
    room: list[int] = []
    for u in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[u] <= free:
                rows[r].append(u)
                room[r] -= lengths[u]
                break
        else:
            rows.append([u])
            room.append(budget - lengths[u])
    return rows


def pack_units(prefixes: list[torch.Tensor], suffixes: list[list[torch.Tensor]], pad_id: int,
               budget: int | None = None) -> Packed:
    """Pack units (``prefixes[u]`` (P_u,) with ``suffixes[u]`` [(S_uk,), …]) into rows of at most ``budget`` tokens
    (default: the longest unit, so no row is longer than the longest unit; a unit never splits across rows).
    Every prefix must be non-empty (its last token predicts each suffix's first)."""
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("pack_units: every unit needs a non-empty prefix")
    lengths = [len(p) + sum(len(s) for s in ss) for p, ss in zip(prefixes, suffixes)]
    rows = first_fit_rows(lengths, budget or max(lengths))
    width = max(sum(lengths[u] for u in row) for row in rows)
    device = prefixes[0].device
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    unit_of = torch.full((len(rows), width), -1, dtype=torch.long, device=device)  # -1: padding
    segment = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    prefix_index: list[torch.Tensor] = [torch.empty(0)] * len(prefixes)
    suffix_index: list[list[torch.Tensor]] = [[] for _ in prefixes]
    for r, row in enumerate(rows):
        at = 0
        for u in row:
            p = prefixes[u]
            input_ids[r, at:at + len(p)] = p
            position_ids[r, at:at + len(p)] = torch.arange(len(p), device=device)
            unit_of[r, at:at + len(p)] = u
            prefix_index[u] = r * width + at + torch.arange(len(p), device=device)
            at += len(p)
            for k, s in enumerate(suffixes[u], start=1):
                input_ids[r, at:at + len(s)] = s
                position_ids[r, at:at + len(s)] = len(p) + torch.arange(len(s), device=device)
                unit_of[r, at:at + len(s)] = u
                segment[r, at:at + len(s)] = k
                suffix_index[u].append(r * width + at + torch.arange(len(s), device=device))
                at += len(s)
    mask = block_attention_mask(unit_of, segment)
    return Packed(input_ids, position_ids, mask, prefix_index, suffix_index)


def block_attention_mask(unit_of: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(N, 1, L, L) bool from the unit (−1 = padding) and segment (0 = prefix) of every position, (N, L) each:
    allowed(i, j) of the module docstring; a padding position attends to itself only."""
    L = unit_of.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=unit_of.device).tril()          # (L, L): j ≤ i
    same_unit = unit_of[:, :, None] == unit_of[:, None, :]                            # (N, L, L)
    visible = (segment[:, None, :] == 0) | (segment[:, :, None] == segment[:, None, :])
    real = (unit_of >= 0)[:, :, None]
    allowed = causal & same_unit & visible & real
    allowed |= torch.eye(L, dtype=torch.bool, device=unit_of.device) & ~real   # padding: itself only
    return allowed[:, None]
