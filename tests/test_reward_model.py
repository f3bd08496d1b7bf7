"""tether.rm.model and tether.rm.backbone: pooling under every padding (and PAD = EOS), truncation that keeps the reply,
chat formatting, the score scale (A5) and its shift invariance, save/load, ensembles, LoRA.

Tiny random models built from configs: GPT-2 (2 layers, 32 wide) and a BERT encoder, with a character
tokenizer built with ``tokenizers``. The builders are imported by test_reward_training.py too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tether.core.losses import bradley_terry_loss
from tether.errors import TetherError

CHARS = "0123456789+-=?!.,:;' abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"


# ------------------------------------------------------------------------------------------------ builders
def char_tokenizer(pad_is_eos: bool = False, encoder: bool = False, pad: bool = True):
    """One token per character; specials [PAD]=0 [EOS]=1 [UNK]=2 [CLS]=3 [SEP]=4. ``encoder``: wrap every
    text as ``[CLS] … [SEP]`` like BERT."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[EOS]", "[UNK]", "[CLS]", "[SEP]", *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    kwargs = {"eos_token": "[EOS]", "unk_token": "[UNK]"}
    if pad:
        kwargs["pad_token"] = "[EOS]" if pad_is_eos else "[PAD]"
    if encoder:
        core.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
        kwargs.update(cls_token="[CLS]", sep_token="[SEP]")
    return PreTrainedTokenizerFast(tokenizer_object=core, **kwargs)


def save_tiny_gpt2(path: Path, tokenizer=None, seed: int = 0, width: int = 32) -> Path:
    """A random 2-layer GPT-2 *causal LM* (no score head: train-rm adds one), ``width`` wide with 16-wide
    heads, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tokenizer or char_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=width, n_layer=2, n_head=width // 16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def save_tiny_bert(path: Path, seed: int = 0) -> Path:
    """A random 2-layer, 32-wide BERT sequence classifier with one output (its classifier has a bias)."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = char_tokenizer(encoder=True)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def rm_tokenizer(path: Path):
    """A reward model's tokenizer, loaded as train-rm and RewardModel.from_pretrained load it."""
    from tether.hf import load_tokenizer

    return load_tokenizer(path, need_pad=False, need_fast=True)


def load_rm(path: Path, max_length: int = 64):
    """An untrained RewardModel (raw = standardised) on a saved backbone."""
    from tether.hf import ensure_pad_token
    from tether.rm.backbone import load_sequence_classifier
    from tether.rm.model import RewardModel, choose_format

    tokenizer = rm_tokenizer(path)
    model, _ = load_sequence_classifier(path, new_head=True)
    ensure_pad_token(tokenizer, model)
    return RewardModel(model.eval(), tokenizer, choose_format(tokenizer, max_length=max_length))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("bert"))


PROMPTS = ["1+2=", "10+22=", "what is 7 times 6? ", "hi"]
REPLIES = ["3", "32 it is", "42", "hello there friend"]


