"""What a TRL user brings, run against tether unchanged (#49 items 2-3): TRL's reward functions written in TRL's
signature (the examples of TRL's GRPOTrainer docs), called as TRL calls them; a reward model trained by TRL (a
plain ``AutoModelForSequenceClassification``, no tether metadata); TRL's data rows. The Python TRL scripts write
(trainer arguments, config names): tests/test_trl_python.py. Expected values are computed here by hand, not by the
code under test."""

import json
import math
import re

import pytest
import torch

import tether
from tether.errors import TetherError
from tether.rules.calls import call_rule, calls_by_keyword, with_completion_ids

from tiny import make_llama_chat_dir, make_policy_dir, make_prompts_file, tiny_config


# ------------------------------------------------------------------- TRL's documented reward functions, verbatim shape
def reward_len(completions, **kwargs):
    """TRL's quick-start reward: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def reward_tokens(completion_ids, **kwargs):
    """TRL docs, example 1: longer completions in tokens."""
    return [float(len(ids)) for ids in completion_ids]


def format_reward_func(completions, **kwargs):
    """TRL docs, example 2 (conversational): <think>…</think><answer>…</answer>."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_accuracy(completions, ground_truth, **kwargs):
    """TRL docs, example 3: the \\boxed{} content against a ``ground_truth`` column."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def test_reward_len_is_called_by_keyword_as_trl_calls_it():
    # the failure #49 reports: tether called f(prompts, responses) positionally, "takes 1 positional argument"
    responses = ["x" * 5, "y" * 20, "z" * 26]
    scores = call_rule(reward_len, ["a", "b", "c"], responses, {"answer": ["1", "2", "3"]})
    assert scores.tolist() == [-15.0, 0.0, -6.0]
    assert calls_by_keyword(reward_len) and calls_by_keyword(lambda **kw: []) and not calls_by_keyword(
        lambda prompts, responses, **fields: [])


def test_completion_ids_reach_the_rule_that_asks_for_them():
    fields = with_completion_ids({}, [[6303, 13], [304, 279, 12884, 13]])  # the ids of TRL's docs example
    assert call_rule(reward_tokens, ["The sky is", "The sun is"], [" blue.", " in the sky."], fields).tolist() == \
        [2.0, 4.0]

    def docs_spelling(completions_ids, **kwargs):  # TRL's docs write the keyword so; its trainer passes completion_ids
        return [float(sum(ids)) for ids in completions_ids]

    assert call_rule(docs_spelling, ["a", "b"], ["x", "y"], with_completion_ids({}, [[1, 2], [3]])).tolist() == \
        [3.0, 3.0]
    with pytest.raises(TetherError, match=r"rule reward_tokens: cannot be called with what it is given \(.*"
                                          r"completion_ids is not known here\)"):
        call_rule(reward_tokens, ["a"], ["b"], {})


def test_conversational_prompts_get_message_completions_as_trl_gives_them():
    prompts = [[{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
               [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}]]
    responses = ["<think>The sum of 1 and 2 is 3, times 4 is 12.</think><answer>(1 + 2) * 4 = 12</answer>",
                 "The sum of 3 and 1 is 4, which we multiply by 2 to get 8."]
    assert call_rule(format_reward_func, prompts, responses, {}).tolist() == [1.0, 0.0]
    seen = {}

    def spy(prompts, completions, responses, ended_with_eos, **kwargs):  # tether's extras stay available
        seen.update(prompts=prompts, completions=completions, responses=responses, ended=ended_with_eos, **kwargs)
        return [0.0] * len(completions)

    call_rule(spy, prompts + ["plain text"], responses + ["r"], {"level": [1, 2, 3]}, [True, False, True])
    assert seen["prompts"][0] is prompts[0] and seen["prompts"][2] == "plain text"
    assert seen["completions"] == [[{"role": "assistant", "content": responses[0]}],
                                   [{"role": "assistant", "content": responses[1]}], "r"]
    assert seen["responses"] == responses + ["r"] and seen["ended"] == [True, False, True]
    assert seen["level"] == [1, 2, 3]


def test_accuracy_against_a_dataset_column():
    responses = [r"so \boxed{12}", r"\boxed{7} I think", "no box: 8"]
    scores = call_rule(boxed_accuracy, ["p1", "p2", "p3"], responses, {"ground_truth": ["12", "8", "8"]})
    assert scores.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(TetherError, match=r"rule boxed_accuracy: cannot be called .*'ground_truth'.*columns: answer"):
        call_rule(boxed_accuracy, ["p"], ["r"], {"answer": ["1"]})


def test_tethers_positional_rules_keep_working_and_spec_arguments_bind_either_kind():
    from tether.rules import load_rule, math_answer

    responses = ["The answer is 4.", "5", "The answer is 7."]
    expected = [1.0 + 0.1, 0.0, 0.0 + 0.1]  # right + final statement; wrong; wrong but stated
    assert call_rule(math_answer, ["q"] * 3, responses, {"answer": ["4", "4", "4"]}).tolist() == \
        pytest.approx(expected)
    bonus = load_rule("tether.rules:math_answer:format_bonus=0.5")
    assert call_rule(bonus, ["q"] * 3, responses, {"answer": ["4"] * 3}).tolist() == pytest.approx([1.5, 0.0, 0.5])
    length = load_rule("trl_rules:close_to:target=3")  # a TRL-style function with a bound keyword
    assert call_rule(length, ["q", "q"], ["abc", "abcdef"], {"target": [100, 100]}).tolist() == [0.0, -3.0]


def test_a_ppo_run_calls_trl_reward_functions_with_the_rollouts_tokens_and_columns(tmp_path):
    from transformers import AutoTokenizer

    policy = make_llama_chat_dir(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    seen = []

    def spy(prompts, completions, completion_ids, ground_truth, **kwargs):
        seen.append((prompts, completions, completion_ids, ground_truth, kwargs["ended_with_eos"]))
        return [float(len(ids)) for ids in completion_ids]

    rows = [{"prompt": [{"role": "user", "content": f"add {i} and {i + 1}"}], "ground_truth": str(2 * i + 1)}
            for i in range(8)]
    cfg = tiny_config(tmp_path, policy, tmp_path / "unused.jsonl", steps=1, batch_size=4)
    cfg.reward.sources = []
    result = tether.PPOTrainer(cfg, reward=[spy, format_reward_func], prompts=rows).train()
    assert result.steps == 1 and len(seen) == 2  # the start-up probe (empty replies), then step 1
    assert seen[0][2] == [[]] * len(seen[0][2])
    prompts, completions, ids, truth, ended = seen[1]
    by_prompt = {r["prompt"][0]["content"]: r["ground_truth"] for r in rows}
    assert [by_prompt[p[0]["content"]] for p in prompts] == truth  # each row's own column
    for completion, row_ids, done in zip(completions, ids, ended):
        assert completion[0]["role"] == "assistant"
        assert tokenizer.decode(row_ids, skip_special_tokens=True) == completion[0]["content"]
        assert (row_ids[-1] == tokenizer.eos_token_id) == done  # up to and including EOS, as TRL passes them
        assert 1 <= len(row_ids) <= cfg.generation.max_new_tokens


# ------------------------------------------------------------------------------------ a reward model trained by TRL
def make_trl_reward_model(root, seed=0):
    """What TRL's RewardTrainer leaves: AutoModelForSequenceClassification (num_labels=1) and its tokenizer,
    saved with save_pretrained, no tether_reward.json."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tether.demo.task import build_tokenizer

    path = root / "trl_rm"
    tokenizer = build_tokenizer(padding_side="right")
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2, num_labels=1,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(config).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a head that tells texts apart
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_a_trl_reward_model_is_a_reward_source_scored_raw_and_says_so(tmp_path, capsys):
    from tether.ppo.sources import RewardModelSource, build_sources

    path, model, tokenizer = make_trl_reward_model(tmp_path)
    assert not (path / "tether_reward.json").exists()
    prompts, responses = ["1+2=", "3+4=", "5+6="], ["3", "77", "11 "]
    with torch.no_grad():  # the model's own forward, one text at a time: TRL's logit, no padding involved
        expected = [model(**tokenizer(p + r, return_tensors="pt")).logits[0, 0].item()
                    for p, r in zip(prompts, responses)]
    capsys.readouterr()
    sources = build_sources([str(path)], device="cpu")
    assert len(sources) == 1 and isinstance(sources[0], RewardModelSource)
    assert sources[0](prompts, responses, {}).tolist() == pytest.approx(expected, abs=1e-5)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tether_reward.json" in err[0] and "scored raw" in err[0]


