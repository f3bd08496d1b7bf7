"""Hugging Face Hub models and datasets by id, fetched and cached the way ``huggingface_hub`` and ``datasets`` do.

A model argument that is neither a local directory nor a preset may name a Hub model: ``gpt2``, ``org/name`` or
``org/name@revision`` (a branch, tag or commit). :func:`model_snapshot` turns it into the local snapshot folder of
the user's Hub cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``) with ``huggingface_hub.snapshot_download``:
downloaded when online (a token from ``HF_TOKEN`` or ``hf auth login``), taken from the cache when
``HF_HUB_OFFLINE`` is set or the Hub cannot be reached. Every stage then loads that folder like any local
directory, so ``trust_remote_code`` stays off unless the run asks for it. Only what a PyTorch load reads is
fetched: TensorFlow, Flax, ONNX, Core ML, GGUF and Meta's ``original/`` copies are skipped, and ``*.bin`` /
``*.pth`` weights too when the repository has safetensors (gpt2's repository holds 6 copies of its weights).

A data argument ``hf:org/name[:config][:split]`` is read with ``datasets.load_dataset`` (:func:`dataset_records`),
under the same offline rules (offline, ``datasets`` reads the copy it cached when it last loaded the dataset).

Every failure is one line naming the argument, what is wrong and how to get the model or data
(``hf download org/name --local-dir DIR``). Shared layer: imports only the standard library and tether.errors;
``huggingface_hub`` and ``datasets`` load when an id is used.
"""

from __future__ import annotations

from pathlib import Path

from tether.errors import DataError, TetherError

DATASET_PREFIX = "hf:"

# Weights and exports a PyTorch load never reads (huggingface_hub glob patterns).
OTHER_FORMATS = ["*.h5", "*.msgpack", "*.ot", "*.tflite", "*.onnx", "*.onnx_data", "onnx/*", "*.mlmodel",
                 "*.mlpackage/*", "coreml/*", "openvino/*", "*.gguf", "*.ggml", "original/*"]
PICKLED = ["*.bin", "*.pth", "*.pt", "*.ckpt"]  # skipped when safetensors are there: same weights, unsafe format
_SNAPSHOTS: dict[tuple, Path] = {}  # (repo, revision, cache, offline) -> snapshot folder, once per process


def parse_model_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of a Hub model id (``name``, ``org/name``, either with ``@revision``); None for what
    is plainly a path (``./x``, ``~/x``, ``/x``, ``a/b/c``) or not a valid repository name."""
    repo, _, revision = spec.partition("@")
    if not repo or (not revision and "@" in spec) or spec.startswith((".", "~", "/")) or repo.count("/") > 1:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def hub_cache() -> str:
    """Where ``huggingface_hub`` keeps models (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def download_hint(repo: str, revision: str | None, repo_type: str = "model") -> str:
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo}{kind}{rev} --local-dir DIR"


def skipped_files(files: list[str]) -> list[str]:
    """The ``ignore_patterns`` for a repository holding ``files``: other frameworks' weights always, pickled
    PyTorch weights when safetensors hold the same model."""
    return OTHER_FORMATS + (PICKLED if any(f.endswith(".safetensors") for f in files) else [])


def model_snapshot(spec: str, repo: str, revision: str | None, *, refused: str) -> Path:
    """The local snapshot folder of Hub model ``repo`` at ``revision`` (None: the default branch).

    Online, the repository's file list picks what to fetch and ``snapshot_download`` fetches what the cache lacks;
    offline (``HF_HUB_OFFLINE``) or when the Hub cannot be reached, the cached snapshot of that revision is used
    (``local_files_only``). ``refused`` opens the error (``"gpt2: policy is neither a directory nor ..."``)."""
    from huggingface_hub import constants

    key = (repo, revision, constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)
    if key not in _SNAPSHOTS:
        _SNAPSHOTS[key] = _fetch(spec, repo, revision, refused)
    return _SNAPSHOTS[key]


def _fetch(spec: str, repo: str, revision: str | None, refused: str) -> Path:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError, RevisionNotFoundError

    files, online_error = None, None
    if not constants.HF_HUB_OFFLINE:
        try:
            files = [s.rfilename for s in HfApi().model_info(repo, revision=revision).siblings or []]
        except RevisionNotFoundError:
            raise TetherError(f"{spec}: the Hub has no revision {revision!r} of {repo}") from None
        except Exception as e:  # noqa: BLE001 - unreachable, gated, not found: the cache may still hold it
            online_error = e
    if files is None:
        files = _cached_files(repo, revision)
    try:
        return Path(snapshot_download(repo, revision=revision, ignore_patterns=skipped_files(files),
                                      local_files_only=online_error is not None or constants.HF_HUB_OFFLINE))
    except IncompleteSnapshotError as e:
        raise TetherError(f"{spec}: the cached copy of {repo} in {hub_cache()} is incomplete "
                          f"({_first_line(e)[:160]}); get it online, or with: {download_hint(repo, revision)}") \
            from None
    except LocalEntryNotFoundError:
        raise TetherError(refused + _why_not_cached(repo, revision, online_error)) from None


