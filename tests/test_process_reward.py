"""Process reward models (A9): steps, where step rewards land, the step loss and evaluation, step data,
``train-rm --process``, and PPO with dense step rewards checked against an independent forward pass."""

import json
import math

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.core.steps import (aggregate_steps, clipped_step_reward, first_error, place_step_rewards,
                               split_steps, step_bce_loss, step_token_positions)
from tether.errors import DataError


def test_split_steps_by_hand():
    assert split_steps("64 201 081", " ") == (["64", "201", "081"], [2, 6, None])
    assert split_steps("64 201 ", " ") == (["64", "201"], [2, 6])  # a final separator adds no empty step
    assert split_steps("64  201", " ") == (["64", "", "201"], [2, 3, None])  # an empty step between two
    assert split_steps("", " ") == ([""], [None])
    assert split_steps("a\n\nb", "\n\n") == (["a", "b"], [2, None])  # a multi-character separator


def test_step_token_positions_by_hand():
    # one character per token, then an EOS that decodes to nothing: "64 201" + EOS
    assert step_token_positions([2, None], [1, 2, 3, 4, 5, 6, 6]) == [2, 6]  # the space; the EOS
    # truncated (no EOS): the last step ends on the last sampled token
    assert step_token_positions([2, None], [1, 2, 3, 4, 5]) == [2, 4]
    # "64  201": the empty step ends on the second space
    assert step_token_positions([2, 3, None], [1, 2, 3, 4, 5, 6, 7]) == [2, 3, 6]
    # multi-character tokens "6", "4 2", "01": the separator (char 2) is inside token 1
    assert step_token_positions([2, None], [1, 4, 6]) == [1, 2]


def test_place_step_rewards_adds_steps_on_one_token():
    out = place_step_rewards([[-0.1, -0.2], [-0.3]], [[1, 1], [0]], (2, 3))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.3, 0.0], [-0.3, 0.0, 0.0]]))


def test_clip_reward_aggregation_and_first_error():
    p = torch.tensor([0.9, 0.3, 0.5])
    torch.testing.assert_close(clipped_step_reward(p), torch.tensor([0.0, -0.2, 0.0]))
    torch.testing.assert_close(clipped_step_reward(p, 0.95), torch.tensor([-0.05, -0.65, -0.45]))
    assert aggregate_steps(p, "min") == pytest.approx(0.3) and aggregate_steps(p, "last") == pytest.approx(0.5)
    assert first_error([1, 1, 0, 1]) == 2 and first_error([1, 1]) == -1 and first_error([0]) == 0


def test_step_bce_loss_against_the_formula():
    z = torch.tensor([[2.0, -1.0, 0.5], [0.3, 9.0, 9.0]])
    y = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    terms = [math.log(1 / (1 + math.exp(-2.0))), math.log(1 - 1 / (1 + math.exp(1.0))),
             math.log(1 - 1 / (1 + math.exp(-0.5))), math.log(1 - 1 / (1 + math.exp(-0.3)))]
    assert step_bce_loss(z, y, m).item() == pytest.approx(-sum(terms) / 4, rel=1e-6)


def test_evaluate_steps_by_hand():
    from tether.rm.process import evaluate_steps

    probs = [torch.tensor([0.9, 0.2, 0.8]), torch.tensor([0.7, 0.6]), torch.tensor([0.4, float("nan")])]
    labels = [[1, 0, 0], [1, 1], [1, 1]]
    e = evaluate_steps(probs, labels)
    # scored steps: (0.9,1)✓ (0.2,0)✓ (0.8,0)✗ (0.7,1)✓ (0.6,1)✓ (0.4,1)✗ — the NaN step is not scored
    assert e["n_steps"] == 6 and e["step_accuracy"] == pytest.approx(4 / 6)
    assert e["accuracy_good_steps"] == pytest.approx(3 / 4) and e["accuracy_bad_steps"] == pytest.approx(1 / 2)
    # first errors: predicted 1 vs labelled 1 ✓; none vs none ✓; row 3 has a cut step: not counted
    assert e["n_responses"] == 2 and e["first_error_accuracy"] == 1.0


