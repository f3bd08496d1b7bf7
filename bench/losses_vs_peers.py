#!/usr/bin/env python
"""tether's policy losses against TRL's and veRL's code, re-typed from their sources, on the same random tensors.

The peers' formulas are written here as their code writes them (file and function cited at each), on one process
with one micro-batch (so TRL's ``num_items_in_batch`` is the batch's valid tokens and veRL's ``global_batch_info``
is the batch's own counts), no KL term, no entropy bonus, no rollout correction. The tensors: 8 rows × 12 tokens
with ragged masks (lengths 1..12), log π_old ~ −3·U(0, 1), log π = log π_old + 0.3·N(0, 1) (ratios both inside and
outside the clip ranges), per-sequence advantages (TRL's (B, 1)) or per-token ones (veRL takes (B, T)). Each row
prints the max abs difference of the loss and of its gradient with respect to log π; ≤ 1e-6 where the two
conventions agree, and where they do not, the row says what differs (docs/losses.md):

    python bench/losses_vs_peers.py [--seed 0]

Sources read: TRL 1.16.0 (PyPI wheel) trl/trainer/grpo_trainer.py ``GRPOTrainer._compute_loss``; veRL commit
b178a3c (2026-01-29) verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``compute_policy_loss_cispo`` and ``agg_loss``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.core.losses import cispo_policy_loss, gspo_policy_loss, ppo_policy_loss


# ---- TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (lines 3020-3190) -----------------------

def trl_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type="dapo",
             importance_sampling_level="token", epsilon=0.2, epsilon_high=None, max_completion_length=12):
    """``advantages`` (B,) as TRL's; beta = 0, no vLLM correction, no entropy mask, one process and window."""
    epsilon_low, epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high  # __init__, l. 945-946
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":  # l. 3084
        log_importance_weights = log_ratio
    else:  # "sequence"
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":  # l. 3109
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    else:  # grpo, bnpo, dr_grpo, dapo, luspo (l. 3112); delta None
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if loss_type == "grpo":  # l. 3153: each sequence's token mean, then the mean over sequences
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":  # l. 3158: the micro-batch's token mean
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ("cispo", "dapo"):  # l. 3168: num_items_in_batch = the valid tokens (one process, one window)
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(loss_type)


# ---- veRL b178a3c, verl/trainer/ppo/core_algos.py -------------------------------------------------------------

def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    """``agg_loss`` (l. 1025), dp_size 1, the batch's own token / sequence counts."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def verl_vanilla(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                 clip_ratio_c=3.0, loss_agg_mode="token-mean"):
    """``compute_policy_loss_vanilla`` (l. 1159): PPO with asymmetric clip and dual-clip at c for A < 0."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
              loss_agg_mode="seq-mean-token-mean"):
    """``compute_policy_loss_gspo`` (l. 1253): the per-token form s_i,t; veRL always aggregates it by
    "seq-mean-token-mean" (``loss_agg_mode`` here only to isolate the formula from the aggregation)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
               loss_agg_mode="token-mean"):
    """``compute_policy_loss_cispo`` (l. 1721)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


RANGES = {(3e-4, 4e-4): "3e-4/4e-4", (0.05, 0.08): "0.05/0.08"}  # GSPO's clip ranges compared, as labelled


# ---- the comparison -------------------------------------------------------------------------------------------

@dataclass
class Row:
    tether: str
    peer: str
    max_abs_diff: float  # of the loss and of d loss / d log π, the larger
    same_convention: bool
    note: str


