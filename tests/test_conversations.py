"""TRL's conversational data (issue 30): preference pairs as message lists (implicit or explicit prompt), PPO prompts
as messages rendered by the chat template, and ``datasets`` objects handed over from Python — the same pairs and
the same trained reward model as from a file."""

import json

import pytest
from tiny import CHAT_TEMPLATE, make_llama_chat_dir, tiny_config

import tether
from tether.inputs.conversations import conversational_pair, prompt_text
from tether.inputs.pairs import load_preference_pairs, pairs_from_data
from tether.errors import DataError, TetherError

U, A, S = "user", "assistant", "system"


def msg(role, content):
    return {"role": role, "content": content}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------- pairs
def test_implicit_and_explicit_prompts_and_what_carries_no_preference(tmp_path):
    system, ask = msg(S, "be brief"), msg(U, "add 2 and 3")
    rows = [
        {"chosen": [system, ask, msg(A, "5")], "rejected": [system, ask, msg(A, "6")]},              # implicit
        {"prompt": [ask], "chosen": [msg(A, "5")], "rejected": [msg(A, "six")]},                     # explicit
        {"prompt": [ask], "chosen": "5", "rejected": "7", "score": 1},                               # text replies
        {"chosen": [ask, msg(A, "5")], "rejected": [ask, msg(A, "5")]},                              # identical
        {"chosen": [msg(U, "a"), msg(A, "5")], "rejected": [msg(U, "b"), msg(A, "5")]},              # no shared
    ]
    pairs, stats = load_preference_pairs([write_jsonl(tmp_path / "p.jsonl", rows)])
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ([system, ask], "5", "6"), ([ask], "5", "six"), ([ask], "5", "7")]
    assert pairs[0].source == f"{tmp_path / 'p.jsonl'}: line 1"
    assert (stats.pairs, stats.identical, stats.no_shared_prompt) == (3, 1, 1)
    # A datasets.Dataset (as load_dataset gives TRL's data) reads to the same pairs.
    datasets = pytest.importorskip("datasets")
    for row, pair in zip(rows[:2], pairs):  # one dataset per shape: a dataset's columns are its first row's
        from_dataset, _ = pairs_from_data(datasets.Dataset.from_list([row]))
        assert [(p.prompt, p.chosen, p.rejected) for p in from_dataset] == [(pair.prompt, pair.chosen, pair.rejected)]


@pytest.mark.parametrize("row, expected", [
    ({"chosen": [msg(U, "q"), msg(A, "a"), msg(U, "more?")], "rejected": [msg(U, "q"), msg(A, "b")]},
     "line 1: field 'chosen': the reply after the prompt must be one assistant message, got 2 (assistant, user)"),
    ({"chosen": [msg("robot", "q")], "rejected": [msg(U, "q")]},
     "line 1: field 'chosen' message 1: role 'robot' is not one of system, user, assistant"),
    ({"chosen": [{"role": U, "content": [{"type": "text"}]}], "rejected": [msg(U, "q")]},
     "line 1: field 'chosen' message 1: content must be text, got list"),
    ({"chosen": [msg(U, "q"), msg(A, "a")], "rejected": "b"},
     "line 1: 'chosen' and 'rejected' must both be message lists when there is no 'prompt' field ('rejected' is text)"),
    ({"prompt": [msg(U, "q")], "chosen": [msg(A, " ")], "rejected": [msg(A, "b")]},
     "line 1: field 'chosen': the reply is empty"),
])
def test_a_bad_conversational_row_is_one_line_naming_file_line_and_field(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError) as raised:
        load_preference_pairs([path])
    assert str(raised.value) == f"{path}: {expected}"
    with pytest.raises(DataError, match=r"^pairs: row 1: "):  # from Python, rows are numbered
        pairs_from_data([row])


def test_a_message_prompt_is_rendered_by_the_reward_models_chat_template_or_as_a_transcript():
    from test_reward_model import char_tokenizer

    from tether.rm.model import TextFormat

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    prompt = [msg(S, "be brief"), msg(U, "2+2?")]
    text, start, end = TextFormat("chat").render(tokenizer, prompt, "4")
    assert text == tokenizer.apply_chat_template(prompt + [msg(A, "4")], tokenize=False)
    assert text == "system: be brief\nuser: 2+2?\nassistant: 4\n" and text[start:end] == "4"
    plain, start, _ = TextFormat("plain", separator=" ").render(tokenizer, prompt, "4")
    assert plain == "\n\nSystem: be brief\n\nHuman: 2+2?\n\nAssistant: 4" == prompt_text(prompt) + " 4"
    assert conversational_pair({"prompt": "2+2?", "chosen": [msg(A, "4")], "rejected": "5"}, "w") == (
        [msg(U, "2+2?")], "4", "5")