def test_step_rows_of_every_shape_and_one_line_errors(tmp_path):
    from tether.rm.steps import load_step_examples

    good = tmp_path / "steps.jsonl"
    rows = [{"prompt": "p1", "completions": ["a", "b"], "labels": [True, False]},
            {"prompt": "p2", "steps": ["a", "b", "c"], "labels": [1, 0, -1]},
            {"prompt": "p3", "response": "a\nb", "labels": ["+", "-"]}]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, counts = load_step_examples([good], "\n")
    assert [e.labels for e in examples] == [[1, 0], [1, 0, 0], [1, 0]]
    assert examples[2].steps == ["a", "b"] and counts["steps"] == 7 and counts["good_steps"] == 3
    for row, message in [({"prompt": "p", "completions": ["a"], "labels": [1, 1]}, "1 steps but 2 labels"),
                         ({"prompt": "p", "completions": ["a"], "labels": [2]}, "step 1: label 2"),
                         ({"prompt": "p", "completions": ["a\nb"], "labels": [1]}, "contains the step separator"),
                         ({"prompt": "p", "labels": [1]}, "missing field completions, steps or response")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError) as err:
            load_step_examples([bad], "\n")
        assert f"{bad}: line 2" in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


def test_converter_labels_the_step_task_with_its_rule(tmp_path):
    from tether.demo.steps import STEP_SEPARATOR, chain_problem, gold_reward, step_labels
    from tether.rm.steps import label_with_rule, load_step_examples, write_step_examples

    p = chain_problem([12, 34, 56, 78])
    assert p == {"prompt": "12+34+56+78=", "answer": "64 201 081"}  # 46, 102, 180 units first
    rows = [{"prompt": p["prompt"], "response": r} for r in ("64 201 081", "64 301 081", "65 201", "64 201 081 1")]
    examples = label_with_rule(rows, step_labels, STEP_SEPARATOR)
    # a wrong step 2 with a right final answer: the outcome rule misses what the step rule sees
    assert [e.labels for e in examples] == [[1, 1, 1], [1, 0, 1], [0, 1], [1, 1, 1, 0]]
    assert gold_reward([p["prompt"]] * 4, [r["response"] for r in rows]) == [1.0, 0.0, 0.0, 0.0]
    write_step_examples(examples, tmp_path / "labelled.jsonl")
    again, _ = load_step_examples([tmp_path / "labelled.jsonl"], STEP_SEPARATOR)
    assert [(e.steps, e.labels) for e in again] == [(e.steps, e.labels) for e in examples]


def _random_prm(root, separator=" ", seed=0, max_length=512):
    """A PRM with a random head on a tiny GPT-2, saved as tether saves one."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tether.demo.task import build_tokenizer
    from tether.rm.model import RewardModel, choose_format

    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_layer=1, n_embd=16, n_head=2, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(20.0)  # probabilities spread over (0, 1), so some steps fall below 0.5
    rm = RewardModel(model, tokenizer, choose_format(tokenizer, "plain", max_length=max_length),
                     metadata={"kind": "process", "step_separator": separator})
    rm.save_pretrained(root / "prm")
    return root / "prm", model, tokenizer


def _independent_step_probs(model, tokenizer, prompt, steps, separator=" "):
    """σ(score) of every step prefix by HF's own sequence-classification forward (its last-token pooling)."""
    out = []
    for k in range(len(steps)):
        text = prompt + "".join(s + separator for s in steps[:k + 1])
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out.append(torch.sigmoid(model(input_ids=ids).logits[0, 0]).item())
    return out


