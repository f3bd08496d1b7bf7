"""Reward-model training on packed pairs (tether.rm.packing): each pair's prompt once, the chosen and the rejected
reply after it. The scores, the Bradley-Terry loss and its gradients must equal the padded batch's (2B rows, right
padded, last-token pooling), computed by the existing padded path; models where that cannot hold train padded."""

from __future__ import annotations

import copy

import pytest
import torch
from test_reward_model import load_rm, save_tiny_bert, save_tiny_gpt2
from tiny import make_llama_chat_dir

from tether.hf import disable_dropout
from tether.rm.backbone import pad_batch, pooled_scores
from tether.rm.packing import common_prefix_length, pack_pairs, packed_pair_scores, packing_fallback


def test_common_prefix_length_by_hand():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 9]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2  # one text inside the other: each keeps a token
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2
    assert common_prefix_length([[5, 2], [1, 2]]) == 0
    assert common_prefix_length([[7], [7, 8]]) == 0
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 3]]) == 1  # a group: what all of them share


def test_pack_pairs_layout_by_hand():
    """Pair 0 shares [1, 2]; pair 1 shares nothing (two units). Last-token indices into the packed rows, by hand."""
    packed, last = pack_pairs([[1, 2, 3], [4, 5]], [[1, 2, 7, 8], [6]], pad_id=0)
    flat = packed.input_ids.reshape(-1)
    assert flat[last].tolist() == [3, 5, 8, 6]  # chosen 0, chosen 1, rejected 0, rejected 1
    pos = packed.position_ids.reshape(-1)
    assert pos[last].tolist() == [2, 1, 3, 0]  # each text's own last position: |text| - 1
    # pair 0's unit holds its prompt once: 2 + 1 + 2 tokens, not 3 + 4
    assert int((flat == 1).sum()) == 1 and int((flat == 2).sum()) == 1


def chat_pairs(rm, n: int = 6):
    """Pairs whose prompt is most of each text, replies of different lengths (so the padded batch pads), one
    reply a prefix of the other, one pair of identical-but-last-token replies."""
    prompts = [f"What is {i} + {i + 3}? Answer briefly." for i in range(n)]
    chosen = [f"The answer is {2 * i + 3}." for i in range(n)]
    rejected = [f"The answer is {i}" + "!" * (i % 3) for i in range(n)]
    rejected[1] = chosen[1] + " Sure."  # chosen is a prefix of rejected
    enc = rm.text_format.encode
    return [(enc(rm.tokenizer, p, c), enc(rm.tokenizer, p, r)) for p, c, r in zip(prompts, chosen, rejected)]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def rm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = make_llama_chat_dir(root) if request.param == "llama" else save_tiny_gpt2(root / "gpt2")
    model = load_rm(path, max_length=256)
    disable_dropout(model.model)
    return model


