"""Padding-free packing (S2) and the step order: rows laid out by hand, packed loss and gradients equal to padded
ones to 1e-5 on the same sequences (GPT-2 and a Llama-shaped model, SDPA and eager attention), a model that lets
packed sequences see each other refused, and the step order the same for 1 process × 2 micro-batches and 2 × 1."""

from __future__ import annotations

import pytest
import torch

from tether.core.losses import token_nll
from tether.demo.task import build_policy, build_tokenizer
from tether.errors import TetherError
from tether.sft.batches import StepStream, check_packing, first_fit_rows, packed_batch, padded_batch
from tether.sft.tokens import IGNORE_INDEX, Example


def test_first_fit_rows_by_hand():
    # longest first: 5 fills row 0, 4 opens row 1 (1 left), 3 opens row 2 (2 left), 2 fits row 2
    assert first_fit_rows([5, 3, 2, 4], 5) == [[0], [3], [1, 2]]
    assert first_fit_rows([5, 3, 2, 4], None) == [[0, 1, 2, 3]]


def test_packed_layout_by_hand():
    a = Example([11, 12, 13], [IGNORE_INDEX, 12, 13])
    b = Example([21, 22], [IGNORE_INDEX, 22])
    c = Example([31, 32, 33, 34], [IGNORE_INDEX, IGNORE_INDEX, 33, 34])
    batch = packed_batch([a, b, c], pad_id=0)  # rows of at most 4: [c], [a], then b (2) does not fit a's row (1 left)
    assert batch.input_ids.tolist() == [[31, 32, 33, 34], [11, 12, 13, 0], [21, 22, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch.labels.tolist() == [[-100, -100, 33, 34], [-100, 12, 13, -100], [-100, 22, -100, -100]]
    assert batch.attention_mask is None
    one = packed_batch([a, b, c], pad_id=0, one_row=True)  # one row: the micro-batch's own order
    assert one.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert one.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert one.labels.tolist() == [[-100, 12, 13, -100, 22, -100, -100, 33, 34]]


def llama(tok, attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def gpt2(tok, attention: str):
    model = build_policy(tok, seed=0, n_layer=2, n_embd=64, n_head=4)
    model.config._attn_implementation = attention
    return model


def random_examples(vocab: int, n: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 30, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        context = int(torch.randint(1, length, (1,), generator=g))
        out.append(Example(ids, [IGNORE_INDEX] * context + ids[context:]))
    return out


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one_row"])
def test_packed_loss_and_gradients_equal_padded_on_the_same_rows(make, attention, one_row):
    tok = build_tokenizer()
    model = make(tok, attention).train()
    examples = random_examples(len(tok), 12, seed=1)
    results = []
    for batch in (padded_batch(examples, tok.pad_token_id), packed_batch(examples, tok.pad_token_id, one_row)):
        model.zero_grad()
        loss, n = token_nll(model(**batch.model_inputs("cpu")).logits, batch.labels)
        loss.backward()
        results.append((loss.detach(), n, [p.grad.clone() for p in model.parameters()]))
    (padded, n_padded, g_padded), (packed, n_packed, g_packed) = results
    assert n_padded == n_packed == sum(e.trained for e in examples)
    assert abs(float(packed - padded)) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(g_padded, g_packed)) < 1e-5
    assert packed_batch(examples, tok.pad_token_id, one_row).positions < padded_batch(examples, 0).positions
    check_packing(model, "one_row" if one_row else "rows", "cpu")  # the run's own check agrees


class IgnoresPositions(torch.nn.Module):
    """A model that drops the position ids: one causal sequence per row, packed sequences see each other."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_a_model_whose_packed_sequences_see_each_other_is_refused():
    tok = build_tokenizer()
    with pytest.raises(TetherError, match=r"^--packing: this model .* lets packed sequences see each other"):
        check_packing(IgnoresPositions(gpt2(tok, "sdpa")), "rows", "cpu")


def test_one_process_with_two_micro_batches_steps_over_what_two_processes_with_one_do():
    examples = random_examples(50, 41, seed=2)
    one = StepStream(examples, 4, 2, seed=5)
    two = [StepStream(examples, 4, 1, seed=5, rank=r, world_size=2) for r in (0, 1)]
    assert one.steps_per_epoch == 6 and two[0].steps_per_epoch == 5  # 11 micro-batches (the last of 1 sequence)
    for step in range(5):
        mine, tokens = one.next_step()
        theirs = [s.next_step() for s in two]
        assert mine == theirs[0][0] + theirs[1][0], step
        assert tokens == theirs[0][1] == theirs[1][1] == sum(examples[i].trained for m in mine for i in m)
    assert [len(m) for m in one.next_step()[0]] == [1]  # one process keeps the epoch's short last step; two leave it
    assert [s.next_step()[0] for s in two][0] != []  # ... and have begun epoch 2
    assert two[0].epoch == 1


def test_the_step_order_resumes_from_its_state_and_drop_last_leaves_the_short_batch():
    examples = random_examples(50, 10, seed=3)
    straight = StepStream(examples, 3, 1, seed=7)
    order = [straight.next_step()[0] for _ in range(9)]
    first = StepStream(examples, 3, 1, seed=7)
    for _ in range(5):
        first.next_step()
    resumed = StepStream(examples, 3, 1, seed=7)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_step()[0] for _ in range(4)] == order[5:]
    dropping = StepStream(examples, 3, 1, seed=7, drop_last=True)
    assert dropping.steps_per_epoch == 3 and all(len(dropping.next_step()[0][0]) == 3 for _ in range(6))