def test_score_steps_matches_a_forward_per_step_prefix(tmp_path):
    from tether.rm.process import ProcessRewardModel

    prm_dir, model, tokenizer = _random_prm(tmp_path)
    rm = ProcessRewardModel.from_pretrained(prm_dir, device="cpu")
    prompts, responses = ["12+34=", "1+2=", "9+9="], ["64 201 081", "3", "81  x"]
    got = rm.score_steps(prompts, responses)
    for prompt, response, probs in zip(prompts, responses, got):
        expected = _independent_step_probs(model.eval(), tokenizer, prompt, split_steps(response, " ")[0])
        torch.testing.assert_close(probs, torch.tensor(expected), atol=1e-5, rtol=0)
    # score() of a PRM is its worst step
    torch.testing.assert_close(rm.score(prompts, responses), torch.stack([p.min() for p in got]))


@pytest.mark.parametrize("normalize,threshold", [("none", 0.5), ("batch", 0.9), ("running", 0.9)])
def test_ppo_step_puts_each_step_reward_on_the_token_that_ends_the_step(tmp_path, monkeypatch, normalize,
                                                                         threshold):
    """The dense rewards the PPO step hands to GAE, against positions found by hand in the decoded
    response and scores from an independent forward per step prefix: steps cut by truncation land on the
    last sampled token, the last step of an EOS-ended response on the EOS. With the PRM as the only reward,
    B4's normalisation has nothing to act on: the per-token rewards are the step rewards, exactly."""
    import tether.ppo.step as ppo_module
    from tether.ppo.setup import setup

    prm_dir, model, tokenizer = _random_prm(tmp_path)
    policy = make_policy_dir(tmp_path)
    cfg = tiny_config(tmp_path, policy, make_prompts_file(tmp_path), reward__sources=[str(prm_dir)],
                      kl__coef=0.0, generation__max_new_tokens=8, batch_size=16, steps=1,
                      reward__normalize=normalize, reward__process_threshold=threshold)
    captured = {}
    original_gae = ppo_module.gae

    def spy_gae(rewards, values, mask, gamma, lam, last_values=None):
        captured["rewards"], captured["mask"] = rewards.clone(), mask.clone()
        return original_gae(rewards, values, mask, gamma, lam, last_values)

    original_rollout = ppo_module.rollout_batch

    def spy_rollout(*args, **kwargs):
        out = original_rollout(*args, **kwargs)
        if normalize != "none":  # the random policy seldom writes a space: responses of many steps instead
            out = _step_heavy(out[0], tokenizer)
        captured["rollout"], captured["responses"] = out
        return out

    monkeypatch.setattr(ppo_module, "gae", spy_gae)
    monkeypatch.setattr(ppo_module, "rollout_batch", spy_rollout)
    c = setup(cfg)
    metrics = ppo_module.ppo_step(c, cfg, 1)
    rollout, responses, rewards = captured["rollout"], captured["responses"], captured["rewards"]
    n_multi = n_truncated = 0
    for b, response in enumerate(responses):
        valid = rollout.response[b][rollout.response_mask[b].bool()].tolist()
        chars = [tokenizer.decode([t], skip_special_tokens=True) for t in valid]
        assert "".join(chars) == response
        steps, _ = split_steps(response, " ")
        # by hand: the k-th space token ends step k; the last step (no space after it) ends on the last token
        space_tokens = [j for j, ch in enumerate(chars) if ch == " "]
        expected_positions = space_tokens[:len(steps)] + [len(valid) - 1] * (len(steps) - len(space_tokens))
        prompt = tokenizer.decode(rollout.query[b][rollout.query_mask[b].bool()], skip_special_tokens=True)
        probs = _independent_step_probs(model.eval(), tokenizer, prompt, steps)
        expected = torch.zeros(rewards.shape[1])
        for pos, p in zip(expected_positions, probs):
            expected[pos] += min(p - threshold, 0.0)
        torch.testing.assert_close(rewards[b], expected, atol=2e-5, rtol=0)
        n_multi += len(steps) > 1
        n_truncated += not bool(rollout.ended_with_eos[b])
    assert n_multi > 0 and n_truncated > 0, "the random policy must write spaces and hit max_new_tokens"
    assert metrics["objective/scores_raw"] == pytest.approx(rewards.sum(1).mean().item(), abs=1e-5)


