"""What a TRL user brings, run against tether unchanged (#49 items 2-4): TRL's reward functions written in TRL's
signature (the examples of TRL's GRPOTrainer docs), called as TRL calls them; a reward model trained by TRL (a
plain ``AutoModelForSequenceClassification``, no tether metadata); TRL's data rows; the trainer keyword arguments
and config names TRL scripts use. Expected values are computed here by hand, not by the code under test."""

import json
import math
import re

import pytest
import torch

import tether
from tether.errors import TetherError
from tether.rule_calls import call_rule, calls_by_keyword, with_completion_ids

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
    from tether.prompt_rows import collate_fields, prompts_from_data

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


# ---------------------------------------------------------------------------------------- the Python TRL users write
def test_trl_config_names_are_accepted_or_answered_with_the_tether_key():
    from tether.errors import ConfigError
    from tether.trl_compat.keys import TRL_KEYS, config_keys

    cfg = tether.PPOConfig(learning_rate=3e-6, beta=0.02, num_generations=4, max_completion_length=64,
                           output_dir="out", model_name_or_path="some/policy")
    assert tether.PPOConfig is tether.RunConfig and tether.RewardConfig is tether.RewardTrainingConfig
    assert (cfg.optim.lr, cfg.kl.coef, cfg.samples_per_prompt, cfg.generation.max_new_tokens, cfg.output_dir,
            cfg.model.policy) == (3e-6, 0.02, 4, 64, "out", "some/policy")
    sft = tether.SFTConfig(num_train_epochs=3, per_device_train_batch_size=2, max_length=128)
    assert (sft.optim.epochs, sft.optim.batch_size, sft.data.max_length) == (3, 2, 128)
    assert tether.RewardConfig(per_device_train_batch_size=4).optim.batch_size == 4
    with pytest.raises(ConfigError, match=r"^RunConfig\(lr=\.\.\.\): unknown key 'lr'; did you mean `optim.lr` "
                                          r"\(--lr\)\?$"):
        tether.RunConfig(lr=1e-5)
    with pytest.raises(ConfigError, match=r"^RunConfig\(per_device_train_batch_size=\.\.\.\): unknown key "
                                          r"'per_device_train_batch_size' \(TRL's name\); in tether: `batch_size` "):
        tether.RunConfig(per_device_train_batch_size=8)
    for cls in (tether.RunConfig, tether.SFTConfig, tether.RewardTrainingConfig):  # the table names real keys
        assert set(TRL_KEYS[cls.__name__].values()) <= set(config_keys(cls))


def test_trl_names_in_a_dict_or_yaml_config_and_their_bad_values_are_named(tmp_path):
    from tether.config import as_config
    from tether.errors import ConfigError

    cfg = as_config(tether.RunConfig, {"learning_rate": 2e-6, "kl.coef": 0.3, "max_steps": 7}, check=False)
    assert (cfg.optim.lr, cfg.kl.coef, cfg.steps) == (2e-6, 0.3, 7)
    (tmp_path / "c.yaml").write_text("num_train_epochs: 2\nlearning_rate: 1.0e-4\n")
    sft = as_config(tether.SFTConfig, str(tmp_path / "c.yaml"), check=False)
    assert (sft.optim.epochs, sft.optim.lr) == (2, 1e-4)
    with pytest.raises(ConfigError, match=r"unknown key 'kl.coeff'; did you mean `kl.coef` \(--kl-coef\)\?"):
        as_config(tether.RunConfig, {"kl": {"coeff": 0.1}}, check=False)


@pytest.fixture(scope="module")
def ppo_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_ppo")
    return make_policy_dir(root), make_prompts_file(root, n=16)