def test_a_causal_lm_as_reward_is_one_line_saying_what_it_is(tmp_path):
    from tether.rm.model import RewardModel

    policy = make_policy_dir(tmp_path)
    with pytest.raises(TetherError, match=r"not a reward model \(no tether_reward.json, and a GPT2LMHeadModel, not a "
                                          r"one-output AutoModelForSequenceClassification\); train one with tether "
                                          r"train-rm"):
        RewardModel.from_pretrained(policy, device="cpu")


def test_a_ppo_run_takes_a_trl_reward_model_directory(tmp_path):
    path, _, _ = make_trl_reward_model(tmp_path)
    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path, n=8)
    cfg = tiny_config(tmp_path, policy, prompts, steps=1, batch_size=4)
    cfg.reward.sources = [str(path)]
    rows = [json.loads(line) for line in (tether.PPOTrainer(cfg).train().run_dir / "metrics.jsonl").open()]
    assert math.isfinite(rows[-1]["objective/scores"])


# ------------------------------------------------------------------------------------------------ TRL's data rows
def test_sft_reads_trl_text_rows_and_trains_every_token():
    from tether.demo.task import build_tokenizer
    from tether.sft.data import row_from_record
    from tether.sft.tokens import TextFormat, encode_rows

    rows = [row_from_record({"text": "12+34=46", "source": "web"}, "d: row 1"),
            row_from_record({"prompt": "1+1=", "completion": "2"}, "d: row 2"),
            row_from_record({"text": "7"}, "d: row 3")]
    assert [r.whole_text for r in rows] == [True, False, True] and rows[0].columns == {"source": "web"}
    for tok in (build_tokenizer(), build_tokenizer(eos_after_text=True)):
        eos = tok.eos_token_id
        chars = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731 - one id per character
        for chat in (False, True):  # a text row ignores the chat template, as TRL's language-modelling rows do
            fmt = TextFormat(chat, "", "{prompt}", frozenset({eos}), eos, 1024)
            examples, info = encode_rows(tok, [rows[0], rows[2]], fmt)
            assert [e.ids for e in examples] == [chars("12+34=46") + [eos], chars("7") + [eos]]  # EOS once
            assert [e.labels for e in examples] == [e.ids for e in examples]  # every token is a target
            assert info["trained_tokens"] == 9 + 2
        plain = TextFormat(False, "", "{prompt}", frozenset({eos}), eos, 1024)
        mixed, _ = encode_rows(tok, rows, plain)  # row order is kept when shapes mix
        context = len(tok("1+1=", add_special_tokens=True)["input_ids"])  # the prompt/completion row as before
        assert mixed[1].labels == [-100] * context + chars("2") + [eos] and mixed[2].ids == chars("7") + [eos]
        cut, info = encode_rows(tok, [rows[0]], TextFormat(False, "", "{prompt}", frozenset({eos}), eos, 4))
        assert cut[0].ids == chars("12+3") and info["response_truncated"] == 1  # cut from the right