# ------------------------------------------------------------------------------------------------ pooling
def test_scores_are_the_same_under_left_right_and_no_padding(gpt2_dir):
    from tether.rm.backbone import pad_batch, pooled_scores

    rm = load_rm(gpt2_dir)
    seqs = [e.ids for e in rm.encode(PROMPTS, REPLIES)]
    assert len({len(s) for s in seqs}) == len(seqs)  # every row is padded in a batch
    with torch.no_grad():
        # independent reference: HF's own pooling is right for an unpadded row holding no pad token
        reference = torch.cat([rm.model(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
        for side in ("left", "right"):
            ids, mask = pad_batch(seqs, rm.tokenizer.pad_token_id, side)
            torch.testing.assert_close(pooled_scores(rm.model, ids, mask, "last_token"), reference,
                                       atol=1e-5, rtol=1e-5)
        single = torch.cat([pooled_scores(rm.model, *pad_batch([s], 0), "last_token") for s in seqs])
    torch.testing.assert_close(single, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rm.score(PROMPTS, REPLIES, raw=True, batch_size=3), reference, atol=1e-5, rtol=1e-5)


def test_pad_equal_to_eos_scores_the_final_eos(tmp_path):
    from tether.rm.backbone import pad_batch, pooled_scores

    rm = load_rm(save_tiny_gpt2(tmp_path / "m", char_tokenizer(pad_is_eos=True)))
    assert rm.tokenizer.pad_token_id == rm.tokenizer.eos_token_id == 1
    seqs = [e.ids for e in rm.encode(PROMPTS, [r + "[EOS]" for r in REPLIES])]
    assert all(s[-1] == 1 for s in seqs)
    with torch.no_grad():
        # by hand: the head on the last hidden state of each unpadded row (its final token is EOS)
        last_hidden = [rm.model.transformer(torch.tensor([s])).last_hidden_state[0, -1] for s in seqs]
        by_hand = torch.stack([h @ rm.model.score.weight[0] for h in last_hidden])
        ids, mask = pad_batch(seqs, 1, "right")
        torch.testing.assert_close(pooled_scores(rm.model, ids, mask, "last_token"), by_hand, atol=1e-5, rtol=1e-5)
        # HF's pooling searches for the pad id and so scores the token before the EOS: the pitfall we avoid
        assert not torch.allclose(rm.model(input_ids=ids, attention_mask=mask).logits[:, 0], by_hand, atol=1e-4)


def test_encoder_uses_its_own_pooling_under_padding(bert_dir):
    rm = load_rm(bert_dir)
    assert rm.pooling == "model"
    with torch.no_grad():
        single = torch.cat([rm.model(input_ids=torch.tensor([e.ids])).logits[:, 0]
                            for e in rm.encode(PROMPTS, REPLIES)])
    torch.testing.assert_close(rm.score(PROMPTS, REPLIES, raw=True), single, atol=1e-5, rtol=1e-5)


def test_missing_pad_token_becomes_eos(tmp_path):
    from tether.hf import ensure_pad_token
    from tether.rm.backbone import load_sequence_classifier

    path = save_tiny_gpt2(tmp_path / "m", char_tokenizer(pad=False))
    tokenizer = rm_tokenizer(path)
    assert tokenizer.pad_token is None
    model, head_is_new = load_sequence_classifier(path, new_head=True)
    ensure_pad_token(tokenizer, model)
    assert head_is_new and tokenizer.pad_token == "[EOS]" and model.config.pad_token_id == 1


# ---------------------------------------------------------------------------------------------- formatting
def test_truncation_cuts_the_prompt_from_the_left_and_keeps_the_reply(bert_dir):
    from tether.rm.model import TextFormat

    tokenizer = rm_tokenizer(bert_dir)
    fmt = TextFormat(kind="plain", max_length=12)
    enc = fmt.encode(tokenizer, "the long prompt: ", "reply")
    assert tokenizer.convert_ids_to_tokens(enc.ids) == ["[CLS]", *"mpt: ", *"reply", "[SEP]"]
    assert (enc.n_reply_tokens, enc.prompt_truncated, enc.reply_truncated) == (5, True, False)
    enc = fmt.encode(tokenizer, "p", "a reply that is far too long")
    assert tokenizer.convert_ids_to_tokens(enc.ids) == ["[CLS]", *"a reply th", "[SEP]"]
    assert (enc.n_reply_tokens, enc.prompt_truncated, enc.reply_truncated) == (10, True, True)
    enc = fmt.encode(tokenizer, "p", "fits")
    assert len(enc.ids) == 7 and not enc.prompt_truncated and not enc.reply_truncated


def test_chat_template_formats_prompts_and_hh_transcripts(gpt2_dir):
    from tether.rm.model import choose_format

    tokenizer = rm_tokenizer(gpt2_dir)
    with pytest.raises(TetherError, match="no chat template"):
        choose_format(tokenizer, "chat")
    assert choose_format(tokenizer).kind == "plain"
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    fmt = choose_format(tokenizer)
    assert fmt.kind == "chat"
    assert fmt.render(tokenizer, "2+2?", " 4")[0] == "user: 2+2?\nassistant: 4\n"
    text, start, end = fmt.render(tokenizer, "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant:", " 4")
    assert text == "user: hi\nassistant: hello\nuser: 2+2?\nassistant: 4\n" and text[start:end] == "4"
    enc = fmt.encode(tokenizer, "2+2?", " 4")
    assert tokenizer.decode(enc.ids) == "user: 2+2?\nassistant: 4\n" and enc.n_reply_tokens == 1


# --------------------------------------------------------------------------------------------------- scale
def test_standardised_scores_have_mean_0_and_std_1_on_the_reference_sample(gpt2_dir):
    rm = load_rm(gpt2_dir)
    prompts, replies = PROMPTS * 3, [r + s for s in ("", "!", " ok") for r in REPLIES]
    raw = rm.score(prompts, replies, raw=True)
    rm.set_normalization(raw, "test sample")
    z = rm.score(prompts, replies)
    assert abs(z.mean().item()) < 1e-5 and abs(z.std(unbiased=False).item() - 1) < 1e-5
    torch.testing.assert_close(z, (raw - raw.mean()) / raw.std(unbiased=False), atol=1e-5, rtol=1e-5)


def test_a_constant_shift_changes_raw_scores_but_not_standardised_ones_nor_the_bt_loss(bert_dir):
    rm = load_rm(bert_dir)
    with torch.no_grad():
        rm.model.classifier.weight *= 1000.0  # scores that differ like a trained model's, not by ~1e-5
    raw = rm.score(PROMPTS, REPLIES, raw=True)
    assert raw.std() > 0.05
    rm.set_normalization(raw)
    z = rm.score(PROMPTS, REPLIES)
    with torch.no_grad():
        rm.model.classifier.bias += 3.0
    shifted = rm.score(PROMPTS, REPLIES, raw=True)
    torch.testing.assert_close(shifted, raw + 3.0, atol=1e-5, rtol=1e-5)
    rm.set_normalization(shifted)  # re-measured after training, as train-rm does
    torch.testing.assert_close(rm.score(PROMPTS, REPLIES), z, atol=1e-4, rtol=1e-4)  # float32 of r + 3
    torch.testing.assert_close(bradley_terry_loss(shifted[:2], shifted[2:]), bradley_terry_loss(raw[:2], raw[2:]))


# ----------------------------------------------------------------------------------------- save, load, API
def test_save_load_round_trip_and_plain_transformers_load(gpt2_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tether import RewardModel

    rm = load_rm(gpt2_dir)
    rm.set_normalization(rm.score(PROMPTS, REPLIES, raw=True), "test")
    rm.save_pretrained(tmp_path / "rm", extra={"evaluation": {"accuracy": 1.0}})
    assert (tmp_path / "rm" / "model.safetensors").is_file()
    meta = json.loads((tmp_path / "rm" / "tether_reward.json").read_text())
    assert meta["text_format"]["kind"] == "plain" and meta["pooling"] == "last_token"
    assert meta["normalization"]["mean"] == pytest.approx(rm.mean) and meta["evaluation"] == {"accuracy": 1.0}
    loaded = RewardModel.from_pretrained(tmp_path / "rm", device="cpu")
    torch.testing.assert_close(loaded.score(PROMPTS, REPLIES), rm.score(PROMPTS, REPLIES))
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    ids = loaded.encode(PROMPTS[:1], REPLIES[:1])[0].ids
    with torch.no_grad():
        assert plain(input_ids=torch.tensor([ids])).logits[0, 0].item() == pytest.approx(
            loaded.score(PROMPTS[:1], REPLIES[:1], raw=True).item(), abs=1e-5)


def test_from_pretrained_rejects_what_is_not_a_tether_reward_model(gpt2_dir, tmp_path):
    from tether import RewardModel

    with pytest.raises(TetherError, match="directory not found"):
        RewardModel.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TetherError, match=r"empty: not a Hugging Face model directory \(no config.json\)"):
        RewardModel.from_pretrained(tmp_path / "empty")
    with pytest.raises(TetherError, match=r"not a reward model \(no tether_reward.json, and a \w+, not a one-output "
                                          r"AutoModelForSequenceClassification\)"):
        RewardModel.from_pretrained(gpt2_dir)


def test_score_checks_its_arguments(gpt2_dir):
    rm = load_rm(gpt2_dir)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        rm.score(["a", "b"], ["c"])
    with pytest.raises(TypeError):
        rm.score("a", "b")
    out = rm.score(PROMPTS, REPLIES)
    assert out.shape == (4,) and out.dtype == torch.float32 and not out.requires_grad


def test_ensemble_reduces_standardised_scores_by_mean_or_min(tmp_path):
    from tether import RewardEnsemble

    members = [load_rm(save_tiny_gpt2(tmp_path / f"m{i}", seed=i)) for i in range(3)]
    for i, m in enumerate(members):
        m.mean, m.std = 0.1 * i, 1.0 + i
    z = torch.stack([m.score(PROMPTS, REPLIES) for m in members])  # (K, B)
    torch.testing.assert_close(RewardEnsemble(members, "mean").score(PROMPTS, REPLIES), z.mean(0))
    torch.testing.assert_close(RewardEnsemble(members, "min").score(PROMPTS, REPLIES), z.min(0).values)
    with pytest.raises(ValueError, match="reduce"):
        RewardEnsemble(members, "max")


# ------------------------------------------------------------------------------------------------------ LoRA
def test_lora_trains_only_the_adapter_and_the_head(gpt2_dir):
    from tether.hf import apply_lora
    from tether.rm.backbone import head_modules, load_sequence_classifier
    from tether.rm.train import RewardTrainingConfig, train_loop

    def add_lora(model):  # what train-rm does (tether.rm.train.load_model)
        return apply_lora(model, r=4, alpha=8, dropout=0.0, task_type="SEQ_CLS", modules_to_save=head_modules(model))

    rm = load_rm(gpt2_dir)
    model = add_lora(rm.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("modules_to_save" in n and "score" in n for n in trainable)
    pairs = [(rm.text_format.encode(rm.tokenizer, p, r), rm.text_format.encode(rm.tokenizer, p, r[::-1] + "x"))
             for p, r in zip(PROMPTS, REPLIES)]
    cfg = RewardTrainingConfig(seed=0)
    cfg.optim.lr, cfg.optim.epochs, cfg.optim.batch_size, cfg.optim.warmup_ratio = 1e-2, 4, 2, 0.0
    train_loop(model, pairs, cfg, torch.device("cpu"), rm.tokenizer.pad_token_id)  # 8 steps: LoRA A moves after B
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (name in trainable), name
    bf16, _ = load_sequence_classifier(gpt2_dir, dtype=torch.bfloat16, new_head=True)
    bf16 = add_lora(bf16)
    dtypes = {p.requires_grad: p.dtype for p in bf16.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}  # A6: trainable weights in fp32
