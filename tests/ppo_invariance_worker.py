"""Run one PPO update on a fixed batch of 8 rollouts and save the gradients the optimisers are about to use.

``python ppo_invariance_worker.py POLICY PROMPTS OUT.pt GRAD_ACCUMULATION [TRIM]`` in one process updates on all 8
rows; under ``accelerate launch --num_processes 2`` each process takes 4 of the same 8 rows (DDP, or FSDP2 with
``--config_file examples/accelerate/fsdp2.yaml``). The rows have
different response lengths on purpose (the processes hold different token counts), and the advantages are
fixed random numbers, so only the loss weighting can make the gradients differ. Used by tests/test_ppo.py.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import tiny_config  # noqa: E402

from tether.core.kl import kl_penalty  # noqa: E402
from tether.ppo import step as step_module  # noqa: E402
from tether.ppo.forward import critic_values, forward_response  # noqa: E402
from tether.ppo.records import Experience  # noqa: E402
from tether.ppo.setup import setup  # noqa: E402

ROWS = 8


def fixed_experience(run, cfg) -> Experience:
    """The same 8 rollouts in every process (same seed, same initial model), scored the usual way."""
    m = run.models
    torch.manual_seed(1234)
    rollout, _ = step_module.rollout_batch(m, cfg, run.data.eval_rows[:ROWS] or run.data.prompts.rows[:ROWS])
    mask = rollout.response_mask.float()
    with torch.no_grad():
        logprobs_old, _, hidden = forward_response(m.policy_model, rollout, cfg.generation.temperature,
                                                   need_hidden=m.critic_is_head)
        values_old = critic_values(m.critic, rollout, hidden)[:, :-1] * mask
    g = torch.Generator().manual_seed(7)
    advantages = torch.randn(mask.shape, generator=g) * mask
    returns = values_old + torch.randn(mask.shape, generator=g) * mask
    zeros = torch.zeros_like(mask)
    return Experience(rollout=rollout, logprobs_old=logprobs_old, logprobs_ref=logprobs_old, values_old=values_old,
                      last_values=zeros[:, 0], scores=zeros[:, 0], kl=kl_penalty(logprobs_old, logprobs_old) * mask,
                      rewards=zeros, advantages=advantages, returns=returns)


def main(policy: str, prompts: str, out: str, grad_accumulation: str, trim: str = "true") -> None:
    root = Path(out).parent / f"run-{Path(out).stem}"
    cfg = tiny_config(root, Path(policy), Path(prompts), generation__max_new_tokens=8, generation__min_new_tokens=0)
    run = setup(cfg)
    world, rank = run.processes.world_size, run.processes.rank
    cfg.batch_size, cfg.ppo.mini_batches, cfg.ppo.epochs = ROWS // world, 1, 1
    cfg.ppo.grad_accumulation = int(grad_accumulation)
    cfg.ppo.early_stop = False
    cfg.ppo.trim_padding = trim == "true"
    experience = fixed_experience(run, cfg)
    lengths = experience.rollout.lengths
    assert len(set(lengths.tolist())) > 1, "the rows need different lengths"
    mine = experience.select(torch.arange(rank * (ROWS // world), (rank + 1) * (ROWS // world)))
    grads = []
    clip = torch.nn.utils.clip_grad_norm_

    def record_then_clip(params, max_norm, *args, **kwargs):
        # Under FSDP2 a gradient is this process's shard (a DTensor): record the whole one (collective).
        grads.append([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.detach().clone()
                      for p in params])
        return clip(params, max_norm, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = record_then_clip
    step_module.ppo_epochs(run, cfg, mine, step=1)
    if rank == 0:
        torch.save({"grads": grads, "lengths": lengths}, out)
    run.processes.close()  # leave the process group before exit (tether.ppo.processes.Processes.close)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
