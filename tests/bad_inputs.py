"""The corpus of bad inputs for tests/test_bad_input.py: files built on disk, then one case per row of
:func:`cases` — the argv, and the text the one error line must contain (it names the file, row or flag)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny import make_policy_dir, make_prompts_file


def build(root: Path) -> dict[str, Path]:
    """Every file the cases point at, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    f = {"policy": make_policy_dir(root), "prompts": make_prompts_file(root)}

    def text(name, content):
        path = root / name
        path.write_text(content, encoding="utf-8")
        f[name] = path

    # config files
    text("unknown_top.yaml", "stepz: 3\n")
    text("wrong_type.yaml", "steps: many\n")
    text("section_scalar.yaml", "kl: 0.1\n")
    text("key_wrong_section.yaml", "coef: 0.1\n")
    text("not_mapping.yaml", "- a\n- b\n")
    text("bad_syntax.yaml", "kl: [\n")
    text("list_for_scalar.yaml", "steps: [1, 2]\n")
    text("scalar_for_list.yaml", "reward:\n  sources: 3\n")
    # data files
    text("wrong_columns.jsonl", json.dumps({"text": "hello"}) + "\n")
    (root / "undecodable.jsonl").write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    f["undecodable.jsonl"] = root / "undecodable.jsonl"
    text("empty_prompt.jsonl", json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    text("huge_line.jsonl", json.dumps({"prompt": "1" * 200_000 + "+2="}) + "\n")
    text("not_object.jsonl", "[1, 2]\n")
    text("five_prompts.jsonl", "".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(5)))
    text("one_prompt.jsonl", json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    # model directories
    no_weights = root / "no_weights"
    shutil.copytree(f["policy"], no_weights)
    (no_weights / "model.safetensors").unlink()
    f["no_weights"] = no_weights
    corrupt_rm = root / "corrupt_rm"  # a reward-model directory whose weights are damaged
    _save_tiny_reward_model(corrupt_rm)
    (corrupt_rm / "model.safetensors").write_bytes(b"\x00" * 100)
    f["corrupt_rm"] = corrupt_rm
    no_metadata_rm = root / "no_metadata_rm"  # a scorer without tether's normalisation metadata
    _save_tiny_reward_model(no_metadata_rm)
    (no_metadata_rm / "tether_reward.json").unlink()
    f["no_metadata_rm"] = no_metadata_rm
    _save_tiny_reward_model(root / "tiny_rm")  # a good reward model, where a policy belongs
    f["tiny_rm"] = root / "tiny_rm"
    no_tok = root / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f["policy"] / name, no_tok / name)
    f["no_tokenizer"] = no_tok
    corrupt = root / "corrupt"
    shutil.copytree(f["policy"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    f["corrupt"] = corrupt
    bad_config = root / "bad_config"
    shutil.copytree(f["policy"], bad_config)
    (bad_config / "config.json").write_text("{not json")
    f["bad_config"] = bad_config
    no_pad = root / "no_pad_no_eos"
    shutil.copytree(f["policy"], no_pad)
    tok_cfg = json.loads((no_pad / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token", "bos_token", "unk_token"):
        tok_cfg.pop(key, None)
    (no_pad / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (no_pad / "special_tokens_map.json").unlink(missing_ok=True)
    cfg = json.loads((no_pad / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        cfg.pop(key, None)
    (no_pad / "config.json").write_text(json.dumps(cfg))
    gen = no_pad / "generation_config.json"
    gen.unlink(missing_ok=True)
    f["no_pad_no_eos"] = no_pad
    wrong_arch = root / "wrong_architecture"  # an encoder-decoder: no causal-LM class in transformers
    shutil.copytree(f["policy"], wrong_arch)
    (wrong_arch / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 16, "num_layers": 1,
                                                        "num_heads": 2, "d_kv": 8, "d_ff": 32, "vocab_size": 64}))
    f["wrong_architecture"] = wrong_arch
    # train-rm data
    pair = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    text("one_pair.jsonl", json.dumps(pair) + "\n")
    text("pairs.jsonl", "".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)}) + "\n"
                                for i in range(10)))
    text("empty.jsonl", "")
    # the chosen reply longer in every pair: --balance-length keeps none
    text("chosen_longer.jsonl", "".join(json.dumps({"prompt": f"{i}+1=", "chosen": "1" * (2 + i % 3), "rejected": "1"})
                                        + "\n" for i in range(20)))
    text("pairs_wrong_columns.jsonl", json.dumps({"prompt": "p", "good": "a", "bad": "b"}) + "\n")
    return f


def _save_tiny_reward_model(path: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tether.demo.task import build_tokenizer
    from tether.rm.model import RewardModel, choose_format

    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_layer=1, n_embd=16, n_head=2, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id)
    rm = RewardModel(GPT2ForSequenceClassification(config), tokenizer, choose_format(tokenizer, "plain"))
    rm.set_normalization(torch.tensor([0.5, 1.5]))
    rm.save_pretrained(path)
