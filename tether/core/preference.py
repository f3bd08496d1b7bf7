"""Direct preference optimisation (DPO) from pairs: the summed log-probability of a reply, and the DPO and IPO
losses with the implicit reward as TRL names its figures. Pure functions on tensors; import only torch.

The policy's implicit reward of reply y to prompt x is r(x, y) = β · (log π(y|x) − log π_ref(y|x)) (Rafailov et al.
2023, eq. 5); a pair is ranked right when r(x, y_w) > r(x, y_l).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether.core.stats import logprobs_from_logits

LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, n_sequences: int,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each sequence's labelled tokens, and their number:

        S_s = Σ_{n,t : seg_{n,t+1} = s, m_{n,t+1}} log π(x_{n,t+1} | x_{n,≤t}),   C_s = the number of terms,

    with ``logits`` (N, L, V) at position t predicting ``labels`` (N, L) at t + 1 (m = 1 where the label is not
    ``ignore_index``: prompt, template and padding positions never count) and ``segments`` (N, L) the sequence
    s ∈ [0, ``n_sequences``) each position belongs to — one sequence per row when padded, several when packed.
    Computed in fp32 (:func:`~tether.core.stats.logprobs_from_logits`). Returns ``(S (n_sequences,),
    C (n_sequences,))``; ``S / C`` is the per-token mean (IPO's)."""
    target = labels[:, 1:]  # (N, L−1)
    mask = target != ignore_index
    picked = logprobs_from_logits(logits[:, :-1], target.clamp(min=0))  # (N, L−1); clamp: -100 is no index
    seg = segments[:, 1:][mask]
    sums = torch.zeros(n_sequences, dtype=picked.dtype, device=picked.device).index_add(0, seg, picked[mask])
    counts = torch.zeros(n_sequences, dtype=torch.long, device=picked.device).index_add(
        0, seg, torch.ones_like(seg))
    return sums, counts


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The DPO loss of a batch of pairs, as TRL's ``DPOTrainer.dpo_loss`` computes it (trl/trainer/dpo_trainer.py):

        h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))
        sigmoid (DPO, Rafailov et al. 2023 eq. 7; cDPO with ε > 0):  L = −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)
        ipo (Azar et al. 2023 eq. 17):                               L = (h − 1/(2β))²

    mean over the B pairs. All log-prob inputs are (B,): summed over the reply tokens for sigmoid; for ipo TRL
    passes per-token means (the sums divided by the reply lengths), which is the caller's to do. ``label_smoothing``
    ε is the share of labels assumed flipped (cDPO); sigmoid only.

    Stats (detached, TRL's names): ``rewards/chosen`` and ``rewards/rejected`` (mean implicit rewards
    β·(log π − log π_ref)), ``rewards/accuracies`` (share of pairs whose chosen reward is strictly higher),
    ``rewards/margins`` (mean chosen − rejected reward), ``logps/chosen``, ``logps/rejected`` (mean policy log-probs)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)  # (B,)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    with torch.no_grad():
        chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
        rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
        stats = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
                 "rewards/accuracies": (chosen_rewards > rejected_rewards).to(h.dtype).mean(),
                 "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                 "logps/chosen": chosen_logps.mean(), "logps/rejected": rejected_logps.mean()}
    return losses.mean(), {k: v.detach() for k, v in stats.items()}
