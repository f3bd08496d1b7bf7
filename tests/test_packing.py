"""Packed forwards (ppo.packing): each distinct prompt once, followed by its responses, in one row with a block
attention mask. The layout against its definition written as loops; the packed log-probs, entropy, hidden states
and gradients against the padded forward's; a PPO step packed keeps the ratio 1 and the KL 0 before any update;
a model that ignores the mask is refused."""

import pytest
import torch
from tiny import make_llama_chat_dir, make_policy_dir, make_prompts_file, tiny_config

from tether.core.packing import first_fit_rows, pack_units
from tether.errors import ConfigError
from tether.hf import load_causal_lm, load_tokenizer
from tether.ppo.forward import ForwardOptions, checked_forward_options, forward_response
from tether.rollout.records import Rollout
from tether.rollout.sampling import encode_prompts, generate


def test_first_fit_rows_by_hand():
    # longest first: 7 | 5+3+2 would exceed 9, so 7 | 5 3 | 2 ... first fit: 7→r0 (room 2), 5→r1 (4), 3→r1 (1),
    # 2→r0 (0), 1→r1 (0)
    assert first_fit_rows([3, 5, 7, 2, 1], budget=9) == [[2, 3], [1, 0, 4]]
    assert first_fit_rows([4, 4], budget=3) == [[0], [1]]  # longer than the budget: a row each


def _mask_by_definition(unit, segment) -> torch.Tensor:
    L = len(unit)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        for j in range(L):
            if unit[i] < 0:
                allowed[i, j] = i == j
            else:
                allowed[i, j] = unit[i] == unit[j] and j <= i and (segment[j] == 0 or segment[j] == segment[i])
    return allowed


