"""Worker of ``tests/test_rollout_layouts.py``'s transfer test, launched as 3 CPU processes (gloo):

    accelerate launch --num_processes 3 weight_transfer_worker.py OUT GPT2_DIR LLAMA_DIR

Ranks 0-1 are trainers holding an FSDP2-sharded policy, rank 2 a rollout process (the disaggregated layout's
``--rollout-processes 1``). For each case — a Llama full fine-tune (tied embeddings, rows split unevenly over the
shards) and a GPT-2 with a LoRA adapter whose B is not zero (Conv1D: ΔW transposed) — trainer 0 sends the weights
(:func:`tether.rollout.remote.send_weights`, the other trainer taking part in the all-gathers) and the rollout process
receives them (:func:`tether.rollout.remote.receive_weights`). Written to OUT for the test to compare:
``CASE-received.pt`` (what arrived) and ``CASE-trainer.pt`` (the trainer's weights, merged: gathered by torch's own
``get_model_state_dict``, loaded into an unsharded copy, LoRA folded by peft's ``merge_and_unload``). A third case,
``llama_bf16``, is a bf16 full fine-tune (fp32 masters of a bf16 checkpoint) sent with the run's compute dtype: its
Linear weights travel in bf16, cast from the masters before the all-gather, the rest in fp32.
"""

import sys
from pathlib import Path

import torch

from tether.rollout.layout import Layout, Link, trainers_world
from tether.rollout.remote import receive_weights, send_weights
from tether.rollout.weights import SyncSeconds, policy_blocks


def build(case: str, path: str):
    from tether.hf import apply_lora, load_causal_lm

    if case == "llama_bf16":
        from tether.hf import upcast_trainable

        return upcast_trainable(load_causal_lm(path, "bf16"))
    model = load_causal_lm(path)
    if case == "gpt2_lora":
        model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)  # the same adapter on every trainer
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
    return model


def trainer_weights(case: str, path: str, sharded) -> dict[str, torch.Tensor]:
    """The trainer's weights as a checkpoint names them, from a path independent of tether's gather."""
    from tether.sharding import full_model_state

    state = full_model_state(sharded)  # collective; the full tensors on process 0
    if torch.distributed.get_rank() != 0:
        return {}
    plain = build(case, path)
    plain.load_state_dict(state, strict=True)
    if case == "gpt2_lora":
        plain = plain.merge_and_unload()
    linear = {f"{n}.{leaf}" for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)
              for leaf, p in m.named_parameters(recurse=False) if p is not plain.get_input_embeddings().weight}
    bf16 = case == "llama_bf16"  # what autocast computes with: Linear weights cast to bf16, the rest fp32 masters
    return {k: v.to(torch.bfloat16) if bf16 and k in linear else v.clone() for k, v in plain.state_dict().items()}


def main() -> None:
    out, paths = Path(sys.argv[1]), {"gpt2_lora": sys.argv[2], "llama_full": sys.argv[3], "llama_bf16": sys.argv[3]}
    import os

    layout = Layout(int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), rollouts=1)
    if not layout.is_rollout:
        trainers_world(layout)
        torch.distributed.init_process_group("gloo")
    link = Link(layout, timeout_minutes=3)
    for case in ("llama_full", "gpt2_lora", "llama_bf16"):
        dtype = torch.bfloat16 if case == "llama_bf16" else None
        if layout.is_rollout:
            received = {name: t.clone() for name, t in receive_weights(link)}
            torch.save(received, out / f"{case}-received.pt")
            continue
        from tether.sharding import FsdpSettings, shard

        model = shard(build(case, paths[case]), FsdpSettings(), torch.device("cpu"))
        if layout.rank == 0:
            send_weights(link, model, SyncSeconds(), dtype)
        else:
            for _ in policy_blocks(model, compute_dtype=dtype):
                pass
        reference = trainer_weights(case, paths[case], model)
        if layout.rank == 0:
            torch.save(reference, out / f"{case}-trainer.pt")
    link.close()
    if not layout.is_rollout:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