def test_ppo_takes_a_path_string_and_trls_argument_names(ppo_files, tmp_path):
    import yaml

    policy, prompts = ppo_files
    cfg = tiny_config(tmp_path, policy, tmp_path / "unused.jsonl", steps=1, batch_size=4)
    cfg.reward.sources = []
    result = tether.PPOTrainer(cfg, prompts=str(prompts), reward=reward_len).train()  # #49's refused call
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["data"]["prompts"] == str(prompts) and result.steps == 1  # the path, as --prompts records it
    settings = {"output_dir": str(tmp_path / "trl"), "max_steps": 1, "learning_rate": 1e-3, "batch_size": 4,
                "max_completion_length": 6, "progress": False, "reward.gold": "none", "ppo.mini_batches": 2}
    trl = tether.PPOTrainer(args=settings, model=str(policy), reward_funcs=[reward_len], train_dataset=str(prompts),
                            eval_dataset=str(prompts)).train()
    saved = yaml.safe_load((trl.run_dir / "config.yaml").read_text())
    assert (saved["model"]["policy"], saved["data"]["eval_prompts"], saved["optim"]["lr"]) == \
        (str(policy), str(prompts), 1e-3)
    assert saved["reward"]["sources"] == ["test_trl_shapes:reward_len"]
    with pytest.raises(TetherError, match=r"^PPOTrainer: prompts and train_dataset name the same thing; give one$"):
        tether.PPOTrainer(cfg, prompts=str(prompts), train_dataset=str(prompts))


def test_sft_trainer_called_as_trl_calls_it_trains_text_rows_on_every_token(tmp_path):
    from transformers import AutoModelForCausalLM

    from tether.sft.evaluate import held_out_loss

    policy = make_policy_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(policy)  # the tokenizer is found from model.name_or_path
    texts = [f"{a}+{b}={a + b}" for a, b in ((12, 30), (7, 8), (40, 2), (3, 99), (10, 10), (5, 6))]
    trainer = tether.SFTTrainer(model=model, train_dataset=[{"text": t} for t in texts[:4]],
                                eval_dataset=[{"text": t} for t in texts[4:]],
                                args={"num_train_epochs": 1, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
                                      "output_dir": str(tmp_path / "sft"), "progress": False})
    run, tok = trainer.run, trainer.run.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts[4:]]
    total = 0.0
    with torch.no_grad():  # every next token of each held-out text, EOS included, one text at a time
        for row in ids:
            logp = torch.log_softmax(trainer.model(input_ids=torch.tensor([row])).logits[0].double(), -1)
            total -= sum(float(logp[t - 1, row[t]]) for t in range(1, len(row)))
    metrics = held_out_loss(run, 5)
    assert metrics["eval/tokens"] == sum(len(r) - 1 for r in ids)
    assert metrics["eval/loss"] == pytest.approx(total / metrics["eval/tokens"], abs=1e-5)
    assert trainer.train().steps == 2  # 4 rows, 2 a step, one epoch
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prompts = make_prompts_file(tmp_path, n=4)
    by_path = tether.SFTTrainer(model=str(policy), train_dataset=str(data), eval_prompts=str(prompts),
                                args={"output_dir": str(tmp_path / "sft2"), "progress": False, "max_steps": 1})
    assert (by_path.cfg.data.files, by_path.cfg.eval.prompts, by_path.cfg.model.path) == \
        ([str(data)], str(prompts), str(policy))  # recorded as the flags record them
    assert len(by_path.run.eval_rows) == 4 and by_path.run.data_info["train_rows"] + by_path.run.data_info[
        "held_out_rows"] == len(texts)


def test_reward_trainer_takes_trls_names_and_a_path_and_refuses_eval_dataset_in_one_line(tmp_path):
    from tether.errors import ConfigError

    policy = make_policy_dir(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
                             + "\n" for i in range(12)))
    result = tether.RewardTrainer(model=str(policy), train_dataset=str(pairs),
                                  args={"output_dir": str(tmp_path / "rm"), "num_train_epochs": 1,
                                        "per_device_train_batch_size": 4}).train()
    meta = json.loads((result.run_dir / "tether_reward.json").read_text())
    assert meta["training"]["data"]["files"] == [str(pairs)] and meta["training"]["model"] == str(policy)
    with pytest.raises(ConfigError, match=r"^RewardTrainer\(eval_dataset=\.\.\.\): tether holds out"):
        tether.RewardTrainer(model=str(policy), train_dataset=str(pairs), eval_dataset=str(pairs))