def test_packed_scores_and_gradients_equal_the_padded_ones(rm):
    pairs = chat_pairs(rm)
    chosen, rejected = [c.ids for c, _ in pairs], [r.ids for _, r in pairs]
    pad = rm.tokenizer.pad_token_id
    assert len({len(t) for t in chosen + rejected}) > 1  # really ragged
    packed_model, padded_model = copy.deepcopy(rm.model), copy.deepcopy(rm.model)
    for p in list(packed_model.parameters()) + list(padded_model.parameters()):
        p.requires_grad_(True)
    s_packed = packed_pair_scores(packed_model, chosen, rejected, pad)
    ids, mask = pad_batch(chosen + rejected, pad, "right")
    s_padded = pooled_scores(padded_model, ids, mask, "last_token")
    torch.testing.assert_close(s_packed, s_padded, rtol=1e-5, atol=1e-5)
    n = len(pairs)
    # the BT loss of A2 by hand on each: mean of -log sigmoid(r_w - r_l)
    for model, s in ((packed_model, s_packed), (padded_model, s_padded)):
        (-torch.nn.functional.logsigmoid(s[:n] - s[n:])).mean().backward()
    for (name, a), (_, b) in zip(packed_model.named_parameters(), padded_model.named_parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_batch_computes_fewer_tokens(rm):
    pairs = chat_pairs(rm)
    chosen, rejected = [c.ids for c, _ in pairs], [r.ids for _, r in pairs]
    packed, _ = pack_pairs(chosen, rejected, rm.tokenizer.pad_token_id)
    padded_tokens = 2 * len(pairs) * max(len(t) for t in chosen + rejected)
    assert packed.tokens < 0.75 * padded_tokens


def test_training_packed_equals_training_padded(rm, capsys):
    """Three optimiser steps of train-rm, packed and padded, from the same weights and batch order: the same losses
    and margins step by step (to float rounding), and the packed run says it packed."""
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.train import train_loop

    pairs = chat_pairs(rm, 12)
    histories = []
    for packing in (True, False):
        cfg = RewardTrainingConfig(seed=0)
        cfg.optim.batch_size, cfg.optim.lr, cfg.data.packing = 4, 1e-3, packing
        histories.append(train_loop(copy.deepcopy(rm.model), pairs, cfg, torch.device("cpu"),
                                    rm.tokenizer.pad_token_id))
    assert "packing: each pair's prompt once" in capsys.readouterr().out
    assert len(histories[0]) == len(histories[1]) == 3
    for a, b in zip(*histories):
        assert a["rm/loss"] == pytest.approx(b["rm/loss"], rel=1e-4, abs=1e-6)
        assert a["rm/grad_norm"] == pytest.approx(b["rm/grad_norm"], rel=1e-3)
        assert a["rm/accuracy"] == b["rm/accuracy"]
    assert histories[0][0]["rm/loss"] != pytest.approx(histories[0][-1]["rm/loss"], abs=1e-6)  # it trained


def test_packing_falls_back_where_it_cannot_hold(tmp_path, monkeypatch, capsys):
    """An encoder (the model's own pooling) and a model whose backbone refuses the packed call train padded, each
    with one line saying why; a packed forward that scores differently is refused by the check."""
    import tether.rm.packing as packing
    from tether.rm.train import packing_on

    bert = load_rm(save_tiny_bert(tmp_path / "bert"))
    pairs = chat_pairs(bert, 2)
    groups = [[c.ids, r.ids] for c, r in pairs]
    assert "model pooling" in packing_fallback(bert.model, groups, bert.tokenizer.pad_token_id, "model")

    gpt2 = load_rm(save_tiny_gpt2(tmp_path / "gpt2"))
    pairs = chat_pairs(gpt2, 3)
    groups = [[c.ids, r.ids] for c, r in pairs]
    pad = gpt2.tokenizer.pad_token_id
    assert packing_on(gpt2.model, pairs, pad, "last_token")

    def broken(*args, **kwargs):
        raise RuntimeError("no 4D masks here")

    monkeypatch.setattr(packing, "packed_scores", broken)
    assert not packing_on(gpt2.model, pairs, pad, "last_token")
    assert "packing off: the packed forward failed (RuntimeError: no 4D masks here)" in capsys.readouterr().out

    def shifted(model, groups, pad_id):
        ids, mask = pad_batch([t for g in groups for t in g], pad_id, "right")
        return pooled_scores(model, ids, mask, "last_token") + 0.1

    monkeypatch.setattr(packing, "packed_scores", shifted)
    assert "differ from padded ones by 1.00e-01" in packing_fallback(gpt2.model, groups, pad, "last_token")


def test_reward_model_scores_packed_groups_as_padded_rows(rm, capsys):
    """RewardModel.score (PPO's reward, the pairs' verdict): the K replies of each prompt packed after it, in
    batches that cut between prompts, give the padded scores of every text in its own place."""
    prompts = [f"What is {i} + 3? Answer briefly." for i in range(5) for _ in range(3)] + ["Say hi."]
    replies = [f"The answer is {i + k}." + " ok" * k for i in range(5) for k in range(3)] + ["hi"]
    order = [3, 0, 15, 7, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14]  # a prompt's replies need not be adjacent
    prompts, replies = [prompts[i] for i in order], [replies[i] for i in order]
    rm.packing = None
    packed = rm.score(prompts, replies, raw=True, batch_size=4)
    said = capsys.readouterr()
    assert rm.packing is True and "packing off" not in said.out + said.err
    rm.packing = False
    padded = rm.score(prompts, replies, raw=True, batch_size=4)
    rm.packing = None
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert packed.std() > 0  # not one score for everything


def test_prompt_groups_cut_between_prompts():
    from tether.rm.model import prompt_groups

    prompts = ["a", "b", "a", "c", "c", "c", "b", "d"]
    assert prompt_groups(prompts, 4) == [[[0, 2], [1, 6]], [[3, 4, 5], [7]]]
    assert prompt_groups(prompts, 2) == [[[0, 2]], [[1, 6]], [[3, 4, 5]], [[7]]]  # a group larger than a batch


def test_eager_attention_takes_the_block_mask_as_an_additive_one(rm):
    """Eager attention adds its mask to the scores (tether.hf.block_mask_for): packed scores still equal padded."""
    pairs = chat_pairs(rm)
    chosen, rejected = [c.ids for c, _ in pairs], [r.ids for _, r in pairs]
    pad = rm.tokenizer.pad_token_id
    model = copy.deepcopy(rm.model)
    model.config._attn_implementation = "eager"
    ids, mask = pad_batch(chosen + rejected, pad, "right")
    with torch.no_grad():
        torch.testing.assert_close(packed_pair_scores(model, chosen, rejected, pad),
                                   pooled_scores(model, ids, mask, "last_token"), rtol=1e-5, atol=1e-5)
