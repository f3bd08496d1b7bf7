"""SFT tokens and the loss mask (S1): a real chat template (SmolLM2's) checked against tokens counted by hand, the
plain format, EOS when a template has no stop token, truncation counts, and the loss against per-token terms."""

from __future__ import annotations

import pytest
import torch

from tether.core.losses import token_nll
from tether.demo.task import build_tokenizer
from tether.errors import DataError
from tether.sft.batches import padded_batch
from tether.sft.data import SFTRow, row_from_record
from tether.sft.tokens import IGNORE_INDEX, TextFormat, chat_example, encode_rows, plain_examples, truncated
from test_presets import SMOL, needs_smollm2
from tiny import CHAT_TEMPLATE


def fmt_of(tokenizer, chat: bool, system: str = "", template: str = "{prompt}", max_length: int = 1024) -> TextFormat:
    return TextFormat(chat, system, template, frozenset({tokenizer.eos_token_id}), tokenizer.eos_token_id, max_length)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from tether.presets import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(SMOL, what="model")))


def trained(tokenizer, ids, labels):
    return [(t, tokenizer.convert_ids_to_tokens(i)) for t, (i, lab) in enumerate(zip(ids, labels))
            if lab != IGNORE_INDEX]


@needs_smollm2
def test_smollm2_conversation_trains_each_assistant_turn_to_its_im_end(smol_tokenizer):
    tok = smol_tokenizer
    row = row_from_record({"messages": [{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello there"},
                                        {"role": "user", "content": "2+2?"},
                                        {"role": "assistant", "content": "4"}]}, "rows.jsonl: line 1")
    ids, labels = chat_example(tok, row, fmt_of(tok, True))
    # Counted by hand on the rendered conversation (51 tokens): the default system turn (0-20), the user turn
    # (21-26), "<|im_start|>assistant\n" (27-30), "Hello there<|im_end|>" (31-33), "\n" (34), the user turn
    # (35-43), "<|im_start|>assistant\n" (44-47), "4<|im_end|>" (48-49), "\n" (50).
    assert len(ids) == 51
    assert trained(tok, ids, labels) == [(31, "Hello"), (32, "Ġthere"), (33, "<|im_end|>"), (48, "4"),
                                         (49, "<|im_end|>")]
    assert tok.convert_ids_to_tokens(ids[34]) == tok.convert_ids_to_tokens(ids[50]) == "Ċ"  # after EOS: not trained


@needs_smollm2
def test_smollm2_prompt_completion_is_trained_in_ppos_context(smol_tokenizer):
    from tether.rollout.sampling import encode_prompts

    tok = smol_tokenizer
    row = row_from_record({"prompt": "2+2?", "completion": "4", "answer": 4}, "rows.jsonl: line 1")
    fmt = fmt_of(tok, True, system="Be brief.", template="Q: {prompt}")
    ids, labels = chat_example(tok, row, fmt)
    assert [t for _, t in trained(tok, ids, labels)] == ["4", "<|im_end|>"]
    context = ids[:len(ids) - 3]  # everything before "4<|im_end|>\n"
    assert tok.decode(context) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 2+2?<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    query, mask = encode_prompts(tok, ["2+2?"], 512, True, "Be brief.", "Q: {prompt}")  # what tether ppo feeds it
    assert query[0][mask[0].bool()].tolist() == context


def test_a_template_without_stop_token_gets_eos_appended_and_trained():
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # "{bos}role content = ..." and no EOS after a turn
    ids, labels = chat_example(tok, row_from_record({"prompt": "12+34=", "completion": "64"}, "x"), fmt_of(tok, True))
    text = tok.decode(ids)
    assert text.endswith("user 12+34= = assistant 64 = [EOS]")
    n_trained = len("64 = ") + 1  # the assistant turn as the template writes it, then the appended EOS
    assert [lab != IGNORE_INDEX for lab in labels] == [False] * (len(ids) - n_trained) + [True] * n_trained
    assert labels[-1] == ids[-1] == tok.eos_token_id


def test_a_template_that_is_not_rendered_turn_by_turn_is_refused_naming_the_row():
    tok = build_tokenizer()
    tok.chat_template = "{{ messages|length }}" + CHAT_TEMPLATE  # the message count up front changes every prefix
    row = row_from_record({"prompt": "12+34=", "completion": "64"}, "data.jsonl: line 7")
    with pytest.raises(DataError, match=r"^data.jsonl: line 7: the chat template does not render"):
        chat_example(tok, row, fmt_of(tok, True))


def test_plain_rows_train_the_completion_and_eos_only():
    tok = build_tokenizer()
    rows = [SFTRow("123+045=", "168"), SFTRow("999+999=", "1998")]
    examples = [truncated(i, lab, 1024) for i, lab in plain_examples(tok, rows, fmt_of(tok, False))]
    batch = padded_batch(examples, tok.pad_token_id)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert batch.input_ids.tolist() == [ids("123+045=168") + [eos, pad], ids("999+999=1998") + [eos]]
    assert batch.attention_mask.tolist() == [[1] * 12 + [0], [1] * 13]
    assert batch.labels.tolist() == [[-100] * 8 + ids("168") + [eos, -100], [-100] * 8 + ids("1998") + [eos]]


def test_plain_tokens_are_the_same_after_a_padded_call():
    tok = build_tokenizer()
    rows = [SFTRow("123+045=", "168"), SFTRow("999+999=", "1998")]
    clean = plain_examples(tok, rows, fmt_of(tok, False))
    tok(["1", "123"], padding=True, add_special_tokens=False)  # as generation does; leaves padding on in the backend
    assert plain_examples(tok, rows, fmt_of(tok, False)) == clean


def test_truncation_cuts_the_prompt_from_the_left_then_the_reply_from_the_right_and_counts_both():
    ids = list(range(10))
    labels = [IGNORE_INDEX] * 6 + ids[6:]  # 6 context tokens, 4 trained
    kept = truncated(ids, labels, 8)  # 2 too many: both from the context
    assert (kept.ids, kept.prompt_cut, kept.response_cut) == (ids[2:], True, False)
    short = truncated(ids, labels, 4)  # 6 too many: 5 context tokens (one stays), then 1 trained from the right
    assert (short.ids, short.labels, short.prompt_cut, short.response_cut) == ([5, 6, 7, 8], [-100, 6, 7, 8], True, True)
    assert truncated(ids, labels, 10) == truncated(ids, labels, 99)  # fits: untouched
    tok = build_tokenizer()
    rows = [SFTRow("123+045=", "168"), SFTRow("1+1=", "2")]
    _, info = encode_rows(tok, rows, fmt_of(tok, False, max_length=8))  # 12 and 6 tokens
    assert (info["prompt_truncated"], info["response_truncated"], info["rows"]) == (1, 0, 2)


def test_token_nll_is_the_mean_over_labelled_next_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    labels = torch.tensor([[-100, -100, 3, 1, -100], [-100, 4, 0, 6, 2]])
    terms = [-torch.log_softmax(logits[b, t - 1], -1)[labels[b, t]]  # position t - 1 predicts label t
             for b in range(2) for t in range(1, 5) if labels[b, t] != -100]
    loss, n = token_nll(logits, labels)
    assert n == 6 and torch.allclose(loss, torch.stack(terms).mean())
    poked = logits.clone()
    poked[0, 0] += 10.0  # the logits that predict a prompt token (label -100) do not enter
    assert torch.equal(token_nll(poked, labels)[0], loss)
