"""Memory planner (SPEC C1): the reference's 7B figures exactly, and planned bytes equal to what torch,
transformers and peft actually allocate for tiny models built from configs."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from tether.cli import main
from tether.diagnostics.plan import PlanConfig, kv_cache_bytes, levers, model_static, plan
from tether.diagnostics.shapes import config_shape, lora_params, lora_target_modules, preset_shape

# ---------------------------------------------------------------- the reference's numbers (000 §C.1)


def test_7b_bf16_full_static_is_the_reference_table():
    result = plan(preset_shape("7b"), PlanConfig())
    st = result["static"]
    for role in ("actor", "critic"):
        assert (st[role]["weights"], st[role]["grads"], st[role]["adam"], st[role]["master"]) == \
            (14 * 10**9, 14 * 10**9, 56 * 10**9, 28 * 10**9)
        assert st[role]["total"] == 112 * 10**9
    assert st["reference"]["total"] == st["RM"]["total"] == 14 * 10**9
    assert result["static_total"] == 252 * 10**9


def test_kv_cache_reference_figures():
    shape = preset_shape("7b")  # L=32, n_h = n_kv = 32, d_h = 128
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 32, 128)
    small = kv_cache_bytes(shape, 8, 1024, 2)
    assert small == 2 * 32 * 8 * 1024 * 32 * 128 * 2 and round(small / 1e9, 1) == 4.3
    big = kv_cache_bytes(shape, 32, 2048, 2)
    assert round(big / 1e9) == 34
    # the plan puts it on the actor's rollout row, with S = prompt + response
    result = plan(shape, PlanConfig(batch_size=32, prompt_length=1536, response_length=512))
    assert result["phases"]["rollout"]["actor"]["kv_cache"] == big
    assert result["phases"]["train"]["actor"]["kv_cache"] == 0


def test_kv_cache_uses_kv_heads_under_gqa():
    shape = preset_shape("70b")  # 64 query heads, 8 KV heads
    assert kv_cache_bytes(shape, 1, 1000, 2) == 2 * 80 * 1000 * 8 * 128 * 2


@pytest.mark.parametrize("name, published", [
    ("7b", 6_738_415_616), ("13b", 13_015_864_320), ("70b", 68_976_648_192),
    ("8b", 8_030_261_248), ("0.5b", 494_032_768)])
def test_preset_shapes_give_the_published_parameter_counts(name, published):
    shape = preset_shape(name)
    assert shape.lm_params == published
    assert shape.nominal_params == int(float(name[:-1]) * 1e9)


# ---------------------------------------------------------------- parameter counts vs transformers

CONFIGS = {
    "llama_gqa_untied": ("LlamaConfig", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                             num_key_value_heads=2, intermediate_size=80, vocab_size=101,
                                             tie_word_embeddings=False)),
    "llama_tied_biases": ("LlamaConfig", dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                              num_key_value_heads=4, intermediate_size=64, vocab_size=97,
                                              tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "gpt2_tied": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=99)),
    "gpt2_untied": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=99,
                                       n_inner=72, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=103,
                                  tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=103)),
    "mistral": ("MistralConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, intermediate_size=64, vocab_size=103)),
}


def _config(name):
    import transformers

    cls, kw = CONFIGS[name]
    return getattr(transformers, cls)(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_counts_match_transformers(name, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = _config(name)
    config.save_pretrained(tmp_path)
    shape = config_shape(tmp_path / "config.json")
    torch.manual_seed(0)
    assert shape.lm_params == _numel(AutoModelForCausalLM.from_config(config))
    assert shape.backbone_params == _numel(AutoModel.from_config(config))
    cfg = PlanConfig(model=str(tmp_path), dtype="fp32")
    rm_config = copy.deepcopy(config)
    rm_config.num_labels = 1
    rm = AutoModelForSequenceClassification.from_config(rm_config)
    assert model_static(shape, cfg, "RM")["frozen"] == _numel(rm)  # backbone + score Linear(d, 1, bias=False)
    d = shape.hidden
    heads = {"linear": torch.nn.Linear(d, 1),
             "mlp": torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, 1))}
    for kind, head in heads.items():
        critic = _numel(AutoModel.from_config(config)) + _numel(head)
        assert model_static(shape, dataclasses.replace(cfg, value_head=kind), "critic")["trainable"] == critic
    assert model_static(shape, cfg, "reference")["frozen"] == shape.lm_params
    # Every tensor's (dim 0, numel) — what FSDP2 shards — and whether autocast casts it (a Linear/Conv1D
    # weight or bias not tied to an embedding: what the bf16 reference twin keeps in bf16).
    from transformers.pytorch_utils import Conv1D

    for tensors, model in ((shape.lm_tensors, AutoModelForCausalLM.from_config(config)),
                           (shape.backbone_tensors, AutoModel.from_config(config))):
        owners: dict[int, list] = {}
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(module)
        real = [(p.shape[0], p.numel(), all(isinstance(o, (torch.nn.Linear, Conv1D)) for o in owners[id(p)]))
                for p in model.parameters()]
        assert sorted(tensors) == sorted(real)


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_gqa_untied"])
def test_bf16_reference_twin_bytes_equal_allocation(name, tmp_path):
    """A full fine-tune's bf16 reference is tether's frozen twin: matmul weights bf16, embeddings and norms fp32."""
    from transformers import AutoModelForCausalLM

    from tether.ppo.models import frozen_twin

    config = _config(name)
    config.save_pretrained(tmp_path)
    twin = frozen_twin(AutoModelForCausalLM.from_config(config).to(torch.bfloat16))
    planned = model_static(config_shape(tmp_path), PlanConfig(model=str(tmp_path), dtype="bf16"), "reference")
    assert planned["weights"] == _bytes(twin.parameters()) > 2 * _numel(twin)


# ---------------------------------------------------------------- planned bytes vs allocated bytes


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adam_bytes(opt) -> tuple[int, int]:
    """(bytes of exp_avg + exp_avg_sq, number of 'step' scalars); fails on any other state."""
    moments, steps = 0, 0
    for state in opt.state.values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].numel() == 1 and state["step"].element_size() == 4
        moments += _bytes([state["exp_avg"], state["exp_avg_sq"]])
        steps += 1
    return moments, steps


def _lm_step(model, vocab):
    ids = torch.randint(3, vocab, (2, 6))
    model(input_ids=ids, labels=ids).loss.float().backward()


@pytest.mark.parametrize("name", ["llama_gqa_untied", "gpt2_tied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_finetune_bytes_equal_allocation(name, dtype, tmp_path):
    """fp32: weights, grads, Adam; bf16: bf16 weights and grads, fp32 master copy and Adam (Apex-O2 style)."""
    from transformers import AutoModelForCausalLM

    config = _config(name)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())
    if dtype == "fp32":
        opt = torch.optim.AdamW(params, lr=1e-3)
        _lm_step(model, config.vocab_size)
        opt.step()
        master = []
    else:
        model.to(torch.bfloat16)
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        opt = torch.optim.AdamW(master, lr=1e-3)
        _lm_step(model, config.vocab_size)
        for m, p in zip(master, params):
            m.grad = p.grad.float()  # transient fp32 copy, freed after the step
        opt.step()
        for m, p in zip(master, params):
            m.grad = None
            p.data.copy_(m.data)
    planned = model_static(config_shape(tmp_path), PlanConfig(model=str(tmp_path), dtype=dtype), "actor")
    moments, steps = _adam_bytes(opt)
    assert planned["weights"] == _bytes(params)
    assert planned["grads"] == _bytes(p.grad for p in params)
    assert planned["adam"] == moments
    assert planned["master"] == _bytes(master)
    assert steps == len(params)  # the uncounted 'step' scalars: 4 bytes per parameter tensor


@pytest.mark.parametrize("name, targets, dtype", [
    ("llama_gqa_untied", "attn", "bf16"), ("llama_gqa_untied", "all", "fp32"), ("gpt2_tied", "attn", "bf16"),
    ("qwen2", "all", "bf16")])
def test_lora_actor_bytes_equal_allocation_and_peft_counts(name, targets, dtype, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = _config(name)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    shape = config_shape(tmp_path)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(shape.family, targets),
                      fan_in_fan_out=shape.family == "gpt2")
    model = get_peft_model(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trainable)  # peft's autocast_adapter_dtype (SPEC A6)
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    _lm_step(model, config.vocab_size)
    opt.step()
    cfg = PlanConfig(model=str(tmp_path), dtype=dtype, lora_r=4, lora_targets=targets)
    planned = model_static(shape, cfg, "actor")
    assert planned["trainable"] == lora_params(shape, 4, targets) == model.get_nb_trainable_parameters()[0]
    assert planned["weights"] == _bytes(model.parameters())
    assert planned["grads"] == _bytes(p.grad for p in trainable)
    assert planned["adam"] == _adam_bytes(opt)[0]
    assert planned["master"] == 0
    assert model_static(shape, cfg, "reference")["weights"] == 0  # same base, adapter disabled


@pytest.mark.parametrize("name", ["llama_gqa_untied", "gpt2_tied"])
def test_lora_all_targets_equal_peft_all_linear(name, tmp_path):
    """--lora-targets all is peft's "all-linear" (every Linear/Conv1D but the LM head), tether's PPO default."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = _config(name)
    config.save_pretrained(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=3, target_modules="all-linear"))
    assert lora_params(config_shape(tmp_path), 3, "all") == model.get_nb_trainable_parameters()[0]


