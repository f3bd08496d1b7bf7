"""What the policy is asked (data.system_prompt, data.prompt_template, HH transcripts as chat turns)."""

from __future__ import annotations

import pytest

from tests.test_recipes import _need_real_models
from tether.errors import ConfigError, TetherError
from tether.rollout.sampling import encode_prompts, prompt_messages

HH = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: add 2 and 3\n\nAssistant:"


def test_hh_transcript_becomes_chat_turns_with_template_and_system():
    assert prompt_messages(HH) == [{"role": "user", "content": "hi there"},
                                   {"role": "assistant", "content": "hello!"},
                                   {"role": "user", "content": "add 2 and 3"}]
    assert prompt_messages(HH, "be brief", "{prompt} (one line)") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "add 2 and 3 (one line)"}]
    # Not a transcript: one user turn, the template around the whole text.
    assert prompt_messages("Tom has 3 apples.", "", "Q: {prompt}\nA number:") == [
        {"role": "user", "content": "Q: Tom has 3 apples.\nA number:"}]


class _RecordingTokenizer:
    """Stands in for a tokenizer: records what it is asked to encode, one id per character."""
    pad_token_id = 0

    def __init__(self):
        self.seen = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize and add_generation_prompt
        self.seen.append(messages)
        return [ord(c) for c in "|".join(m["content"] for m in messages)]

    def __call__(self, text, add_special_tokens):
        self.seen.append(text)
        return {"input_ids": [ord(c) for c in text]}


def test_encode_prompts_applies_the_shaping_with_and_without_chat_template():
    tok = _RecordingTokenizer()
    query, mask = encode_prompts(tok, [HH, "x"], 64, True, "sys", "{prompt}!")
    assert tok.seen[0][0] == {"role": "system", "content": "sys"} and tok.seen[0][-1]["content"] == "add 2 and 3!"
    assert tok.seen[1] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "x!"}]
    assert "".join(chr(i) for i in query[1][mask[1].bool()].tolist()) == "sys|x!"
    tok = _RecordingTokenizer()
    query, mask = encode_prompts(tok, ["12+3="], 3, False, "", "Q {prompt}")
    assert tok.seen == ["Q 12+3="]
    assert "".join(chr(i) for i in query[0].tolist()) == "+3="  # cut from the left to 3 tokens


def test_a_long_chat_prompt_loses_its_oldest_exchange_before_any_token():
    decode = lambda q, m: "".join(chr(i) for i in q[0][m[0].bool()].tolist())  # noqa: E731
    whole = "sys|hi there|hello!|add 2 and 3!"  # one token per character
    assert decode(*encode_prompts(_RecordingTokenizer(), [HH], len(whole), True, "sys", "{prompt}!")) == whole
    assert decode(*encode_prompts(_RecordingTokenizer(), [HH], 20, True, "sys", "{prompt}!")) == "sys|add 2 and 3!"
    # one exchange left and still too long: the last tokens are kept
    assert decode(*encode_prompts(_RecordingTokenizer(), [HH], 10, True, "sys", "{prompt}!")) == "d 2 and 3!"


def test_prompt_options_are_checked(tmp_path):
    from tests.tiny import make_policy_dir, make_prompts_file, tiny_config
    from tether.ppo.setup import setup

    cfg = tiny_config(tmp_path, tmp_path / "nowhere", tmp_path / "p.jsonl")
    cfg.data.prompt_template = "no placeholder"
    with pytest.raises(ConfigError, match="--prompt-template"):
        cfg.validate()
    cfg = tiny_config(tmp_path, make_policy_dir(tmp_path), make_prompts_file(tmp_path), data__system_prompt="hi")
    with pytest.raises(TetherError, match="--system-prompt: .* not prompted through a chat template"):
        setup(cfg)


@pytest.mark.slow
def test_smollm2_sees_an_hh_transcript_as_its_own_chat_turns():
    _need_real_models("smollm2-135m-instruct")
    from tether.hf import load_tokenizer
    from tether.presets import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    query, mask = encode_prompts(tokenizer, [HH], 512, True, "Be brief.")
    text = tokenizer.decode(query[0][mask[0].bool()])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
                    "<|im_start|>assistant\nhello!<|im_end|>\n<|im_start|>user\nadd 2 and 3<|im_end|>\n"
                    "<|im_start|>assistant\n")
