"""What a pipeline's reward model learned, probed on what PPO will show it: the policy's own sampled replies to the
training problems (recipe 5 found a reward model at chance on held-out problems that still ranked these right,
having memorised which answers are right on the problems it was trained on — enough to teach the policy a while).

For each problem of the pairs (its distinct right replies, the pairs' chosen side, and wrong ones, the rejected
side): the within-problem AUC of the reward model's scores (:func:`tether.core.ranking.pairwise_auc`), and whether
its top-scored reply is a right one. Reported: the mean AUC over problems and the top-1 share.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tether.core.ranking import pairwise_auc


def replies_by_problem(pair_files: list[str], limit: int) -> list[tuple[str, list[str], list[str]]]:
    """``(prompt, right replies, wrong replies)`` of the first ``limit`` problems of the pair files, distinct texts."""
    found: dict[str, tuple[dict, dict]] = {}
    for path in pair_files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row["prompt"] not in found and len(found) >= limit:
                continue
            right, wrong = found.setdefault(row["prompt"], ({}, {}))
            right[row["chosen"]], wrong[row["rejected"]] = None, None
    return [(prompt, list(right), list(wrong)) for prompt, (right, wrong) in found.items()]


@torch.no_grad()
def probe_reward_model(rm_dir: Path, pair_files: list[str], limit: int = 64) -> dict:
    """``{"problems", "mean_auc", "top1_right"}`` on the first ``limit`` problems of ``pair_files``."""
    from tether.rm.model import RewardModel

    model = RewardModel.from_pretrained(rm_dir)
    aucs, top_right = [], 0
    for prompt, right, wrong in replies_by_problem(pair_files, limit):
        texts = right + wrong
        scores = model.score([prompt] * len(texts), texts).float().cpu()  # (len(texts),)
        aucs.append(pairwise_auc(scores[:len(right)], scores[len(right):]))
        top_right += int(scores.argmax()) < len(right)
    n = len(aucs)
    return {"problems": n, "mean_auc": sum(aucs) / n if n else None, "top1_right": top_right / n if n else None}
