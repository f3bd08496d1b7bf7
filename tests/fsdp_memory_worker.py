"""Set up a bf16 PPO run under FSDP2, take one PPO step with one optimizer update, and write the bytes this
process allocates for the trained models' weights, gradients and AdamW moments, for the frozen reference, and for
the whole policy that generation gathers (FSDP2's unshard, as the transformers engine does it). Used by
tests/test_plan.py.

``accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 fsdp_memory_worker.py
POLICY PROMPTS OUT.json``: the policy is a full fine-tune (fp32 masters of a bf16 checkpoint), the critic a
separate LoRA critic (bf16 base, fp32 adapters and value head). Bytes are counted two ways per tensor: the
storage it lives in (what is allocated: FSDP2 keeps each parameter shard, and the reduce-scattered gradients,
padded to ceil(d0 / G) rows; storages shared by several tensors are counted once), and its local shard
(``DTensor.to_local()``, unpadded).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import tiny_config  # noqa: E402

from tether.ppo.setup import setup  # noqa: E402
from tether.ppo.step import ppo_step  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measure(tensors: list[torch.Tensor]) -> dict:
    """Allocated bytes (distinct storages) and local-shard bytes of ``tensors``."""
    storages, shard = {}, 0
    for t in map(local, tensors):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        shard += t.numel() * t.element_size()
    return {"allocated": sum(storages.values()), "local": shard}


def model_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    moments = [state[k] for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} for state in optimizer.state.values())
    return {"weights": measure(params), "grads": measure([p.grad for p in params if p.grad is not None]),
            "adam": measure(moments),
            "dtypes": sorted({str(local(p).dtype) for p in params if p.requires_grad}),
            "trainable": sum(p.numel() for p in params if p.requires_grad)}


def main(policy: str, prompts: str, out: str) -> None:
    cfg = tiny_config(Path(out).parent / "run", Path(policy), Path(prompts), model__dtype="bf16",
                      critic__kind="separate", critic__model=policy, critic__lora_r=4, batch_size=4,
                      ppo__epochs=1, ppo__mini_batches=1, ppo__early_stop=False, steps=1)
    run = setup(cfg)
    assert run.models.fsdp is not None and run.processes.world_size == 2
    metrics = ppo_step(run, cfg, 1)
    assert metrics["ppo/updates"] == 1  # one optimizer step: gradients and Adam moments all exist now
    from tether.sharding import gathered

    with gathered(run.models.policy_model, run.models.fsdp):  # the parameters are the unsharded ones meanwhile
        generation = measure(list(run.models.policy_model.parameters()))
        assert not any(hasattr(p, "to_local") for p in run.models.policy_model.parameters())
    mine = {"policy": model_bytes(run.models.policy_model, run.optim.policy_optimizer),
            "critic": model_bytes(run.models.critic, run.optim.critic_optimizer),
            "reference": measure(list(run.models.policy.reference.parameters())), "gathered": generation}
    every = run.processes.gather_objects(mine)
    if run.processes.is_main:
        Path(out).write_text(json.dumps(every, indent=1), encoding="utf-8")
    run.processes.close()  # leave the process group before exit (tether.ppo.processes.Processes.close)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
