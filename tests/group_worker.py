"""Critic-free advantages and group metrics of fixed scores, on 1 process or split over several (SPEC B17, C4).

``python group_worker.py OUT.pt`` computes them on all 8 groups of 4 rows; under ``accelerate launch
--num_processes 2`` each process holds 4 of the same groups (rows of a group are never split: each process
samples its own prompts' groups) and the pooled results are gathered. Response lengths differ from row to row,
so the per-process token counts differ and only a correct cross-process whitening (REINFORCE++) and pooling
(the group metrics) give the one-process numbers. Used by tests/test_group_ppo.py.
"""

import sys

import torch

from tether.core.group import CRITIC_FREE, critic_free_advantages

GROUPS, K, T = 8, 4, 5


def fixed_batch():
    """Scores (B,) with flat, solved, unsolved and spread groups, per-token KL (B, T), ragged masks, one dropped row."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (GROUPS * K,), generator=g).float()
    scores[:K] = 2.0  # a solved group (2 is the top score)
    scores[K:2 * K] = 0.0  # an unsolved one
    kl = torch.rand(GROUPS * K, T, generator=g)
    lengths = torch.randint(1, T + 1, (GROUPS * K,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    valid = torch.ones(GROUPS * K, dtype=torch.bool)
    valid[13] = False
    return scores, kl * mask, mask * valid[:, None], valid


def main(out: str) -> None:
    from accelerate import Accelerator

    from tether.ppo.metrics import group_metrics
    from tether.ppo.processes import Processes

    accelerator = Accelerator(cpu=True)
    p = Processes(accelerator, accelerator.device, accelerator.num_processes, accelerator.process_index)
    scores, kl, mask, valid = fixed_batch()
    rows = torch.arange(len(scores)).reshape(p.world_size, -1)[p.rank]  # this process's groups, whole
    scores, kl, mask, valid = scores[rows], kl[rows], mask[rows], valid[rows]
    result = {}
    for estimator in CRITIC_FREE:
        advantages, returns = critic_free_advantages(estimator, scores, kl, 0.1, mask, K, 1.0, 1e-6, valid,
                                                     distributed=p.world_size > 1)
        result[estimator] = (p.all_gather(advantages), p.all_gather(returns))
    result["metrics"] = group_metrics(p, scores, valid, K)
    if p.is_main:
        torch.save(result, out)
    p.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