def model_config(spec: str, repo: str, revision: str | None, *, refused: str) -> Path:
    """The cache folder holding Hub model ``repo``'s config.json, fetching that one file (``hf_hub_download``) when
    online; the cached copy offline."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision)).parent
    except RevisionNotFoundError:
        raise TetherError(f"{spec}: the Hub has no revision {revision!r} of {repo}") from None
    except LocalEntryNotFoundError as e:  # offline, or the Hub unreachable (the cause), and not cached
        raise TetherError(refused + _why_not_cached(repo, revision, e.__cause__)) from None
    except RepositoryNotFoundError as e:  # or gated
        raise TetherError(refused + _why_not_cached(repo, revision, e)) from None
    except EntryNotFoundError:
        raise TetherError(f"{spec}: {repo} on the Hugging Face Hub has no config.json (not a transformers model)") \
            from None


def _cached_files(repo: str, revision: str | None) -> list[str]:
    """The file list the cache recorded for ``repo`` (``trees/<commit>.json``), or [] when it has none."""
    from huggingface_hub import get_cached_repo_tree

    try:
        return [f.path for f in get_cached_repo_tree(repo, revision=revision)]
    except Exception:  # noqa: BLE001 - no tree listing cached (an older huggingface_hub, or a partial copy)
        return []


def _why_not_cached(repo: str, revision: str | None, online_error: Exception | None) -> str:
    """The end of the one-line error for a model the cache lacks, by why the Hub did not give it."""
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(online_error, OfflineModeIsEnabled):
        online_error = None  # HF_HUB_OFFLINE: said as such below
    at = f"{repo}@{revision}" if revision else repo
    hint = download_hint(repo, revision)
    if isinstance(online_error, GatedRepoError):
        return (f"; {repo} is a gated model on the Hugging Face Hub: accept its terms at https://huggingface.co/{repo} "
                f"and set HF_TOKEN (or run hf auth login)")
    if isinstance(online_error, RepositoryNotFoundError):
        return (f" nor a model on the Hugging Face Hub ({repo} not found; a private model needs HF_TOKEN or "
                f"hf auth login)")
    if online_error is not None:
        return (f", and the Hugging Face Hub cannot be reached ({type(online_error).__name__}) while the cache "
                f"({hub_cache()}) has no copy of {at}; get it where the Hub is reachable with: {hint}, and pass DIR")
    return (f", and HF_HUB_OFFLINE is set while the Hugging Face cache ({hub_cache()}) has no copy of {at}; "
            f"get it with: {hint}, and pass DIR (or unset HF_HUB_OFFLINE)")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# --------------------------------------------------------------------------------------------- datasets
def is_hub_dataset(spec) -> bool:
    """Whether a data argument names a Hub dataset (``hf:org/name...``) rather than a file (a file of that
    name wins, as a local directory wins over a model id)."""
    return isinstance(spec, (str, Path)) and str(spec).startswith(DATASET_PREFIX) and not Path(spec).exists()


def parse_dataset_spec(spec: str) -> tuple[str, str | None, list[str]]:
    """``(repo, revision, [config and/or split])`` of ``hf:org/name[@revision][:config][:split]``."""
    body = str(spec)[len(DATASET_PREFIX):]
    name, *rest = body.split(":")
    parsed = parse_model_id(name)
    if parsed is None or len(rest) > 2:
        raise DataError(f"{spec}: not a Hub dataset; expected hf:org/name[:config][:split], e.g. "
                        f"hf:openai/gsm8k:main:train")
    return parsed[0], parsed[1], rest


def dataset_records(spec: str) -> list[tuple[int, dict]]:
    """The rows of Hub dataset ``spec``, numbered from 1, through ``datasets.load_dataset`` (default config unless
    named; the ``train`` split, or the only one, unless named). ``hf:org/name:X`` reads X as a split when the
    default config has it, else as a config."""
    repo, revision, rest = parse_dataset_spec(spec)
    if len(rest) == 2:
        data = _load(spec, repo, revision, rest[0] or None, rest[1] or None)
    elif len(rest) == 1 and rest[0]:
        try:
            data = _load(spec, repo, revision, None, rest[0])
        except DataError:  # not a split of the default config: a config then
            data = _load(spec, repo, revision, rest[0], None)
    else:
        data = _load(spec, repo, revision, None, None)
    if hasattr(data, "keys"):  # a DatasetDict: no split was named
        names = list(data.keys())
        if "train" not in names and len(names) != 1:
            raise DataError(f"{spec}: holds the splits {', '.join(names)}; name one, e.g. {spec}:{names[0]}")
        data = data["train" if "train" in names else names[0]]
    return list(enumerate(data.to_list(), start=1))


def _load(spec: str, repo: str, revision: str | None, config: str | None, split: str | None):
    import datasets
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    ds_logging.set_verbosity_error()  # "Using the latest cached version ...": offline is the user's own setting
    try:
        return datasets.load_dataset(repo, config, split=split, revision=revision)
    except ConnectionError as e:
        raise DataError(_dataset_not_cached(spec, repo, revision, e)) from None
    except (ValueError, KeyError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        if isinstance(e, FileNotFoundError) and "not cached" in str(e):
            raise DataError(_dataset_not_cached(spec, repo, revision, e)) from None
        raise DataError(f"{spec}: {_first_line(e)[:240]}") from None
    finally:
        ds_logging.set_verbosity(level)


def _dataset_not_cached(spec: str, repo: str, revision: str | None, error: Exception) -> str:
    import datasets

    hint = download_hint(repo, revision, "dataset")
    if datasets.config.HF_HUB_OFFLINE:
        return (f"{spec}: HF_HUB_OFFLINE is set and the datasets cache ({datasets.config.HF_DATASETS_CACHE}) has no "
                f"copy of {repo}; load it once online, or get its files with: {hint}, and pass a data file of DIR")
    return (f"{spec}: cannot reach the Hugging Face Hub ({_first_line(error)[:120]}) and the datasets cache has no "
            f"copy of {repo}; get its files with: {hint}, and pass a data file of DIR")