def test_diagnose_and_report_at_the_top_level(ppo_files, tmp_path):
    from tether.diagnostics.doctor import diagnose_run

    policy, prompts = ppo_files
    run_dir = tether.PPOTrainer(tiny_config(tmp_path, policy, prompts, steps=1, batch_size=4)).train().run_dir
    assert tether.diagnose(run_dir).summary() == diagnose_run(run_dir).summary()
    page = tether.report(run_dir)
    assert page == run_dir / "report.html" and "<html" in page.read_text()[:200].lower()


# ------------------------------------------------------------------------------------ docs/data-formats.md is true
def doc_rows(section: str) -> list[dict]:
    """The literal JSONL rows of one section (``## ...``) of docs/data-formats.md."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "data-formats.md").read_text(encoding="utf-8")
    part = page.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```jsonl\n(.*?)^```", part, re.S | re.M)
    return [json.loads(line) for block in blocks for line in block.splitlines() if line.strip()]


def test_every_row_on_the_data_formats_page_is_read_by_the_real_readers():
    from tether.data import PreferencePair, pair_from_record
    from tether.prompt_rows import prompt_rows
    from tether.rm.steps import example_from_record
    from tether.sft.data import row_from_record

    sft = [row_from_record(r, f"sft {i}") for i, r in enumerate(doc_rows("SFT rows"))]
    assert len(sft) == 6 and [r.whole_text for r in sft] == [True] + [False] * 5
    assert {r.completion for r in sft[1:5]} >= {"42"}
    pairs = [pair_from_record(r, f"pair {i}") for i, r in enumerate(doc_rows("Preference pairs"))]
    assert len(pairs) == 4 and all(isinstance(p, PreferencePair) for p in pairs)
    assert {(p.chosen.strip(), p.rejected.strip()) for p in pairs} == {("42", "43")}
    prompts = prompt_rows(list(enumerate(doc_rows("Prompts"), start=1)), lambda n: f"prompt {n}", "doc")
    assert len(prompts) == 5 and [r.get("answer") for r in prompts] == ["42", None, "42", "42", None]
    steps = [example_from_record(r, f"steps {i}", "\n") for i, r in enumerate(doc_rows("Step-labelled data"))]
    assert [s.labels for s in steps] == [[1, 0], [1, 1], [1, 0]] and all(len(s.steps) == 2 for s in steps)


def test_the_coming_from_trl_tables_are_the_codes_table():
    from pathlib import Path

    from tether.trl_compat.keys import TRL_KEYS, config_keys

    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-trl.md").read_text(encoding="utf-8")
    row = re.compile(r"^\| `(\w+)` \| `([\w.]+)` \| `(--[\w-]+)` \|$", re.M)
    for lead, cls in (("PPO and GRPO (", tether.RunConfig), ("SFT (", tether.SFTConfig),
                      ("Reward model (", tether.RewardTrainingConfig)):
        table = page.split("\n" + lead, 1)[1].split("\n\n", 2)[1]  # the table after the lead-in line
        rows = row.findall(table)
        assert {(trl, key) for trl, key, _ in rows} == set(TRL_KEYS[cls.__name__].items()), lead
        assert all(config_keys(cls)[key] == flag for _, key, flag in rows), lead


def test_a_path_string_is_read_wherever_python_hands_over_a_dataset(tmp_path):
    from tether.data import pairs_from_data
    from tether.errors import DataError
    from tether.prompt_rows import prompts_from_data
    from tether.sft.data import rows_from_data

    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    prompts = jsonl("p.jsonl", [{"prompt": "2+2=", "answer": "4"}, {"question": "3+3?", "answer": "6"}])
    assert [r["prompt"] for r in prompts_from_data(prompts)] == ["2+2=", "3+3?"]
    rows, _ = rows_from_data(jsonl("s.jsonl", [{"text": "abc"}, {"prompt": "p", "completion": "c"}]), "train_data")
    assert [r.whole_text for r in rows] == [True, False]
    pairs, stats = pairs_from_data(jsonl("r.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}]))
    assert (pairs[0].chosen, stats.pairs) == ("a", 1)
    bad = jsonl("bad.jsonl", [{"text": "ok"}, {"text": ""}])
    with pytest.raises(DataError, match=rf"^{re.escape(bad)}: line 2: field 'text' is empty$"):  # the file's line
        rows_from_data(bad, "train_data")