def test_lora_critic_bytes_equal_allocation(tmp_path):
    """Separate critic: LoRA backbone (bf16 base, fp32 adapters) + fp32 value head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    config = _config("llama_gqa_untied")
    config.save_pretrained(tmp_path)
    shape = config_shape(tmp_path)
    torch.manual_seed(0)
    body = get_peft_model(AutoModel.from_config(config).to(torch.bfloat16),
                          LoraConfig(r=8, target_modules=lora_target_modules("llama")))
    head = torch.nn.Sequential(torch.nn.Linear(shape.hidden, shape.hidden), torch.nn.Tanh(),
                               torch.nn.Linear(shape.hidden, 1))  # the default mlp value head
    trainable = [p for p in body.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    hidden = body(input_ids=torch.randint(3, config.vocab_size, (2, 5))).last_hidden_state  # (B, T, d)
    head(hidden.float()).pow(2).mean().backward()
    opt.step()
    planned = model_static(shape, PlanConfig(model=str(tmp_path), lora_r=8), "critic")
    assert planned["weights"] == _bytes(list(body.parameters()) + list(head.parameters()))
    assert planned["grads"] == _bytes(p.grad for p in trainable)
    assert planned["adam"] == _adam_bytes(opt)[0]


def test_fsdp2_two_processes_allocate_the_planned_bytes_per_process(tmp_path):
    """ZeRO-3 over 2 GPUs is what FSDP2 on 2 processes allocates, exactly: a bf16 full fine-tune's policy
    (fp32 masters) and a separate LoRA critic (bf16 base, fp32 adapters and MLP head) after one PPO update
    (tests/fsdp_memory_worker.py). The tiny GPT-2's vocabulary of 43 rows and the head's Linear(d, 1) do not
    split evenly: FSDP2 pads each tensor to ceil(d0 / 2) rows, which the plan counts. The frozen reference (the
    bf16 twin) is whole on each process, and generation gathers the whole fp32 policy, padded: the plan's rollout
    phase counts both (issue 41; it had sharded the reference and left the gathered policy out of its verdict)."""
    from pathlib import Path

    from launcher import accelerate_launch
    from tiny import make_policy_dir, make_prompts_file

    repo = Path(__file__).resolve().parents[1]
    policy, prompts, out = make_policy_dir(tmp_path), make_prompts_file(tmp_path), tmp_path / "bytes.json"
    # tests/launcher.py: a free port; a failure raises with each process's own stderr
    accelerate_launch([str(repo / "tests" / "fsdp_memory_worker.py"), str(policy), str(prompts), str(out)],
                      config="fsdp2.yaml")
    ranks = json.loads(out.read_text())
    shape = config_shape(policy)
    cfg = PlanConfig(model=str(policy), dtype="bf16", zero=3, gpus=2, critic="separate", critic_lora_r=4,
                     lora_targets="all", value_head="mlp")
    static = plan(shape, cfg)["static"]
    assert shape.vocab % 2 == 1  # uneven shards on purpose
    for role, model in (("actor", "policy"), ("critic", "critic")):
        planned, measured = static[role], ranks[0][model]
        assert measured["dtypes"] == ["torch.float32"]  # everything that trains holds fp32 (C5)
        assert measured["trainable"] == planned["trainable_params"]
        allocated = {k: measured[k]["allocated"] for k in ("weights", "grads", "adam")}
        # tether trains fp32 weights with fp32 gradients where the plan's table has bf16 weights and
        # gradients plus an fp32 master: the same bytes, split 4 + 4 instead of 2 + 2 + 4.
        assert allocated["weights"] + allocated["grads"] == planned["weights"] + planned["grads"] + planned["master"]
        assert allocated["adam"] == planned["adam"]
        assert sum(allocated.values()) == planned["total"]
        if role == "critic":  # LoRA: no master; weights = bf16 base + fp32 adapters and head, each padded
            assert (allocated["weights"], allocated["grads"]) == (planned["weights"], planned["grads"])
        # Process 0 holds the first, full chunk of every tensor; process 1 allocates the same padded
        # parameter and gradient shards, and Adam moments only for its own (fewer) rows.
        other = ranks[1][model]
        assert other["weights"]["allocated"] == measured["weights"]["allocated"]
        assert other["grads"]["allocated"] == measured["grads"]["allocated"]
        assert other["adam"]["allocated"] < measured["adam"]["allocated"] == measured["adam"]["local"]
        assert other["adam"]["local"] + measured["adam"]["local"] == 8 * planned["trainable_params"]
        print(f"{role}: planned per GPU {[planned[k] for k in ('weights', 'grads', 'master', 'adam')]} = "
              f"{planned['total']} B; allocated (weights, grads, adam) rank 0 {list(allocated.values())}, rank 1 "
              f"{[other[k]['allocated'] for k in ('weights', 'grads', 'adam')]}")
    planned = plan(shape, cfg)
    for rank in ranks:
        assert rank["reference"]["allocated"] == planned["static"]["reference"]["weights"]
        assert rank["gathered"]["allocated"] == planned["phases"]["rollout"]["engine"]["weights"]
    assert planned["phases"]["rollout"]["reference"]["weights"] == planned["static"]["reference"]["weights"]
    print(f"reference: planned {planned['static']['reference']['weights']} B per GPU, allocated "
          f"{[r['reference']['allocated'] for r in ranks]}; gathered for generation: planned "
          f"{planned['phases']['rollout']['engine']['weights']} B, allocated {[r['gathered']['allocated'] for r in ranks]}")


# ---------------------------------------------------------------- sharding, phases, activations, levers


def test_zero_stages_shard_by_hand():
    shape, G = preset_shape("7b"), 8
    st = {z: plan(shape, PlanConfig(zero=z, gpus=G))["static"] for z in range(4)}
    assert [st[z]["actor"]["adam"] for z in range(4)] == [56e9, 7e9, 7e9, 7e9]
    assert [st[z]["actor"]["master"] for z in range(4)] == [28e9, 3.5e9, 3.5e9, 3.5e9]
    assert [st[z]["actor"]["grads"] for z in range(4)] == [14e9, 14e9, 1.75e9, 1.75e9]
    assert [st[z]["actor"]["weights"] for z in range(4)] == [14e9, 14e9, 14e9, 1.75e9]
    # tether's FSDP2 shards what trains: the frozen RM (and reference) stay whole on every GPU at any stage
    assert [st[z]["RM"]["weights"] for z in range(4)] == [14e9] * 4
    assert [st[z]["reference"]["weights"] for z in range(4)] == [14e9] * 4
    assert st[3]["critic"]["total"] == 14e9


def test_phases_gradients_offload_and_critic_head():
    shape = preset_shape("7b")
    p = plan(shape, PlanConfig(offload_ref=True))
    assert p["phases"]["rollout"]["actor"]["grads"] == 0 and p["phases"]["train"]["actor"]["grads"] == 14e9
    assert p["phases"]["train"]["reference"]["total"] == 0 and p["static"]["reference"]["cpu_bytes"] == 14e9
    assert p["phases"]["train"]["RM"]["weights"] == 14e9
    head = plan(shape, PlanConfig(critic="head", value_head="linear", dtype="fp32"))["static"]["critic"]
    assert head["trainable_params"] == 4097 and head["total"] == 4097 * 16
    mlp = plan(shape, PlanConfig(critic="head", lora_r=8))["static"]["critic"]  # LoRA: head in fp32
    assert mlp["trainable_params"] == 4096 * 4096 + 2 * 4096 + 1 and mlp["total"] == mlp["trainable_params"] * 16
    full_critic = plan(shape, PlanConfig(lora_r=8, critic_lora_r=0))["static"]["critic"]
    assert full_critic["total"] == 112e9 and full_critic["trainable_params"] == 7e9


def test_activation_estimate_by_hand():
    shape = preset_shape("7b")
    B, S, d, L, V = 8, 1024, 4096, 32, 32000
    layer = 34 * B * S * d  # bf16: (2/2)·34·B·S·d bytes
    logits = B * S * V * (2 + 4)
    p = plan(shape, PlanConfig())["phases"]
    assert p["train"]["actor"]["activations"] == L * layer + logits
    assert p["train"]["critic"]["activations"] == L * layer + B * S * 4
    assert p["rollout"]["actor"]["activations"] == layer + logits
    ckpt = plan(shape, PlanConfig(gradient_checkpointing=True))["phases"]
    assert ckpt["train"]["actor"]["activations"] == L * B * S * d * 2 + layer + logits
    eager = plan(shape, PlanConfig(attention="eager", dtype="fp32"))["phases"]
    assert eager["train"]["critic"]["activations"] == L * 2 * (layer + 5 * 32 * B * S * S) + B * S * 4


def test_train_activations_count_the_micro_batch_and_one_logits_chunk():
    """tether ppo trains on micro-batches (batch / --mini-batches / --grad-accumulation) and takes the head's
    log-probs 1024 tokens at a time: the train row counts those, the rollout row the whole generation batch."""
    shape = preset_shape("7b")
    B, b_train, S, d, L, V = 32, 8, 1024, 4096, 32, 32000
    p = plan(shape, PlanConfig(batch_size=B, train_batch_size=b_train, logits_chunk=1024))["phases"]
    assert p["train"]["actor"]["activations"] == L * 34 * b_train * S * d + 1024 * V * (2 + 4)
    assert p["train"]["critic"]["activations"] == L * 34 * b_train * S * d + b_train * S * 4
    assert p["rollout"]["actor"]["activations"] == 34 * B * S * d + B * S * V * (2 + 4)
    # a chunk larger than the micro-batch's tokens holds only those
    tiny = plan(shape, PlanConfig(batch_size=1, train_batch_size=1, prompt_length=100, response_length=100,
                                  logits_chunk=1024))["phases"]
    assert tiny["train"]["actor"]["activations"] == L * 34 * 200 * d + 200 * V * (2 + 4)
    half = {r["lever"]: r for r in levers(shape, PlanConfig(batch_size=B, train_batch_size=b_train))}
    quarter = plan(shape, PlanConfig(batch_size=B // 2, train_batch_size=b_train // 2))
    assert half["half the batch per GPU"]["peak"] == quarter["peak"]


def test_run_plan_config_is_the_run_s_micro_batch(tmp_path):
    from tiny import make_policy_dir, make_prompts_file, tiny_config

    from tether.ppo.dryrun import run_plan_config

    cfg = tiny_config(tmp_path, make_policy_dir(tmp_path), make_prompts_file(tmp_path), batch_size=8,
                      samples_per_prompt=4, ppo__mini_batches=2, ppo__grad_accumulation=2)
    plan_cfg = run_plan_config(cfg, 25.0)
    assert (plan_cfg.batch_size, plan_cfg.train_batch_size, plan_cfg.logits_chunk) == (32, 8, 1024)

def test_levers():
    shape = preset_shape("7b")
    cfg = PlanConfig()
    base = plan(shape, cfg)
    rows = {r["flags"]: r for r in levers(shape, cfg)}
    assert rows["--offload-ref --offload-rm"]["saves"] == 28e9  # both frozen models leave the GPU
    assert rows["--zero 3"]["saves"] == 0  # one GPU: nothing to shard over
    ckpt = plan(shape, dataclasses.replace(cfg, gradient_checkpointing=True))
    assert rows["--gradient-checkpointing"]["saves"] == base["peak"] - ckpt["peak"] > 60e9
    assert rows[next(k for k in rows if k.startswith("--lora-r 16 "))]["fits"]  # all levers together fit
    lora = {r["flags"] for r in levers(shape, dataclasses.replace(cfg, lora_r=16, gpus=8, zero=3))}
    assert "--lora-r 16" not in lora and "--zero 3" not in lora and "--offload-rm" in lora


def test_fit_verdicts():
    shape = preset_shape("7b")
    assert not plan(shape, PlanConfig())["fits"]
    assert plan(shape, PlanConfig(lora_r=16, zero=3, gpus=8, gradient_checkpointing=True))["fits"]


# ---------------------------------------------------------------- command line


def test_cli_table_and_json(capsys):
    assert main(["plan", "--model", "7b"]) == 0
    out = capsys.readouterr().out
    assert "252.00 GB" in out and "DOES NOT FIT" in out and "1 GB = 1e9 bytes" in out
    assert main(["plan", "--model", "7b", "--lora-r", "16", "--zero", "3", "--gpus", "8", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["unit"] == "bytes" and obj["static"]["reference"]["total"] == 0 and obj["levers"]


def test_cli_config_json(tmp_path, capsys):
    _config("llama_gqa_untied").save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--dtype", "fp32", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["params"] == config_shape(tmp_path).lm_params and obj["shape"]["kv_heads"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--model", "9b"], "unknown preset"),
    (["--model", "/nonexistent/config.json"], "file not found"),
    (["--batch-size", "0"], "--batch-size"),
    (["--gpu-memory", "-80"], "--gpu-memory"),
    (["--prompt-length", "-1"], "--prompt-length"),
    (["--zero", "4"], "--zero"),
    (["--dtype", "int8"], "--dtype"),
    (["--critic-lora-r", "-1"], "--critic-lora-r"),
    (["--gpus", "0"], "--gpus"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_cli_bad_config_files(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path)]) == 2  # folder without config.json
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "not supported" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "missing key" in capsys.readouterr().err
