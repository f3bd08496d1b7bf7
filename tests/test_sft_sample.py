"""`tether sample` (S4): which samples are kept, worked by hand; a rule gets the row's columns and ended_with_eos and
judges what is kept; a reward model's standardised score keeps the best of N; the counts; the rows feed
`tether sft`; and a real chat model (SmolLM2) sampled with a system prompt and a prompt template."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tether.cli import main
from tether.sft.sample import SampleConfig, kept_rows, preference_pairs, rejection_sample
from test_presets import SMOL, needs_smollm2
from tiny import make_policy_dir, make_prompts_file


def counts0():
    return {"accepted": 0, "prompts_with_kept": 0}


def test_kept_rows_by_hand():
    chunk = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}]
    responses = ["a", " a ", "b", "c", "d", "e"]
    scores = [1.0, 2.0, 0.2, 1.0, math.nan, 3.0]
    ended = [True, True, True, True, True, False]
    cfg = SampleConfig()
    counts = counts0()
    rows = kept_rows(chunk, responses, scores, ended, 3, cfg, counts)
    # p0: "a" and " a " are one text (best score 2, kept as sampled), "b" below 0.5; p1: "c"; NaN and a cut "e" out
    assert rows == [{"answer": "1", "prompt": "p0", "completion": " a ", "score": 2.0},
                    {"answer": "2", "prompt": "p1", "completion": "c", "score": 1.0}]
    assert counts == {"accepted": 3, "prompts_with_kept": 2}
    cfg.accept.require_eos = False
    rows = kept_rows(chunk, responses, scores, ended, 3, cfg, counts0())
    assert [r["completion"] for r in rows] == [" a ", "e", "c"]  # best first per prompt
    cfg.accept.max_per_prompt = 1
    assert [r["completion"] for r in kept_rows(chunk, responses, scores, ended, 3, cfg, counts0())] == [" a ", "e"]
    cfg.accept.max_per_prompt, cfg.accept.keep = 0, "best"
    assert [r["completion"] for r in kept_rows(chunk, responses, scores, ended, 3, cfg, counts0())] == [" a ", "e"]


def test_preference_pairs_by_hand():
    """--keep pairs: accepted ≻ rejected of the same prompt, distinct texts, best chosen and worst rejected first; a
    cut reply is rejected (--require-eos), a NaN is neither, a text on both sides gives no pair, a prompt whose samples
    all passed gives none."""
    chunk = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}, {"prompt": "p2", "answer": "3"}]
    responses = ["a", "b", " a ", "c", "x",   # p0
                 "d", "d", "e", "f", "g",     # p1: "d" accepted once and cut once: on both sides
                 "h", "i", "j", "k", "l"]     # p2: every sample passed
    scores = [1.0, 0.0, 2.0, 0.3, math.nan,
              1.0, 1.0, 0.0, 1.0, 1.0,
              1.0, 1.0, 1.0, 1.0, 1.0]
    ended = [True] * 5 + [True, False, True, True, False] + [True] * 5
    cfg = SampleConfig()
    cfg.accept.keep = "pairs"
    counts = counts0()
    rows = preference_pairs(chunk, responses, scores, ended, 5, cfg, counts)
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("p0", " a ", "b"), ("p0", " a ", "c"),  # "a" = " a " (best 2.0, as sampled); "b" 0.0 before "c" 0.3
        # tied chosen in sampling order; rejected worst first ("e" 0.0, then the cut "d" and "g"); "d" ≻ "d" dropped
        ("p1", "d", "e"), ("p1", "d", "g"), ("p1", "f", "e"), ("p1", "f", "d"), ("p1", "f", "g")]
    assert rows[0] == {"answer": "1", "prompt": "p0", "chosen": " a ", "rejected": "b", "chosen_score": 2.0,
                       "rejected_score": 0.0}
    assert counts == {"accepted": 2 + 2 + 5, "prompts_with_kept": 2}
    cfg.accept.max_per_prompt = 1
    assert [(r["chosen"], r["rejected"]) for r in kept_rows(chunk, responses, scores, ended, 5, cfg, counts0())] == [
        (" a ", "b"), ("d", "e")]


def test_length_matched_pairs():
    """--pair-length-gap N: a pair only where the two stripped replies differ by at most N characters — "The answer
    is 7." against "The answer is 12." (1 apart) is kept, against "I think it is 7, because seven." (15) is not."""
    chunk = [{"prompt": "3 + 4 ="}]
    responses = ["The answer is 7.", " The answer is 12. ", "I think it is 9, because nine.", "The answer is -1."]
    cfg = SampleConfig()
    cfg.accept.keep, cfg.accept.pair_length_gap = "pairs", 1
    rows = preference_pairs(chunk, responses, [1.0, 0.0, 0.0, 0.0], [True] * 4, 4, cfg, counts0())
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("The answer is 7.", " The answer is 12. "),
                                                            ("The answer is 7.", "The answer is -1.")]
    cfg.accept.pair_length_gap = 0
    assert len(preference_pairs(chunk, responses, [1.0, 0.0, 0.0, 0.0], [True] * 4, 4, cfg, counts0())) == 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    return make_policy_dir(root), make_prompts_file(root, n=6)