def rm_rows(n=48):
    """Conversational pairs over the demo alphabet: the chosen reply repeats the question's letter."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [{"chosen": [msg(U, f"say {c}"), msg(A, c * 3)], "rejected": [msg(U, f"say {c}"), msg(A, letters[i % 7] * 3)]}
            for i, c in enumerate(letters[:n // 2] * 2) if letters[i % 7] != c]


def test_reward_trainer_takes_a_dataset_and_trains_the_same_model_as_from_the_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    from safetensors.torch import load_file

    backbone = make_llama_chat_dir(tmp_path, hidden=32, layers=1)
    rows = rm_rows()
    config = {"model": str(backbone), "optim": {"epochs": 2, "batch_size": 8, "lr": 1e-3}, "data": {"max_length": 64}}
    from_file = tether.RewardTrainer({**config, "output_dir": str(tmp_path / "a"),
                                      "data.files": [str(write_jsonl(tmp_path / "p.jsonl", rows))]}).train()
    from_data = tether.RewardTrainer({**config, "output_dir": str(tmp_path / "b")},
                                     pairs=datasets.Dataset.from_list(rows)).train()
    assert from_file.metrics == from_data.metrics and from_data.metrics["n_pairs"] > 0
    assert isinstance(from_data.model, tether.RewardModel) and from_data.models["reward_model"] == tmp_path / "b"
    assert from_data.model.text_format.kind == "chat" and from_data.steps == from_file.steps > 0
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    assert all((a[k] == b[k]).all() for k in a)
    meta = json.loads((tmp_path / "b" / "tether_reward.json").read_text())
    assert meta["training"]["data"]["files"] == ["python:pairs"]


# ---------------------------------------------------------------------------------------------- PPO prompts
def test_message_prompts_go_through_the_chat_template_and_reach_rules_as_given(tmp_path):
    from transformers import AutoTokenizer

    from tether.rollout.sampling import encode_prompts, prompt_messages

    policy = make_llama_chat_dir(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    prompt = [msg(S, "be brief"), msg(U, "add 2 and 3")]
    query, mask = encode_prompts(tokenizer, [prompt], 256, True)
    expected = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert query[0].tolist() == list(expected) and mask.all()
    assert prompt_messages(prompt, "other") == [msg(S, "other"), msg(U, "add 2 and 3")]  # --system-prompt wins
    assert tokenizer.chat_template == CHAT_TEMPLATE

    seen = []

    def length_rule(prompts, responses, **columns):
        seen.append((prompts[0], columns.get("answer")))
        return [float(len(r)) for r in responses]

    rows = [{"prompt": [msg(U, f"add {i} and {i + 1}")], "answer": str(2 * i + 1)} for i in range(8)]
    cfg = tiny_config(tmp_path, policy, tmp_path / "unused.jsonl", steps=1, batch_size=4)
    cfg.reward.sources = []
    result = tether.PPOTrainer(cfg, reward=length_rule, prompts=rows).train()
    assert result.steps == 1 and isinstance(seen[-1][0], list) and seen[-1][0][0]["role"] == "user"
    recorded = (result.run_dir / "config.yaml").read_text()
    assert "python:prompts (8 rows, sha256 " in recorded
    with pytest.raises(TetherError, match=r"--prompts python:prompts \(8 rows, sha256 [0-9a-f]+\): this run's prompts "
                                          r"were given from Python"):
        tether.PPOTrainer(result.run_dir / "config.yaml", reward={"length_rule": length_rule}, resume=True)


def test_bad_message_prompts_are_one_line_naming_the_row(tmp_path):
    from tether.ppo.prompts import load_prompts, prompts_from_data

    with pytest.raises(DataError, match=r"^prompts: row 2: field 'prompt': the last message must be the user's, "
                                        r"got 'assistant'$"):
        prompts_from_data([[msg(U, "hi")], [msg(U, "hi"), msg(A, "hello")]])
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [msg(U, "ok")]}, {"prompt": [{"role": U}]}])
    with pytest.raises(DataError, match=rf"^{path}: line 2: field 'prompt' message 1: expected"):
        load_prompts(str(path))
    assert prompts_from_data(["plain text"]) == [{"prompt": "plain text"}]
