"""Model FLOPs (tether.core.flops) against torch's own count of every matmul (FlopCounterMode) on tiny
models: a forward over a sequence, KV-cached generation, a LoRA-wrapped policy, and the peak probe."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tether.core.flops import FlopShape, forward_flops, generation_flops, train_flops
from tether.ppo.perf import flop_shape, peak_flops


def tiny_gpt2(tied: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=57, n_positions=64, tie_word_embeddings=tied,
                        attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("length", [1, 7, 20])
def test_forward_flops_equal_torchs_matmul_count(tied, length):
    model = tiny_gpt2(tied)
    ids = torch.randint(1, 57, (1, length))
    assert forward_flops(flop_shape(model), length) == counted(lambda: model(input_ids=ids))


def test_generation_flops_equal_torchs_count_with_a_kv_cache():
    model = tiny_gpt2()
    ids = torch.randint(1, 57, (1, 9))
    run = lambda: model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,  # noqa: E731
                                 pad_token_id=0)
    assert generation_flops(flop_shape(model), 9, 6) == counted(run)


def test_lora_adapters_are_counted():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    ids = torch.randint(1, 57, (1, 11))
    assert forward_flops(flop_shape(model), 11) == counted(lambda: model(input_ids=ids))


def test_hand_values_and_training_is_three_forwards():
    shape = FlopShape(matmul_params=100, head_params=10, layers=2, width=4)
    assert forward_flops(shape, 3) == 2 * 110 * 3 + 4 * 2 * 4 * 9
    assert forward_flops(shape, 3, with_head=False) == 2 * 100 * 3 + 4 * 2 * 4 * 9
    # prefill of 2 (logits at its last position) + 2 cached steps attending to 3 and 4 keys
    assert generation_flops(shape, 2, 3) == (2 * 100 * 2 + 4 * 2 * 4 * 4 + 2 * 10) + 2 * 2 * 110 + 4 * 2 * 4 * 7
    assert generation_flops(shape, 5, 0) == 0.0
    assert train_flops(7.0) == 21.0


def test_cpu_peak_probe_is_a_plausible_rate():
    peak, source = peak_flops(torch.device("cpu"), seconds=0.05)
    assert 1e8 < peak < 1e14 and "probe" in source


def test_padding_fraction_by_hand_and_step_flops_add_up():
    from tether.ppo.perf import Throughput, padding_fraction, step_flops

    query_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])        # prompts of 2 and 3 tokens, left-padded to 3
    response_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])  # responses of 1 and 4 tokens, padded to 4
    assert padding_fraction(query_mask, response_mask) == pytest.approx(1 - 10 / 14)
    shape = FlopShape(matmul_params=100, head_params=10, layers=2, width=4)
    t = Throughput(policy=shape, critic=None, value_head_params=20, peak=1.0, peak_source="test")
    out = step_flops(t, query_mask, response_mask.sum(dim=1), epochs_run=2, critic_only=False)
    policy = (forward_flops(shape, 3, with_head=False) + 2 * 10 * 1) \
        + (forward_flops(shape, 7, with_head=False) + 2 * 10 * 4)
    head = 2 * 20 * (1 + 1) + 2 * 20 * (4 + 1)
    assert out["generate"] == generation_flops(shape, 2, 1) + generation_flops(shape, 3, 4)
    assert out["logprobs_old"] == out["reference"] == policy and out["values"] == head
    assert out["train"] == 2 * (3 * policy + 3 * head)
    warmup = step_flops(t, query_mask, response_mask.sum(dim=1), epochs_run=1, critic_only=True)
    assert warmup["train"] == policy + 3 * head  # critic warm-up: the policy forward only, no backward