def test_a_rule_with_ended_with_eos_judges_every_sample_and_decides_what_is_kept(files, tmp_path):
    policy, prompts = files
    seen = []

    def judge(prompts, responses, answer=None, ended_with_eos=None):
        seen.append((list(prompts), list(responses), list(answer), list(ended_with_eos)))
        return [float(len(r) % 2 == 0) for r in responses]  # even-length replies accepted

    out = tmp_path / "rft.jsonl"
    result = rejection_sample({"model": {"policy": str(policy)}, "data": {"prompts": str(prompts)},
                               "output": str(out), "samples_per_prompt": 4, "batch_size": 4, "progress": False,
                               "generation": {"max_new_tokens": 5}, "accept": {"require_eos": False}},
                               reward={"judge": judge})
    prompts_seen = [p for batch in seen for p in batch[0]]
    responses = [r for batch in seen for r in batch[1]]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    file_rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert prompts_seen == [r["prompt"] for r in file_rows for _ in range(4)]  # K adjacent samples per prompt
    assert [a for batch in seen for a in batch[2]] == [r["answer"] for r in file_rows for _ in range(4)]
    assert all(isinstance(e, bool) for batch in seen for e in batch[3])
    expected = []
    for i, row in enumerate(file_rows):
        distinct = []
        for text in responses[4 * i:4 * i + 4]:
            if len(text) % 2 == 0 and text.strip() not in [t.strip() for t in distinct]:
                distinct.append(text)
        expected += [(row["prompt"], text) for text in distinct]
    assert [(r["prompt"], r["completion"]) for r in rows] == expected
    c = result.counts
    assert (c["prompts"], c["samples"], c["kept"]) == (6, 24, len(expected))
    assert c["accepted"] == sum(len(r) % 2 == 0 for r in responses)
    assert c["prompts_with_kept"] == len({p for p, _ in expected})
    summary = json.loads((tmp_path / "rft.jsonl.summary.json").read_text())
    assert summary["counts"] == c and summary["config"]["accept"]["sources"] == ["python:judge"]


def test_pairs_of_the_policys_own_samples_feed_train_rm(files, tmp_path):
    """--keep pairs from a rule's verdicts: every written pair is an accepted ≻ a rejected sample of the same prompt,
    and tether train-rm trains on the file as it is (extra columns ignored)."""
    from tether.cli import main

    policy, prompts = files

    def judge(prompts, responses, **fields):
        return [float(len(r) % 2 == 0) for r in responses]

    out = tmp_path / "pairs.jsonl"
    rejection_sample({"model": {"policy": str(policy)}, "data": {"prompts": str(prompts)}, "output": str(out),
                      "samples_per_prompt": 6, "batch_size": 6, "progress": False, "generation": {"max_new_tokens": 5},
                      "accept": {"require_eos": False, "keep": "pairs"}}, reward={"judge": judge})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(len(r["chosen"]) % 2 == 0 and len(r["rejected"]) % 2 == 1 for r in rows)
    assert all(r["chosen_score"] == 1.0 and r["rejected_score"] == 0.0 for r in rows)
    assert main(["train-rm", "--model", str(policy), "--data", str(out), "--output-dir", str(tmp_path / "rm"),
                 "--epochs", "1", "--batch-size", "4", "--eval-fraction", "0.2"]) == 0