def test_pack_units_layout_against_its_definition():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    prefixes = [t(11, 12, 13), t(21), t(31, 32)]
    suffixes = [[t(14, 15), t(16)], [t(22, 23, 24)], []]
    packed = pack_units(prefixes, suffixes, pad_id=0, budget=8)
    # unit lengths 6, 4, 2: rows [u0, u2] (8) and [u1] (4, padded to 8)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 16, 31, 32], [21, 22, 23, 24, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1], [0, 1, 2, 3, 0, 0, 0, 0]]
    unit = [[0, 0, 0, 0, 0, 0, 2, 2], [1, 1, 1, 1, -1, -1, -1, -1]]
    segment = [[0, 0, 0, 1, 1, 2, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    for r in range(2):
        assert torch.equal(packed.attention_mask[r, 0], _mask_by_definition(unit[r], segment[r]))
    flat = packed.input_ids.flatten()
    for u in range(3):
        assert torch.equal(flat[packed.prefix_index[u]], prefixes[u])
        for k, s in enumerate(suffixes[u]):
            assert torch.equal(flat[packed.suffix_index[u][k]], s)


def _rollout(policy_dir, chat: bool, min_new_tokens: int = 0):
    tokenizer = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir).eval()
    prompts = ["1+2=", "123+456=", "1+2=", "9=", "123+456=", "1+2="]  # shared prompts, left padding
    query, query_mask = encode_prompts(tokenizer, prompts, 32, chat)
    torch.manual_seed(3)
    rollout = generate(model, tokenizer, query, query_mask, 10, 1.0, min_new_tokens=min_new_tokens)
    assert len(set(rollout.lengths.tolist())) > 1
    return model, rollout


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_forward_equals_the_padded_one(tmp_path, arch):
    """Log-probs, entropy and the hidden states s_0 … s_L of every row (the value head's inputs, V(s_T) included)
    equal the padded forward's, and so do the gradients of a loss on them (with EOS banned early, as sampled)."""
    policy_dir = make_policy_dir(tmp_path) if arch == "gpt2" else make_llama_chat_dir(tmp_path)
    model, rollout = _rollout(policy_dir, chat=arch == "llama", min_new_tokens=2)
    mask = rollout.response_mask.bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for name, options in [("padded", ForwardOptions()), ("packed", ForwardOptions(packing=True, chunk_tokens=5))]:
        model.zero_grad(set_to_none=True)
        logprobs, entropy, hidden = forward_response(model, rollout, 0.7, need_hidden=True, options=options)
        ((logprobs * weights)[mask].sum() + entropy[mask].sum() + hidden.sum() * 0).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (logprobs.detach(), entropy.detach(), hidden.detach(), grads)
    (lp_a, ent_a, h_a, g_a), (lp_b, ent_b, h_b, g_b) = results["padded"], results["packed"]
    torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b[mask], ent_a[mask], atol=1e-5, rtol=1e-5)
    for b, length in enumerate(rollout.lengths.tolist()):
        torch.testing.assert_close(h_b[b, :length + 1], h_a[b, :length + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_b, g_a, atol=1e-5, rtol=1e-4)
    eos_early = torch.isin(rollout.response[:, :2], torch.tensor(rollout.eos_ids))
    assert not eos_early.any()  # the ban held while sampling, and both paths scored it


def test_packed_rows_hold_each_prompt_once(tmp_path):
    from tether.ppo.forward import pack_rollout

    model, rollout = _rollout(make_policy_dir(tmp_path), chat=False)
    packed, rows_of_unit = pack_rollout(rollout)
    assert sorted(len(r) for r in rows_of_unit) == [1, 2, 3]  # "1+2=" ×3, "123+456=" ×2, "9=" ×1
    prompt_tokens = sum(int(rollout.query_mask[rows[0]].sum()) for rows in rows_of_unit)
    real = sum(len(p) for p in packed.prefix_index) + sum(len(s) for ss in packed.suffix_index for s in ss)
    assert real == prompt_tokens + int(rollout.lengths.sum())


class _IgnoresTheMask(torch.nn.Module):
    """A causal LM whose forward drops attention_mask and position_ids (as a model without 4D-mask support would
    behave): packed rows then see each other."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_a_model_that_ignores_the_mask_is_refused_packing(tmp_path):
    model = load_causal_lm(make_policy_dir(tmp_path))
    assert checked_forward_options(model, packing=True).packing
    with pytest.raises(ConfigError, match="ppo.packing"):
        checked_forward_options(_IgnoresTheMask(model), packing=True)


def test_packed_grpo_step_ratio_one_and_kl_zero_before_an_update(tmp_path, monkeypatch):
    import tether.ppo.update as update_module
    from tether.ppo.setup import setup
    from tether.ppo.step import ppo_step

    files = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    cfg = tiny_config(tmp_path, *files, samples_per_prompt=4, advantage__estimator="grpo", batch_size=4,
                      ppo__mini_batches=2, ppo__packing=True, kl__penalty_in="loss")
    run = setup(cfg)
    assert run.models.forward.packing
    seen = []
    original = update_module.ppo_policy_loss

    def spy(logprobs, logprobs_old, advantages, mask, clip_range, **kwargs):
        loss, stats = original(logprobs, logprobs_old, advantages, mask, clip_range, **kwargs)
        seen.append(stats)
        return loss, stats

    monkeypatch.setattr(update_module, "ppo_policy_loss", spy)
    metrics = ppo_step(run, cfg, 1)
    assert metrics["objective/kl"] == 0.0 and metrics["objective/kl_max"] == 0.0
    assert seen[0]["ratio_max"].item() == 1.0 and seen[0]["ratio_std"].item() == 0.0
    assert any(s["ratio_std"].item() > 0 for s in seen[1:])


def test_packed_flops_count_a_shared_prompt_once():
    """perf/tflops_step under packing: a prompt n rows share is computed (and counted) once."""
    from tether.core.flops import FlopShape, forward_flops
    from tether.ppo.perf import Throughput, prompt_shares, step_flops

    query = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    query_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    shares = prompt_shares(query, query_mask)
    assert shares.tolist() == [0.5, 0.5, 1.0]
    shape = FlopShape(matmul_params=1000, head_params=100, layers=2, width=8)
    t = Throughput(policy=shape, critic=None, value_head_params=0, peak=1.0, peak_source="test")
    lengths = torch.tensor([4, 3, 2])
    flops = step_flops(t, query_mask, lengths, epochs_run=1, critic_only=False, prompt_share=shares)
    by_hand = sum(forward_flops(shape, tokens, with_head=False) for tokens in (1 + 4, 1 + 3, 3 + 2)) \
        + 2.0 * 100 * (4 + 3 + 2)
    assert flops["reference"] == pytest.approx(by_hand)
