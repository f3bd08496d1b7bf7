"""The demo's building blocks: task, gold rule, tokenizer, policy, SFT, generation, accuracy, preference pairs."""

from __future__ import annotations

import math

import pytest
import torch

from tether.demo import pairs as pairs_mod
from tether.demo import sft as sft_mod
from tether.demo.pairs import make_preference_pairs
from tether.demo.sft import (
    generate_answers,
    gold_accuracy,
    sft_to_accuracy,
    sft_train,
)
from tether.demo.task import (
    CHARACTERS,
    build_policy,
    build_tokenizer,
    gold_reward,
    make_problems,
    solve,
    split_problems,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny_policy(tok, seed=0):
    return build_policy(tok, seed, n_layer=1, n_embd=32, n_head=2)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_every_character(tok):
    ids = tok(CHARACTERS, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARACTERS)  # one token per character
    assert len(set(ids)) == len(CHARACTERS)
    assert tok.unk_token_id not in ids
    for ch in CHARACTERS:
        one = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(one) == 1 and tok.decode(one) == ch
    assert tok.decode(ids) == CHARACTERS


def test_tokenizer_special_tokens(tok):
    specials = {tok.pad_token_id, tok.eos_token_id, tok.unk_token_id}
    assert len(specials) == 3
    assert tok.bos_token_id == tok.eos_token_id
    assert tok("123+045=")["input_ids"] == tok("123+045=", add_special_tokens=False)["input_ids"]  # nothing added
    assert tok("1é2", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id
    text_ids = tok("168", add_special_tokens=False)["input_ids"]
    assert tok.decode(text_ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "168"


def test_tokenizer_padding_side_and_reload(tmp_path):
    from transformers import AutoTokenizer

    right = build_tokenizer(padding_side="right")
    batch = right(["1", "123"], padding=True, add_special_tokens=False)["input_ids"]
    assert batch[0] == [right.convert_tokens_to_ids("1"), right.pad_token_id, right.pad_token_id]
    left = build_tokenizer(save_dir=tmp_path)
    batch = left(["1", "123"], padding=True, add_special_tokens=False)["input_ids"]
    assert batch[0] == [left.pad_token_id, left.pad_token_id, left.convert_tokens_to_ids("1")]

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.get_vocab() == left.get_vocab()
    assert again.padding_side == "left"
    assert (again.pad_token_id, again.eos_token_id, again.unk_token_id) == (0, 1, 2)
    ids = left(CHARACTERS, add_special_tokens=False)["input_ids"]
    assert again(CHARACTERS, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(again("907+093=", add_special_tokens=False)["input_ids"]) == "907+093="


def test_policy_config_ids_and_seeded_init(tok):
    model = build_policy(tok, seed=3)
    cfg = model.config
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 1)
    assert cfg.vocab_size == len(tok) and (cfg.n_layer, cfg.n_embd, cfg.n_head) == (3, 128, 4)
    assert 0.55e6 < sum(p.numel() for p in model.parameters()) < 0.65e6  # the measured 0.6M model
    rng = torch.get_rng_state()
    a, b, c = tiny_policy(tok, seed=3), tiny_policy(tok, seed=3), tiny_policy(tok, seed=4)
    assert torch.equal(torch.get_rng_state(), rng)  # seeded without touching the global RNG
    assert torch.equal(a.transformer.wte.weight, b.transformer.wte.weight)
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


# ---------------------------------------------------------------- problems and the gold rule


def test_problems_are_well_formed_deterministic_and_distinct():
    a = make_problems(300, seed=7)
    assert a == make_problems(300, seed=7)
    assert a != make_problems(300, seed=8)
    assert len({p["prompt"] for p in a}) == 300
    for p in a:
        x, y = p["prompt"][:3], p["prompt"][4:7]
        assert len(p["prompt"]) == 8 and p["prompt"][3] == "+" and p["prompt"][7] == "="
        assert p["answer"] == f"{int(x) + int(y):04d}"[::-1]  # the sum, units digit first, 4 digits
        assert int(p["answer"][::-1]) == int(x) + int(y) and len(p["answer"]) == 4
    assert make_problems(5, seed=1, exclude={p["prompt"] for p in make_problems(5, seed=1)}) != make_problems(5, 1)


def test_two_digit_variant_can_use_the_whole_space():
    train, held = split_problems(seed=0, n_train=9500, n_eval=500, digits=2)
    prompts = {p["prompt"] for p in train} | {p["prompt"] for p in held}
    assert len(prompts) == 10_000  # every 2-digit problem, each exactly once
    assert all(len(p) == 6 for p in prompts)
    assert all(p["answer"] == f"{int(p['prompt'][:2]) + int(p['prompt'][3:5]):03d}"[::-1] for p in held)
    assert {len(p["answer"]) for p in train} == {3}  # one width: 5 + 5 = 10 is "010", 99 + 99 = 198 is "891"
    with pytest.raises(ValueError):
        make_problems(9501, seed=0, exclude={p["prompt"] for p in held}, digits=2)


def test_split_is_disjoint_and_held_out_does_not_depend_on_n_train():
    train, held = split_problems(seed=0, n_train=5000, n_eval=500)
    assert len(train) == 5000 and len(held) == 500
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    train2, held2 = split_problems(seed=0, n_train=200, n_eval=500)
    assert held2 == held and train2 == split_problems(seed=0, n_train=200, n_eval=500)[0]
    assert split_problems(seed=1, n_train=10, n_eval=500)[1] != held


def test_gold_reward_hand_written_cases():
    prompts = ["123+045="] * 8 + ["000+000=", "999+999="]
    # 123 + 45 = 168, written units first and padded to 4 digits: "8610"; unpadded, or the usual order, is wrong
    responses = ["8610", "861", "8610 ", " 8610", "0168", "0861", "", "-8610", "0000", "8991"]
    assert gold_reward(prompts, responses) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # the prompt row's answer column is used when given (a rule sees extra columns as keyword lists)
    assert gold_reward(["123+045="], ["168"], answer=["999"], other=["x"]) == [0.0]
    assert gold_reward(["123+045="], ["168"], answer=[168]) == [1.0]  # a number read from JSON
    assert solve("999+001=") == "0001" and solve("500+500=") == "0001" and solve("010+000=") == "0100"
    with pytest.raises(ValueError):
        gold_reward(["123+045="], ["168", "168"])
    assert solve("07+05=") == "210" and solve("00+00=") == "000"  # the 2-digit variant: 3 digits
    for bad in ["12+345=", "123-045=", "123+045", "+=", "12a+045="]:
        with pytest.raises(ValueError):
            solve(bad)


# ---------------------------------------------------------------- SFT


def test_sft_steps_reduce_loss_and_change_every_parameter(tok):
    model = tiny_policy(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = sft_train(model, tok, make_problems(512, seed=0), steps=40, batch_size=32, lr=3e-3, progress=False)
    losses = stats["losses"]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert stats["final_loss"] == pytest.approx(sum(losses[-20:]) / 20)
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name


def test_sft_to_accuracy_stops_at_the_first_check_that_reaches_the_target(tok, monkeypatch):
    def fake_accuracies(values):
        it = iter(values)
        return lambda model, tokenizer, dev, **kwargs: {"accuracy": next(it)}

    train, dev = make_problems(64, seed=0), make_problems(8, seed=1)
    model = tiny_policy(tok)
    monkeypatch.setattr(sft_mod, "gold_accuracy", fake_accuracies([0.1, 0.3, 0.6, 0.9]))
    out = sft_to_accuracy(model, tok, train, dev, target=0.5, max_steps=20, check_every=2, batch_size=8,
                          progress=False)
    assert out["steps"] == 6 and len(out["losses"]) == 6
    assert out["dev_curve"] == [(2, 0.1), (4, 0.3), (6, 0.6)] and out["reached"]
    # never reached: runs to max_steps and checks there too
    monkeypatch.setattr(sft_mod, "gold_accuracy", fake_accuracies([0.2, 0.4]))
    missed = sft_to_accuracy(model, tok, train, dev, target=0.99, max_steps=3, check_every=2, batch_size=8,
                             progress=False)
    assert missed["steps"] == 3 and missed["dev_curve"] == [(2, 0.2), (3, 0.4)] and not missed["reached"]


def test_sft_to_accuracy_checks_every_fine_every_steps_once_half_way(tok, monkeypatch):
    it = iter([0.1, 0.3, 0.45, 0.5, 0.7])
    monkeypatch.setattr(sft_mod, "gold_accuracy", lambda model, tokenizer, dev, **kwargs: {"accuracy": next(it)})
    out = sft_to_accuracy(tiny_policy(tok), tok, make_problems(64, seed=0), make_problems(8, seed=1), target=0.6,
                          max_steps=40, check_every=10, fine_every=3, batch_size=8, progress=False)
    # coarse at 10 and 20 (0.3 = target / 2 reached there), then at every multiple of 3: 21, 24, 27
    assert out["dev_curve"] == [(10, 0.1), (20, 0.3), (21, 0.45), (24, 0.5), (27, 0.7)] and out["steps"] == 27


def test_sft_to_accuracy_can_stop_at_pass_at_k(tok, monkeypatch):
    seen = []

    def fake_pass(model, tokenizer, dev, k, seed):
        seen.append((k, seed))
        return [0.5, 0.9][len(seen) - 1]

    monkeypatch.setattr(sft_mod, "pass_at_k", fake_pass)
    monkeypatch.setattr(sft_mod, "gold_accuracy", lambda *a, **k: pytest.fail("greedy accuracy used"))
    out = sft_to_accuracy(tiny_policy(tok), tok, make_problems(64, seed=0), make_problems(8, seed=1), target=0.85,
                          max_steps=20, check_every=2, pass_k=8, batch_size=8, progress=False)
    assert out["steps"] == 4 and out["dev_curve"] == [(2, 0.5), (4, 0.9)] and seen == [(8, 2), (8, 4)]


def test_pass_at_k_counts_a_problem_once_any_sample_is_right(tok, monkeypatch):
    problems = [{"prompt": "001+001=", "answer": "2"}, {"prompt": "002+002=", "answer": "4"}]
    replies = iter([("2", True), ("3", True), ("9", True), ("4", False)])  # 2nd problem: right text, no EOS
    monkeypatch.setattr(sft_mod, "generate_answers", lambda model, tokenizer, prompts, **kw: [
        {"response": r, "ended_with_eos": e} for r, e in (next(replies) for _ in prompts)])
    assert sft_mod.pass_at_k(None, tok, problems, k=2, seed=0) == 0.5


def test_same_seed_same_weights_and_samples(tok):
    """The same-machine half of the demo's determinism: SFT and seeded sampling repeat bit for bit."""
    runs = []
    for _ in range(2):
        model = tiny_policy(tok)
        sft_train(model, tok, make_problems(256, seed=0), steps=10, batch_size=32, lr=3e-3, seed=3, progress=False)
        gens = generate_answers(model, tok, ["123+045=", "999+999="] * 8, greedy=False, seed=11)
        runs.append(([p.detach().clone() for p in model.parameters()], gens))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1] == runs[1][1]


# ---------------------------------------------------------------- generation and accuracy


def test_generate_answers_greedy_same_alone_and_in_left_padded_batch(tok):
    # Weights ~ N(0, 1) make the greedy output depend sharply on the context and on the positions
    # (a freshly initialised model writes "=====" whatever it sees, which would test nothing).
    model = tiny_policy(tok, seed=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    prompt, longer = "123+045=", "9999+9999=+12"
    alone = generate_answers(model, tok, [prompt], max_new_tokens=6)
    # the longer prompt in the batch puts 5 pad tokens to the left of ours
    batch = generate_answers(model, tok, ["321+555=", longer, prompt], max_new_tokens=6)
    assert batch[2] == alone[0]
    assert len(tok(alone[0]["response"], add_special_tokens=False)["input_ids"]) == 6
    # the check can fail: attending to the pads changes the answer
    enc = tok(["321+555=", longer, prompt], padding=True, return_tensors="pt")
    wrong = model.generate(input_ids=enc["input_ids"], attention_mask=torch.ones_like(enc["input_ids"]),
                           max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(wrong[2, enc["input_ids"].shape[1]:], skip_special_tokens=True) != alone[0]["response"]


def test_sampling_is_repeatable_with_a_seed(tok):
    model = tiny_policy(tok, seed=2)
    prompts = [p["prompt"] for p in make_problems(16, seed=0)]
    rng = torch.get_rng_state()
    a = generate_answers(model, tok, prompts, greedy=False, temperature=1.0, seed=5)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    assert a == generate_answers(model, tok, prompts, greedy=False, temperature=1.0, seed=5)
    assert a != generate_answers(model, tok, prompts, greedy=False, temperature=1.0, seed=6)


def test_gold_accuracy_requires_eos_and_reports_wilson(tok, monkeypatch):
    fake = [
        {"response": "168", "ended_with_eos": True},  # right
        {"response": "168", "ended_with_eos": False},  # right text, cut off: wrong
        {"response": "167", "ended_with_eos": True},  # wrong
    ]
    monkeypatch.setattr(sft_mod, "generate_answers", lambda *a, **k: fake)
    probs = [{"prompt": "123+045=", "answer": "168"}] * 3
    acc = gold_accuracy(None, tok, probs)
    assert acc["correct"] == [1, 0, 0] and acc["n"] == 3 and acc["accuracy"] == pytest.approx(1 / 3)
    z, n, p = 1.96, 3, 1 / 3  # Wilson score interval by hand
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (acc["low"], acc["high"]) == (pytest.approx(centre - half), pytest.approx(centre + half))
    assert acc["eos_rate"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------- preference pairs


def test_pairing_logic_on_given_samples(tok, monkeypatch):
    e = lambda r: {"response": r, "ended_with_eos": True}  # noqa: E731
    cut = lambda r: {"response": r, "ended_with_eos": False}  # noqa: E731
    samples = [
        e("168"), e("167"), e("168"), e("167"), cut("168"), cut("1689"),  # mixed
        e("1000"), e("1000"), e("1000"), e("1000"), e("1000"), e("1000"),  # all correct
        e("5"), e("6"), cut("7"), e("5"), e("5"), e("5"),  # all wrong
    ]
    monkeypatch.setattr(pairs_mod, "generate_answers", lambda *a, **k: samples)
    probs = [{"prompt": "123+045=", "answer": "168"}, {"prompt": "999+001=", "answer": "1000"},
             {"prompt": "002+002=", "answer": "4"}]
    pairs, stats = make_preference_pairs(None, tok, probs, samples_per_prompt=6, temperature=1.0, seed=0)
    assert pairs == [
        {"prompt": "123+045=", "chosen": "168", "rejected": "167"},
        {"prompt": "123+045=", "chosen": "168", "rejected": "1689"},
    ]
    assert stats["prompts_with_both"] == 1 and stats["prompts_all_correct"] == 1 and stats["prompts_all_wrong"] == 1
    assert stats["skipped_same_text"] == 1 and stats["n_pairs"] == 2 and stats["n_samples"] == 18
    assert stats["sample_accuracy"] == pytest.approx(8 / 18)
    capped, _ = make_preference_pairs(None, tok, probs, 6, 1.0, 0, max_pairs_per_prompt=1)
    assert capped == pairs[:1]


def test_an_empty_reply_is_not_paired_and_the_file_is_what_train_rm_reads(tok, monkeypatch, tmp_path):
    # The policy can end at once (its first token [EOS]): the reply decodes to "". Wrong, but train-rm's reader
    # refuses an empty side, so it is left out and counted; the written pairs.jsonl loads with no --skip-invalid.
    from tether.demo.pairs import write_pairs
    from tether.rm import train as rm_train  # the very reader `tether train-rm --pairs FILE` calls

    e = lambda r: {"response": r, "ended_with_eos": True}  # noqa: E731
    samples = [e("168"), e(""), e("167"), e(""),  # right, empty, wrong, empty again (one distinct empty text)
               e("1000"), e(""), e(" "), e("1000")]  # right, and only blank wrong replies: no pair at all
    monkeypatch.setattr(pairs_mod, "generate_answers", lambda *a, **k: samples)
    probs = [{"prompt": "123+045=", "answer": "168"}, {"prompt": "999+001=", "answer": "1000"}]
    pairs, stats = make_preference_pairs(None, tok, probs, samples_per_prompt=4, temperature=1.0, seed=0)
    assert pairs == [{"prompt": "123+045=", "chosen": "168", "rejected": "167"}]
    assert stats["skipped_empty"] == 3 and stats["skipped_same_text"] == 0  # "" once, then "" and " "
    assert stats["prompts_with_both"] == 1 and stats["n_pairs"] == 1
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    loaded, read = rm_train.load_preference_pairs([tmp_path / "pairs.jsonl"])
    assert [(q.prompt, q.chosen, q.rejected) for q in loaded] == [("123+045=", "168", "167")]
    assert read.invalid == 0 and read.pairs == 1


def test_real_samples_pair_correct_over_wrong(tok):
    # A tiny model that has memorised four problems samples a mix of right and wrong answers at T=1.5.
    probs = make_problems(4, seed=11)
    model = tiny_policy(tok, seed=0)
    sft_train(model, tok, probs, steps=60, batch_size=4, lr=1e-2, progress=False)
    pairs, stats = make_preference_pairs(model, tok, probs, samples_per_prompt=32, temperature=1.5, seed=0,
                                         progress=False)
    assert stats["n_pairs"] == len(pairs) > 0 and stats["n_samples"] == 128
    answers = {p["prompt"]: p["answer"] for p in probs}
    for pair in pairs:
        assert gold_reward([pair["prompt"]], [pair["chosen"]], answer=[answers[pair["prompt"]]]) == [1.0]
        assert gold_reward([pair["prompt"]], [pair["rejected"]], answer=[answers[pair["prompt"]]]) == [0.0]
    assert len({tuple(p.values()) for p in pairs}) == len(pairs)  # no duplicate pairs


def test_reward_model_tokenizer_ends_every_text_with_eos(tmp_path):
    from transformers import AutoTokenizer

    from tether.rm.model import TextFormat

    build_tokenizer(save_dir=tmp_path, eos_after_text=True)
    rm_tok = AutoTokenizer.from_pretrained(tmp_path)  # reloaded: the post-processor is saved with it
    plain = build_tokenizer()
    digits = plain("123+045=1168", add_special_tokens=False)["input_ids"]
    assert rm_tok("123+045=1168", add_special_tokens=False)["input_ids"] == digits  # generation/SFT: nothing added
    # the reward model's plain format adds special tokens: the score is read at [EOS] for 3- and 4-digit replies
    for reply in ("168", "1168"):
        ids = TextFormat(max_length=32).encode(rm_tok, "123+045=", reply).ids
        assert ids[-1] == rm_tok.eos_token_id and ids[:-1] == plain("123+045=" + reply, add_special_tokens=False)["input_ids"]