def test_a_reward_model_keeps_the_best_of_n_and_the_rows_feed_sft(files, tmp_path, capsys):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tether.demo.task import build_tokenizer
    from tether.rm.model import RewardModel, choose_format

    policy, prompts = files
    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_layer=1, n_embd=16, n_head=2, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rm = RewardModel(GPT2ForSequenceClassification(config), tokenizer, choose_format(tokenizer, "plain"))
    rm.set_normalization(torch.tensor([0.5, 1.5]))
    rm.save_pretrained(tmp_path / "rm")
    out = tmp_path / "bon.jsonl"
    assert main(["sample", "--policy", str(policy), "--prompts", str(prompts), "--reward", str(tmp_path / "rm"),
                 "--min-score", "-100", "--keep", "best", "--require-eos", "false", "--samples-per-prompt", "3",
                 "--max-new-tokens", "4", "--output", str(out), "--progress", "false"]) == 0
    assert "6 prompts x 3 samples" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6  # one per prompt: the best of 3
    scorer = RewardModel.from_pretrained(tmp_path / "rm", device="cpu")
    again = scorer.score([r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert torch.allclose(again, torch.tensor([r["score"] for r in rows]), atol=1e-5)
    assert main(["sft", "--model", str(policy), "--data", str(out), "--output-dir", str(tmp_path / "sft"),
                 "--max-steps", "2", "--batch-size", "3", "--eval-fraction", "0", "--progress", "false"]) == 0


@needs_smollm2
def test_smollm2_with_a_system_prompt_and_a_template_writes_the_context_it_sampled_in(tmp_path):
    from tether.presets import resolve_model_path
    from tether.rollout.sampling import encode_prompts
    from transformers import AutoTokenizer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "Tom has 3 apples and buys 2. How many now?",
                                   "answer": "He has 3 + 2 = 5.\n#### 5"}) + "\n", encoding="utf-8")
    seen = []

    def anything(prompts, responses, ended_with_eos=None, **_):
        seen.append(list(ended_with_eos))
        return [1.0] * len(responses)

    out = tmp_path / "smol.jsonl"
    result = rejection_sample({"model": {"policy": SMOL}, "data": {"prompts": str(prompts),
                                                                   "system_prompt": "Answer with a number.",
                                                                   "prompt_template": "Q: {prompt}"},
                               "output": str(out), "samples_per_prompt": 2, "format": "messages", "progress": False,
                               "generation": {"max_new_tokens": 6}, "accept": {"require_eos": False}},
                              reward={"anything": anything})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(rows) <= 2 and result.counts["samples"] == 2 and len(seen[0]) == 2
    for row in rows:
        assert row["messages"][:2] == [{"role": "system", "content": "Answer with a number."},
                                       {"role": "user", "content": "Q: Tom has 3 apples and buys 2. How many now?"}]
        assert row["messages"][2]["role"] == "assistant" and row["answer"] == "5"
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(SMOL, what="policy")))
    query, mask = encode_prompts(tok, ["Tom has 3 apples and buys 2. How many now?"], 512, True,
                                 "Answer with a number.", "Q: {prompt}")
    rendered = tok.apply_chat_template(rows[0]["messages"][:2], tokenize=False, add_generation_prompt=True)
    assert tok.decode(query[0][mask[0].bool()]) == rendered  # the rows hold the very context sampled in


def test_sample_with_the_vllm_engine(tmp_path):
    """The optional engine: the same contract (K adjacent samples a prompt, ended_with_eos to the rule, the counts).
    Skips where vLLM is not installed; CI runs it in its vLLM environment."""
    from tether.rollout.vllm_engine import INSTALL
    from tiny import make_llama_chat_dir

    pytest.importorskip("vllm", reason=f"vLLM is not installed: {INSTALL}")
    policy = make_llama_chat_dir(tmp_path)  # heads 32 wide: vLLM's CPU kernels take them
    prompts = make_prompts_file(tmp_path, n=3)
    seen = []

    def judge(prompts, responses, ended_with_eos=None, **_):
        seen.append((list(prompts), list(ended_with_eos)))
        return [1.0] * len(responses)

    result = rejection_sample({"model": {"policy": str(policy)}, "data": {"prompts": str(prompts)},
                               "output": str(tmp_path / "v.jsonl"), "samples_per_prompt": 4, "progress": False,
                               "generation": {"engine": "vllm", "max_new_tokens": 6},
                               "accept": {"require_eos": False}}, reward={"judge": judge})
    file_rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert [p for batch, _ in seen for p in batch] == [r["prompt"] for r in file_rows for _ in range(4)]
    assert result.counts["samples"] == 12 and 3 <= result.counts["kept"] <= 12
    assert result.counts["prompts_with_kept"] == 3
