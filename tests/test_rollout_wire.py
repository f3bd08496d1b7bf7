"""What the weight sync sends and what a rollout process holds (issue 41, findings 1 and 4), without a launch: a bf16
run sends each tensor in the dtype the trainer computes it in (matmul weights as autocast casts the fp32 masters;
embeddings, norms and tied weights fp32), not its fp32 masters; a vLLM rollout process starts its engine from a
weightless skeleton on its own device, not beside a second, unused copy of the policy on device 0."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from tiny import make_llama_chat_dir, make_policy_dir, make_prompts_file, tiny_config

from tether.hf import load_causal_lm, load_tokenizer, upcast_trainable
from tether.rollout.layout import Layout
from tether.rollout.weights import manifest, policy_blocks, policy_weights


def bf16_full_finetune(path):
    """The policy of a bf16 full fine-tune as tether trains it: loaded in bf16, trainable weights upcast to fp32."""
    return upcast_trainable(load_causal_lm(path, "bf16"))


def matmul_names(model) -> set[str]:
    """Checkpoint names of the weights and biases of Linear/Conv1D layers not tied to an embedding, by hand."""
    from transformers.pytorch_utils import Conv1D

    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {f"{name}.{leaf}" for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))
            for leaf, p in m.named_parameters(recurse=False) if id(p) not in tied}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_sync_sends_what_the_trainer_computes_with(tmp_path, arch):
    """Every matmul weight goes in bf16, equal to its fp32 master cast as autocast casts it; everything else
    (embeddings, the tied head, norms) stays the fp32 master, bit for bit; the manifest says the same dtypes; fp32
    (or no compute dtype) sends the masters unchanged."""
    path = make_policy_dir(tmp_path) if arch == "gpt2" else make_llama_chat_dir(tmp_path)
    model = bf16_full_finetune(path)
    masters = model.state_dict()
    matmul = matmul_names(model)
    assert matmul and len(matmul) < len(masters)
    sent = policy_weights(model, compute_dtype=torch.bfloat16)
    assert set(sent) == set(masters)
    for name, tensor in sent.items():
        expected = masters[name].to(torch.bfloat16) if name in matmul else masters[name]
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
    plan = manifest(model, torch.bfloat16)
    assert {name: dtype for spec in plan for name, _, dtype, _ in spec} == {
        name: str(t.dtype).removeprefix("torch.") for name, t in sent.items()}
    unchanged = policy_weights(model, compute_dtype=torch.float32)
    assert all(unchanged[k].dtype == torch.float32 and torch.equal(unchanged[k], masters[k]) for k in masters)


class RecordingLink:
    """A link to one rollout process (trainer 0's side) that records what the weight broadcast sends."""

    def __init__(self):
        self.layout, self.weights_device, self.sent = Layout(world=2, rank=0, rollouts=1), torch.device("cpu"), []

    @contextmanager
    def guard(self, peers, doing, timed=True):
        yield

    def recv(self, tensor, source, tag, timeout=None):
        return tensor  # READY

    def send(self, tensor, to, tag):
        pass

    def broadcast(self, tensor):
        self.sent.append(tensor.clone())
        return tensor

    def close(self):
        pass


def test_a_bf16_runs_weight_sync_sends_half_the_bytes_of_its_masters(tmp_path):
    """The trainers' engine of a disaggregated bf16 run (made by make_engine from the run's config, as setup makes
    it) broadcasts 2 bytes per matmul parameter and 4 per other parameter (tied once): b·N_matmul + 4·N_rest, not the
    4·N of its fp32 masters."""
    from tether.rollout.engines import make_engine

    path = make_llama_chat_dir(tmp_path)
    cfg = tiny_config(tmp_path, path, make_prompts_file(tmp_path), model__dtype="bf16",
                      generation__rollout_processes=1)
    model = bf16_full_finetune(path)
    link = RecordingLink()
    engine = make_engine(cfg, model, load_tokenizer(path), SimpleNamespace(world_size=1, fsdp=None, link=link))
    try:
        engine.sync_weights(model)
    finally:
        engine.close()
    floats = [t for t in link.sent if t.is_floating_point()]
    matmul = matmul_names(model)
    unique = {id(p): (name, p) for name, p in model.named_parameters()}.values()  # tied weights once
    expected = sum(p.numel() * (2 if name in matmul else 4) for name, p in unique)
    assert sum(t.numel() * t.element_size() for t in floats) == expected
    assert expected < 0.8 * 4 * sum(p.numel() for _, p in unique)


def test_a_vllm_rollout_process_holds_no_transformers_copy_and_uses_its_own_device(tmp_path, monkeypatch):
    """The rollout process's vLLM engine is started from the policy's skeleton (meta device: no weights held besides
    vLLM's own) with the rollout process's device, and the policy's EOS ids; the engine asks vLLM for that device
    (vLLM's single-process executor otherwise takes cuda:0 for every rollout process of a node)."""
    import tether.rollout.vllm_engine as vllm_engine
    from tether.rollout.server import make_rollout_engine

    seen = {}

    class Recorder:
        def __init__(self, model, tokenizer, max_model_len, rows, seed, dtype=torch.float32, tp=1, sleep=True,
                     device=None):
            seen.update(model=model, device=device, sleep=sleep, rows=rows, dtype=dtype)

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorder)
    path = make_llama_chat_dir(tmp_path)
    cfg = tiny_config(tmp_path, path, make_prompts_file(tmp_path), model__dtype="bf16", generation__engine="vllm",
                      generation__rollout_processes=1)
    device = torch.device("cuda", 3)  # an object only: nothing is allocated on it here
    make_rollout_engine(cfg, Layout(world=5, rank=4, rollouts=2), device)
    assert seen["device"] == device and not seen["sleep"] and seen["dtype"] == torch.bfloat16
    assert all(p.is_meta for p in seen["model"].parameters())
    assert seen["rows"] == cfg.rows_per_step  # rank 4 serves trainer 1 only (trainers 0, 2 go to rank 3)
    assert seen["model"].generation_config.eos_token_id == load_causal_lm(path).generation_config.eos_token_id


def test_engine_placement_names_the_device_only_where_vllm_would_not_find_it():
    from tether.rollout.vllm_engine import engine_placement

    assert engine_placement(torch.device("cuda", 3), distributed=False) == {"device_ids": [3]}
    assert engine_placement(torch.device("cuda", 3), distributed=True) == {}  # external_launcher reads LOCAL_RANK
    assert engine_placement(torch.device("cpu"), distributed=False) == {}
