"""The pieces of the weight sync and of the disaggregated layout that need no launch (issue 28): the policy by
block with LoRA folded (against peft's own merge, bit for bit), the manifest a rollout process allocates from, the
launch layout's routing, the wire's packing, the transformers engine's own log-probs (the gap metric of a rollout
process without vLLM) with a long shared chat prefix, and the GPU memory share by hand. The multi-process parts
(FSDP2 shards gathered, the transfer, the runs) are tests/test_rollout_layouts.py."""

import copy

import pytest
import torch
from tiny import make_llama_chat_dir, make_policy_dir

from tether.errors import ConfigError
from tether.rollout.layout import Layout, launch_layout, trainers_world
from tether.rollout.remote import dtype_groups
from tether.rollout.server import left_padded
from tether.rollout.weights import block_prefixes, lora_delta, manifest, policy_blocks, policy_weights


def lora_policy(path, seed: int = 0, dtype: str = "fp32"):
    from tether.hf import apply_lora, load_causal_lm

    model = apply_lora(load_causal_lm(path, dtype), r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("arch,dtype", [("gpt2", "fp32"), ("llama", "fp32"), ("gpt2", "bf16")])
def test_policy_blocks_fold_lora_in_as_peft_merges_bit_for_bit(tmp_path, arch, dtype):
    """Block by block (each transformer block, then embeddings/norm/head), the LoRA policy's checkpoint tensors are
    exactly those of peft's merge_and_unload of a copy (GPT-2's Conv1D: ΔW transposed; a bf16 base with fp32
    adapters, as tether trains LoRA under --model-dtype bf16: summed in fp32, rounded once), every name once, each
    in its block; the training model is untouched."""
    path = make_policy_dir(tmp_path) if arch == "gpt2" else make_llama_chat_dir(tmp_path)
    model = lora_policy(path, dtype=dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    blocks = list(policy_blocks(model))
    prefixes = block_prefixes(model.get_base_model())
    assert len(blocks) == len(prefixes) + 1 == 3  # 2 transformer blocks, then the rest
    for prefix, block in zip(prefixes, blocks):
        assert block and all(name.startswith(prefix + ".") for name in block)
    assert not any(name.startswith(tuple(p + "." for p in prefixes)) for name in blocks[-1])
    names = [name for block in blocks for name in block]
    assert len(names) == len(set(names)) and set(names) == set(merged)
    weights = policy_weights(model)
    different = [k for k in merged if not torch.equal(weights[k], merged[k])]
    assert not different, different
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_is_peft_get_delta_weight(tmp_path, dtype):
    """ΔW = scale · B·A (transposed for Conv1D) equals peft's get_delta_weight to the bit, adapters in fp32 and in
    bf16 (which peft computes in fp32 on a CPU, as lora_delta does)."""
    model = lora_policy(make_policy_dir(tmp_path)).to(dtype)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_delta_weight")]
    assert layers and any(m.fan_in_fan_out for m in layers)
    for m in layers:
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        ours = lora_delta(a.detach(), b.detach(), m.scaling["default"], m.fan_in_fan_out)
        assert torch.equal(ours, m.get_delta_weight("default").detach())


def test_manifest_is_what_policy_blocks_yields(tmp_path):
    """What a rollout process allocates: per block the names, shapes and dtypes policy_blocks yields, in order, and
    a tied weight (GPT-2's lm_head, tied to the token embedding) marked so that it travels once."""
    model = lora_policy(make_policy_dir(tmp_path))
    plan = manifest(model)
    blocks = list(policy_blocks(model))
    assert [[e[0] for e in spec] for spec in plan] == [list(block) for block in blocks]
    for spec, block in zip(plan, blocks):
        for name, shape, dtype, _ in spec:
            assert tuple(block[name].shape) == shape and str(block[name].dtype) == f"torch.{dtype}"
    tied = {name: to for spec in plan for name, _, _, to in spec if to}
    assert tied == {"lm_head.weight": "transformer.wte.weight"}
    sent = [e[0] for spec in plan for _, entries in dtype_groups(spec) for e in entries]
    assert "lm_head.weight" not in sent and "transformer.wte.weight" in sent


def test_layout_routes_trainers_to_rollout_processes_by_hand(monkeypatch):
    """5 processes, --rollout-processes 2: ranks 0-2 train, 3-4 generate; trainers go round robin (0 -> 3,
    1 -> 4, 2 -> 3); accelerate sees a world of 3; R >= N is one line."""
    layout = Layout(world=5, rank=4, rollouts=2)
    assert layout.trainers == 3 and layout.is_rollout and not Layout(5, 2, 2).is_rollout
    assert [layout.rollout_of(t) for t in range(3)] == [3, 4, 3]
    assert layout.trainers_of(3) == [0, 2] and layout.trainers_of(4) == [1]
    monkeypatch.setenv("WORLD_SIZE", "5")
    trainers_world(layout)
    import os

    assert os.environ["WORLD_SIZE"] == "3"
    cfg = type("Cfg", (), {"generation": type("G", (), {"rollout_processes": 3})()})()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="--rollout-processes 3: this launch has 3 process") as e:
        launch_layout(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("world, rollouts, ok", [(3, 1, True), (4, 2, True), (5, 2, True), (3, 2, False),
                                                  (5, 3, False), (2, 1, True)])
def test_every_rollout_process_serves_a_trainer(monkeypatch, world, rollouts, ok):
    """Round robin gives rollout process r the trainers t with t mod R = r − (N − R): with R > N − R the last
    2R − N of them would serve none (and died at step 1 on ``requests[0]``, an IndexError): refused in one line."""
    cfg = type("Cfg", (), {"generation": type("G", (), {"rollout_processes": rollouts})()})()
    monkeypatch.setenv("WORLD_SIZE", str(world))
    if ok:
        layout = launch_layout(cfg)
        assert all(layout.trainers_of(r) for r in range(layout.trainers, world))
        return
    with pytest.raises(ConfigError, match=f"--rollout-processes {rollouts}: .*serve no trainer") as e:
        launch_layout(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("votes, agreed", [(("nccl", "nccl", "nccl"), "nccl"), (("nccl", "gloo", "nccl"), "gloo"),
                                             (("gloo", "gloo", "gloo"), "gloo")])
def test_the_weights_group_members_agree_on_one_backend(votes, agreed):
    """Trainer 0 and 2 rollout processes, each knowing only what it can do (a node with fewer GPUs than processes can
    do gloo only): every member builds the weights group with the same backend, NCCL only when all can. Three
    members on a real TCPStore, each in its own thread (a member waits for the others' votes)."""
    import threading
    from datetime import timedelta

    from tether.rollout.layout import agreed_backend

    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=30))
    got = [None] * len(votes)

    def member(i):
        store = torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
        got[i] = agreed_backend(store, "tether-rollout/0/weights-backend", i, len(votes), votes[i])

    threads = [threading.Thread(target=member, args=(i,)) for i in reversed(range(len(votes)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == [agreed] * len(votes)


def test_wire_packing_by_hand():
    """A block's manifest travels as one flat buffer per dtype (first-appearance order, tied names left out); several
    trainers' left-padded prompts become one left-padded batch."""
    spec = [("a", (2,), "float32", ""), ("b", (3,), "bfloat16", ""), ("c", (1,), "float32", ""),
            ("d", (2,), "float32", "a")]
    assert [(dt, [e[0] for e in es]) for dt, es in dtype_groups(spec)] == [(torch.float32, ["a", "c"]),
                                                                           (torch.bfloat16, ["b"])]
    query, mask = left_padded([torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[4]])],
                              [torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[1]])], pad_id=0)
    assert query.tolist() == [[0, 5, 6], [7, 8, 9], [0, 0, 4]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize("min_new_tokens", [0, 4])
def test_transformers_sampler_logprobs_are_the_trainers(tmp_path, min_new_tokens):
    """A rollout process without vLLM reports the sampled tokens' log-probs from generate's processed scores: equal
    to the trainer's forward (softmax(logits / T), EOS masked under min_new_tokens) to 1e-4 in fp32, with ~200-token
    chat prompts sharing a 161-token system turn; 0 on padding."""
    from tether.hf import load_causal_lm, load_tokenizer
    from tether.ppo.forward import forward_response
    from tether.rollout.sampling import encode_prompts, generate

    path = make_llama_chat_dir(tmp_path)
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    system = " ".join(["you are a careful adder"] * 7)
    query, mask = encode_prompts(tokenizer, ["12+30=", "4+5=", "7+77=", "1+1="], 240, True, system_prompt=system)
    assert query.shape[1] > 190
    torch.manual_seed(0)
    rollout = generate(model, tokenizer, query, mask, 10, 0.7, min_new_tokens=min_new_tokens, sampler_logprobs=True)
    with torch.no_grad():
        trainer, _, _ = forward_response(model, rollout, 0.7)
    valid = rollout.response_mask.bool()
    assert float((rollout.logprobs_sampler - trainer).abs()[valid].max()) < 1e-4
    assert (rollout.logprobs_sampler[~valid] == 0).all() and (rollout.logprobs_sampler[valid] < 0).all()


@pytest.mark.parametrize("temperature, greedy, min_new_tokens", [(0.7, False, 0), (1.0, False, 3), (1.3, False, 0),
                                                                 (1.0, True, 0)])
def test_streamed_sampler_logprobs_equal_generates_own_scores(tmp_path, temperature, greedy, min_new_tokens):
    """The log-probs the engine records one step at a time equal, bit for bit, the obvious way: ``generate``'s
    ``output_scores`` (every position's processed (B, V) scores kept), log-softmaxed and picked at the sampled tokens;
    the same seed samples the same tokens with the recorder as without."""
    from transformers import GenerationConfig

    from tether.hf import load_causal_lm, load_tokenizer
    from tether.rollout.sampling import checkpoint_defaults_off, encode_prompts, generate, sampling_config

    path = make_policy_dir(tmp_path)
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    query, mask = encode_prompts(tokenizer, ["12+30=", "4+5=", "7+77=", "1+1=", "99+1="], 16, False)
    torch.manual_seed(5)
    ours = generate(model, tokenizer, query, mask, 9, temperature, greedy=greedy, min_new_tokens=min_new_tokens,
                    sampler_logprobs=True)
    config = sampling_config(tokenizer, model, 9, temperature, greedy, min_new_tokens)
    config = GenerationConfig(**{**config.to_dict(), "output_scores": True, "return_dict_in_generate": True})
    torch.manual_seed(5)
    with torch.no_grad(), checkpoint_defaults_off(model):
        out = model.generate(input_ids=query, attention_mask=mask, generation_config=config)
    valid = ours.response_mask.bool()
    assert torch.equal(out.sequences[:, query.shape[1]:][valid], ours.response[valid])
    obvious = torch.stack(out.scores, dim=1).float().log_softmax(-1).gather(-1, out.sequences[:, query.shape[1]:, None])
    assert torch.equal(ours.logprobs_sampler[valid], obvious.squeeze(-1)[valid])
    assert (ours.logprobs_sampler[~valid] == 0).all() and valid.sum() > 20


def test_gpu_memory_share_by_hand():
    """The engine's share of an 80 GB device for 14 GB of weights and 4 GB of KV cache: (14 + 4)·1.2 + 1 GiB over
    80 GB; capped at vLLM's 0.9 when more is asked."""
    from tether.diagnostics.engine_plan import gpu_memory_share

    gb = 10**9
    assert gpu_memory_share(14 * gb, 4 * gb, 80 * gb) == pytest.approx((18 * 1.2 * gb + 2**30) / (80 * gb))
    assert gpu_memory_share(70 * gb, 10 * gb, 80 * gb) == 0.9