def tensors(seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 12
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row: the padding never hides a wrong broadcast
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -3 * torch.rand(B, T, generator=g)
    new = old + spread * torch.randn(B, T, generator=g)
    adv_seq = torch.randn(B, generator=g)
    adv_tok = torch.randn(B, T, generator=g)
    return new, old, mask, adv_seq, adv_tok


def diff(tether_fn, peer_fn, new) -> float:
    """max |loss − loss'| and max |∇ − ∇'| over log π."""
    a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    la, lb = tether_fn(a), peer_fn(b)
    la.backward()
    lb.backward()
    return max(abs(la.item() - lb.item()), (a.grad - b.grad).abs().max().item())


def compare(seed: int = 0) -> list[Row]:
    """Every pairing of a tether loss with a peer's, as a :class:`Row`."""
    new, old, mask, adv_seq, adv_tok = tensors(seed)
    adv_bt = adv_seq[:, None].expand_as(new)  # TRL's (B,) advantage on each token, as tether's (B, T)
    rows = []

    def add(tether, peer, t_fn, p_fn, same, note, x=new):
        rows.append(Row(tether, peer, diff(t_fn, p_fn, x), same, note))

    ppo = lambda high, adv, x_old=old, m=mask: (lambda lp: ppo_policy_loss(lp, x_old, adv, m, 0.2,
                                                                            clip_range_high=high)[0])
    add("ppo", "TRL loss_type=dapo", ppo(None, adv_bt), lambda lp: trl_loss(lp, old, adv_seq, mask), True,
        "token mean over the batch")
    add("ppo --clip-range-high 0.28", "TRL dapo epsilon_high=0.28", ppo(0.28, adv_bt),
        lambda lp: trl_loss(lp, old, adv_seq, mask, epsilon_high=0.28), True, "DAPO's clip-higher")
    add("ppo --clip-range-high 0.28", "TRL bnpo epsilon_high=0.28", ppo(0.28, adv_bt),
        lambda lp: trl_loss(lp, old, adv_seq, mask, loss_type="bnpo", epsilon_high=0.28), True,
        "micro-batch token mean (one micro-batch: the same)")
    add("ppo --clip-range-high 0.28", "veRL vanilla clip_ratio_high=0.28", ppo(0.28, adv_tok),
        lambda lp: verl_vanilla(old, lp, adv_tok, mask, 0.2, 0.28), True,
        "token-mean; dual-clip c=3 idle (no ratio above 3 here)")
    add("ppo", "TRL loss_type=grpo", ppo(None, adv_bt), lambda lp: trl_loss(lp, old, adv_seq, mask, loss_type="grpo"),
        False, "TRL grpo: mean over sequences of token means; tether: token mean (DAPO's)")
    wide_new, wide_old, wide_mask, _, wide_adv = tensors(seed + 1, spread=1.5)  # ratios above 3 with A < 0
    add("ppo", "veRL vanilla (dual-clip c=3)", ppo(None, wide_adv, wide_old, wide_mask),
        lambda lp: verl_vanilla(wide_old, lp, wide_adv, wide_mask), False,
        "veRL caps −ρA at −3A for A < 0 (dual-clip PPO); tether does not", x=wide_new)

    gspo = lambda adv, eps, hi, token: (lambda lp: gspo_policy_loss(lp, old, adv, mask, eps,
                                                                     clip_range_high=hi, token_level=token)[0])
    for eps, hi in ((3e-4, 4e-4), (0.05, 0.08)):  # every row clipped (the paper's range); some rows clipped
        add(f"gspo {RANGES[eps, hi]}", "TRL sequence + loss_type=dapo", gspo(adv_bt, eps, hi, False),
            lambda lp, eps=eps, hi=hi: trl_loss(lp, old, adv_seq, mask, importance_sampling_level="sequence",
                                                epsilon=eps, epsilon_high=hi), True,
            "token mean of the per-sequence loss")
    add("gspo 3e-4/4e-4", "TRL sequence + loss_type=grpo (the paper)", gspo(adv_bt, 3e-4, 4e-4, False),
        lambda lp: trl_loss(lp, old, adv_seq, mask, importance_sampling_level="sequence", loss_type="grpo",
                            epsilon=3e-4, epsilon_high=4e-4), False,
        "paper / TRL grpo: mean over sequences; tether: token mean (a row weighs its length)")
    for eps, hi in ((3e-4, 4e-4), (0.05, 0.08)):
        add(f"gspo_token {RANGES[eps, hi]}", "veRL gspo terms, token-mean", gspo(adv_tok, eps, hi, True),
            lambda lp, eps=eps, hi=hi: verl_gspo(old, lp, adv_tok, mask, eps, hi, loss_agg_mode="token-mean"), True,
            "per-token advantages; aggregation swapped to isolate the formula")
    add("gspo_token 3e-4/4e-4", "veRL gspo as written", gspo(adv_tok, 3e-4, 4e-4, True),
        lambda lp: verl_gspo(old, lp, adv_tok, mask, 3e-4, 4e-4), False,
        "veRL: seq-mean-token-mean always; tether: token mean")
    add("gspo_token 3e-4/4e-4", "TRL sequence + dapo (sequence advantages)", gspo(adv_bt, 3e-4, 4e-4, True),
        lambda lp: trl_loss(lp, old, adv_seq, mask, importance_sampling_level="sequence", epsilon=3e-4,
                            epsilon_high=4e-4), True, "one advantage per row: GSPO-token = GSPO, gradient too")

    cispo = lambda lo, hi, adv: (lambda lp: cispo_policy_loss(lp, old, adv, mask, lo,
                                                               clip_range_high=hi)[0])
    add("cispo 0.2/0.28", "veRL cispo clip_ratio 0.2/0.28", cispo(0.2, 0.28, adv_tok),
        lambda lp: verl_cispo(old, lp, adv_tok, mask, 0.2, 0.28), True, "token-mean")
    add("cispo --clip-range 1 --clip-range-high 4", "TRL cispo epsilon_high=5", cispo(1.0, 4.0, adv_bt),
        lambda lp: trl_loss(lp, old, adv_seq, mask, loss_type="cispo", epsilon_high=5.0), True,
        "TRL's epsilon_high is the bound on ρ itself, with no lower bound: tether's 1 + ε_high, ε_low = 1")
    add("cispo 0.2/0.28", "TRL cispo epsilon_high=0.28", cispo(0.2, 0.28, adv_bt),
        lambda lp: trl_loss(lp, old, adv_seq, mask, loss_type="cispo", epsilon_high=0.28), False,
        "the same number means min(ρ, 0.28) in TRL, clip(ρ, 0.8, 1.28) in tether")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    rows = compare(args.seed)
    width = max(len(r.tether) for r in rows), max(len(r.peer) for r in rows)
    print(f"{'tether':<{width[0]}}  {'peer':<{width[1]}}  max|diff|  conventions")
    for r in rows:
        verdict = "agree" if r.same_convention else "DIFFER"
        print(f"{r.tether:<{width[0]}}  {r.peer:<{width[1]}}  {r.max_abs_diff:8.1e}  {verdict}: {r.note}")
    bad = [r for r in rows if r.same_convention and r.max_abs_diff > 1e-6]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows as expected" if not bad else f"MISMATCH in {len(bad)} rows")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