@pytest.mark.parametrize("record, message", [({"text": "  "}, "field 'text' is empty"),
                                             ({"text": 3}, "field 'text' must be text, got int"),
                                             ({"txt": "a"}, "or 'text' (found: txt)")])
def test_a_bad_text_row_is_one_line_naming_the_row(record, message):
    from tether.errors import DataError
    from tether.sft.data import row_from_record

    with pytest.raises(DataError, match=rf"^d: row 4: .*{re.escape(message)}"):
        row_from_record(record, "d: row 4")


def test_ppo_prompts_as_trl_has_them_text_or_messages_with_columns_for_rules():
    from tether.inputs.prompt_rows import collate_fields, prompts_from_data

    rows = prompts_from_data([{"prompt": "2+2=", "solution": "4"},
                              {"prompt": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "3+3="}], "solution": "6"}])
    assert rows[0]["prompt"] == "2+2=" and rows[1]["prompt"][1] == {"role": "user", "content": "3+3="}
    fields = collate_fields(rows)
    scores = call_rule(trl_accuracy, [r["prompt"] for r in rows], ["4", "5"], fields)
    assert scores.tolist() == [1.0, 0.0]


def trl_accuracy(completions, solution, **kwargs):
    """TRL's accuracy_reward shape: the completion's text against a ``solution`` column (exact match here)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == s) for t, s in zip(texts, solution)]