def _step_heavy(rollout, tokenizer):
    """``rollout`` with its responses replaced by digits and spaces (3 to 5 steps in 8 tokens), the even rows
    ended by EOS, the odd ones cut at max_new_tokens; and the decoded texts."""
    import dataclasses
    import random

    rng = random.Random(0)
    width = rollout.response.shape[1]
    rows, lengths = [], []
    for b in range(len(rollout)):
        text = ""
        while len(text) < width:
            text += "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 2))) + " "
        ids = tokenizer(text[:width - 1 - rng.randint(0, 2)] if b % 2 == 0 else text[:width],
                        add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if b % 2 == 0 else [])
        rows.append(ids + [tokenizer.pad_token_id] * (width - len(ids)))
        lengths.append(len(ids))
    device = rollout.response.device
    response = torch.tensor(rows, device=device)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(rollout.response_mask)
    out = dataclasses.replace(rollout, response=response, response_mask=mask.to(device), logprobs_sampler=None,
                              ended_with_eos=torch.arange(len(rollout), device=device) % 2 == 0)
    return out, tokenizer.batch_decode([r[m.bool()] for r, m in zip(out.response, out.response_mask)],
                                       skip_special_tokens=True)


def test_train_rm_process_cli_learns_a_step_rule_and_loads(tmp_path):
    """``tether train-rm --process`` on steps labelled by a rule a tiny model can learn (a step is bad iff it
    holds an 'x'): the loss falls, the held-out step accuracy beats the majority class, the model loads."""
    import random

    from tether.cli import main
    from tether.rm.process import ProcessRewardModel

    backbone = make_policy_dir(tmp_path)
    rng = random.Random(0)
    rows = []
    for i in range(240):
        steps = ["".join(rng.choice("0123456789x") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
        rows.append({"prompt": f"{i:03d}=", "completions": steps, "labels": ["x" not in s for s in steps]})
    data = tmp_path / "steps.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prm"
    code = main(["train-rm", "--process", "--model", str(backbone), "--data", str(data), "--output-dir", str(out),
                 "--step-separator", " ", "--epochs", "6", "--lr", "3e-3", "--batch-size", "16"])
    assert code == 0
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rm/loss"] for r in history[-5:]) < sum(r["rm/loss"] for r in history[:5])
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["step_accuracy"] > evaluation["majority_share"] and evaluation["wilson_low"] > 0.5
    assert evaluation["balanced_accuracy"] > 0.6 and evaluation["n_responses"] == 48
    rm = ProcessRewardModel.from_pretrained(out, device="cpu")
    assert rm.step_separator == " "
    probs = rm.score_steps(["001=", "002="], ["12 x3 4", "5"])
    assert [len(p) for p in probs] == [3, 1] and all(((p > 0) & (p < 1)).all() for p in probs)


def test_outcome_and_process_models_refuse_each_other(tmp_path):
    """A PRM's score is read per step: loading it as an outcome RM (last-token score) is refused, and the
    reverse, each in one line."""
    from tether.errors import TetherError
    from tether.rm.model import RewardModel
    from tether.rm.process import ProcessRewardModel

    prm_dir, model, tokenizer = _random_prm(tmp_path)
    with pytest.raises(TetherError, match="a process reward model .*ProcessRewardModel.from_pretrained"):
        RewardModel.from_pretrained(prm_dir, device="cpu")
    meta = json.loads((prm_dir / "tether_reward.json").read_text())
    meta.pop("kind")
    (prm_dir / "tether_reward.json").write_text(json.dumps(meta))
    with pytest.raises(TetherError, match="needs a process reward model"):
        ProcessRewardModel.from_pretrained(prm_dir, device="cpu")


def test_label_steps_cli_and_its_one_line_errors(tmp_path, capsys):
    from tether.cli import main
    from tether.rm.steps import load_step_examples

    rows = tmp_path / "samples.jsonl"
    rows.write_text(json.dumps({"prompt": "12+34+56+78=", "response": "64 301 081"}) + "\n"
                    + json.dumps({"prompt": "01+02+03+04=", "response": "3 6 01"}) + "\n")
    out = tmp_path / "steps.jsonl"
    assert main(["label-steps", "--input", str(rows), "--rule", "tether.demo.steps:step_labels", "--separator", " ",
                 "--output", str(out)]) == 0
    examples, _ = load_step_examples([out], " ")
    assert [e.labels for e in examples] == [[1, 0, 1], [1, 1, 1]]
    rows.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    assert main(["label-steps", "--input", str(rows), "--rule", "tether.demo.steps:step_labels",
                 "--output", str(tmp_path / "other.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{rows}: line 2: field 'response' must be text") and "\n" not in err
    assert not (tmp_path / "other.jsonl").exists()


def test_process_source_aggregations_and_its_place_among_sources(tmp_path):
    from tether.ppo.sources import ProcessRewardSource, RewardModelSource, RuleSource, build_sources
    from tether.rm.process import ProcessRewardModel

    prm_dir, model, tokenizer = _random_prm(tmp_path)
    prompts, responses = ["12+34=", "1+2="], ["64 201 081", "3"]
    probs = ProcessRewardModel.from_pretrained(prm_dir, device="cpu").score_steps(prompts, responses)
    for how, expected in (("min", [p.min() for p in probs]), ("last", [p[-1] for p in probs]),
                          ("per_step", [(p - 0.5).clamp(max=0).sum() for p in probs])):
        source = ProcessRewardSource(str(prm_dir), how, device="cpu")
        torch.testing.assert_close(source(prompts, responses, {}), torch.stack(expected))
        assert source.dense == (how == "per_step")
    assert source.step_rewards(prompts, responses)[1] == [[2, 6, None], [None]]
    sources = build_sources([str(prm_dir), "tether.demo.steps:gold_reward"], device="cpu")
    assert [type(s) for s in sources] == [ProcessRewardSource, RuleSource]
    assert not any(isinstance(s, RewardModelSource) for s in sources)


def test_dense_step_rewards_with_an_empty_step_eos_and_truncation():
    """Token ids made by hand with the demo's character tokenizer: row 0 "64  1" + EOS (an empty step between
    the two spaces; the last step lands on EOS), row 1 "64 2" cut by max_new_tokens (its last step lands on
    the last sampled token), row 2 "7 " + EOS + padding (a final separator: no empty step after it)."""
    from tether.demo.task import build_tokenizer
    from tether.ppo.sources import dense_step_rewards

    tok = build_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows = [tok("64  1", add_special_tokens=False)["input_ids"] + [eos],
            tok("64 2", add_special_tokens=False)["input_ids"],
            tok("7 ", add_special_tokens=False)["input_ids"] + [eos]]
    width = max(len(r) for r in rows)
    response = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    texts = ["64  1", "64 2", "7 "]
    out = dense_step_rewards([[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6]], [split_steps(t, " ")[1] for t in texts],
                             response, mask, tok)
    expected = torch.zeros(3, width)
    expected[0, 2], expected[0, 3], expected[0, 5] = -0.1, -0.2, -0.3  # space, space, EOS
    expected[1, 2], expected[1, 3] = -0.4, -0.5  # space, the last sampled token
    expected[2, 1] = -0.6  # the final space
    torch.testing.assert_close(out, expected)


def test_within_prompt_accuracy_by_hand():
    from tether.rm.process import evaluate_steps

    probs = [torch.tensor([0.9, 0.8]), torch.tensor([0.9, 0.3]), torch.tensor([0.2]),  # prompt a
             torch.tensor([0.4]), torch.tensor([0.6]), torch.tensor([0.7])]  # prompt b
    labels = [[1, 1], [1, 0], [0], [1], [0], [1]]
    e = evaluate_steps(probs, labels, ["a", "a", "a", "b", "b", "b"])
    # a: good 0.8 vs bad 0.3 ✓, vs 0.2 ✓; b: good 0.4 vs bad 0.6 ✗, good 0.7 vs 0.6 ✓
    assert e["within_prompt_pairs"] == 4 and e["within_prompt_accuracy"] == pytest.approx(3 / 4)
    assert "within_prompt_pairs" not in evaluate_steps(probs, labels)


# ------------------------------------------------------------------- the typed reward record (issue 27, item 6)
STEP_RESPONSES = ["64 201 081", "3", "81  x", "12 34 56 78 9", "7 ", "0 1 2 3 4 5", "99 98", "5 55 555"]


def _by_hand_rollout(tokenizer, responses, truncated=()):
    """A rollout of ``responses`` in the demo's character tokenizer (one token per character), EOS after each
    response except the rows in ``truncated``, right-padded; what :func:`score_rollout` reads of a rollout."""
    from types import SimpleNamespace

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] + ([] if b in truncated else [eos])
            for b, r in enumerate(responses)]
    width = max(len(r) for r in rows)
    return SimpleNamespace(response=torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
                           response_mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
                           ended_with_eos=torch.tensor([b not in truncated for b in range(len(responses))]))


def _expected_dense(model, tokenizer, prompts, responses, width, threshold=0.5):
    """(B, T) step rewards by hand: min(p_k − η, 0) with p_k from HF's own forward per step prefix, on the k-th
    space (the step's separator; one token per character), the last step with no space after it on the
    response's last token (its EOS, or its last character when truncated: see the caller)."""
    out = torch.zeros(len(responses), width)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        steps, _ = split_steps(response, " ")
        spaces = [j for j, ch in enumerate(response) if ch == " "]
        positions = spaces[:len(steps)] + [len(response)] * (len(steps) - len(spaces))  # len(response) = EOS
        for pos, p in zip(positions, _independent_step_probs(model.eval(), tokenizer, prompt, steps)):
            out[b, pos] += min(p - threshold, 0.0)
    return out


@pytest.mark.parametrize("normalize", ["batch", "running"])
def test_prm_only_reward_keeps_the_sequence_channel_zero_under_normalisation(tmp_path, normalize):
    """A per-step PRM as the only source with --normalize batch|running: the sequence channel is exactly 0 (so
    B4 leaves it 0) and the per-token rewards are the PRM's step rewards − β·KL. Computed as a total minus the
    step totals, the channel was a float32 residual of ±1 ulp that the z-score blew up to rewards of ±3.4."""
    from tether.core.advantages import shaped_rewards
    from tether.ppo.config import RewardConfig
    from tether.ppo.sources import ProcessRewardSource, RunningMoments, postprocess_scores, score_rollout

    prm_dir, model, tokenizer = _random_prm(tmp_path)
    # η = 0.9: every step costs something, so the step totals have several terms and float32 rounding
    source = ProcessRewardSource(str(prm_dir), "per_step", threshold=0.9, device="cpu")
    prompts = ["12+34=", "1+2=", "9+9=", "1+1+1+1=", "3+4=", "0+0=", "50+49=", "5+50="]
    rollout = _by_hand_rollout(tokenizer, STEP_RESPONSES)
    scores = score_rollout([source], prompts, STEP_RESPONSES, {}, rollout, tokenizer)
    assert scores.sequence.dtype == torch.float32 and scores.dense.dtype == torch.float32
    assert torch.equal(scores.sequence, torch.zeros(len(prompts)))
    expected_dense = _expected_dense(model, tokenizer, prompts, STEP_RESPONSES, rollout.response.shape[1], 0.9)
    torch.testing.assert_close(scores.dense, expected_dense, atol=2e-5, rtol=0)

    cfg = RewardConfig(normalize=normalize, clip=5.0)
    running = RunningMoments()
    for _ in range(2):  # the running moments' second step too
        sequence = postprocess_scores(scores.sequence, rollout.response_mask.sum(1), rollout.ended_with_eos, cfg,
                                      running)
        assert torch.equal(sequence, torch.zeros(len(prompts))), f"sequence channel after B4: {sequence.tolist()}"
    mask = rollout.response_mask.float()
    kl = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    rewards = shaped_rewards(sequence, kl, 0.1, mask) + scores.dense * mask
    torch.testing.assert_close(rewards, (expected_dense - 0.1 * kl) * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(scores.total, expected_dense.sum(1), atol=1e-5, rtol=0)


def _hf_prob(model, tokenizer, text):
    """σ(score) of ``text`` by HF's own sequence-classification forward (last-token pooling)."""
    with torch.no_grad():
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        return torch.sigmoid(model.eval()(input_ids=ids).logits[0, 0]).item()


def test_over_long_responses_score_the_steps_that_fit(tmp_path):
    """A response longer than the PRM's max_length (14 tokens here; one token per character) is scored, never
    NaN: the prompt loses its start first (down to one token), then the steps whose separator no longer fits
    are cut and earn 0; a first step that alone does not fit is read at the last token that fits (as an
    outcome RM reads a too-long reply). Expected values: HF's forward on the texts written out by hand."""
    from tether.ppo.sources import ProcessRewardSource, score_rollout

    prm_dir, model, tokenizer = _random_prm(tmp_path, max_length=14)
    prompts = ["12+34=", "1+2=", "99+99=", "5+5="]
    responses = ["64 201 081 7 55", "3 4", "891 64 195", "1234567890123456 5"]
    # what the PRM reads of each step: (text, where the step's reward lands in the response); None = cut
    read = [[("=64 ", 2), ("=64 201 ", 6), ("=64 201 081 ", 10), ("=64 201 081 7 ", 12), None],  # 6 + 16 > 14
            [("1+2=3 ", 1), ("1+2=3 4 ", 3)],  # fits: 4 + 4 tokens
            [("99=891 ", 3), ("99=891 64 ", 6), ("99=891 64 195 ", 9)],  # loses "99+"; cut: its last token
            [("=1234567890123", 16), None]]  # the first step alone is 17 tokens: read at token 14
    probs = [[None if r is None else _hf_prob(model, tokenizer, r[0]) for r in row] for row in read]
    eta = 0.9
    rollout = _by_hand_rollout(tokenizer, responses, truncated={2})
    expected_dense = torch.zeros(rollout.response.shape)
    for b, row in enumerate(read):
        for r, p in zip(row, probs[b]):
            if r is not None:
                expected_dense[b, r[1]] += min(p - eta, 0.0)
    source = ProcessRewardSource(str(prm_dir), "per_step", threshold=eta, device="cpu")
    scores = score_rollout([source], prompts, responses, {}, rollout, tokenizer)
    assert torch.isfinite(scores.dense).all() and torch.isfinite(scores.sequence).all()
    torch.testing.assert_close(scores.dense, expected_dense, atol=2e-5, rtol=0)
    assert (expected_dense < 0).sum() == 10  # every step that was read costs something at η = 0.9
    torch.testing.assert_close(source(prompts, responses, {}), expected_dense.sum(1), atol=2e-5, rtol=0)
    judged = [[p for p in row if p is not None] for row in probs]
    for how, expected in (("min", [min(j) for j in judged]), ("last", [j[-1] for j in judged])):
        got = ProcessRewardSource(str(prm_dir), how, device="cpu")(prompts, responses, {})
        torch.testing.assert_close(got, torch.tensor(expected), atol=2e-5, rtol=0)
