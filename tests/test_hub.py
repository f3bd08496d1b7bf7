"""Hugging Face Hub ids for models and ``hf:`` datasets, fully offline.

A Hub cache is built as ``huggingface_hub`` lays it out (``models--org--name/{blobs,refs/main,snapshots/<commit>}``,
checked with its own ``scan_cache_dir``) and a datasets cache as ``datasets`` writes it when it loads ``org/name``
from the Hub (``org___name/default/0.0.0/<commit>``, written by datasets' own builder). With ``HF_HUB_OFFLINE=1`` every
stage loads both by id: sft, train-rm, ppo (policy, reward model, separate critic, prompts and held-out prompts),
sample and plan; an id that is not cached is one line and exit 2."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from test_sft import rows_file
from tiny import make_policy_dir, make_prompts_file

from tether.cli import main
from tether.errors import DataError, TetherError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DATA_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
LFS_SUFFIXES = (".safetensors", ".bin")  # stored with Git LFS on the Hub: the blob is named by its sha256


def add_model_to_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """``source``'s files as the Hub cache holds a downloaded model: each file's bytes once under ``blobs/`` (named by
    its git blob sha1, or sha256 for an LFS file), ``snapshots/<commit>/<file>`` a relative symlink to its blob, and
    ``refs/main`` holding the commit."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = (hashlib.sha256(data).hexdigest() if file.suffix in LFS_SUFFIXES
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (storage / "blobs" / blob).write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(storage / "blobs" / blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def add_dataset_to_cache(cache: Path, repo_id: str, splits: dict[str, list[dict]], work: Path) -> None:
    """The rows as ``datasets`` caches a Hub dataset of JSON files that it loaded online: the JSON builder with the
    arguments its Hub module gives it (repo id, snake-cased name, the commit as hash), prepared by datasets itself."""
    from datasets.data_files import DataFilesDict
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = [str(work / f"{split}.jsonl")]
        Path(files[split][0]).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    builder = Json(cache_dir=str(cache), dataset_name=camelcase_to_snakecase(repo_id.split("/")[-1]), repo_id=repo_id,
                   hash=DATA_COMMIT, base_path=f"hf://datasets/{repo_id}@{DATA_COMMIT}", config_name="default")
    builder.config.data_files = DataFilesDict.from_patterns(files, base_path=str(work))
    builder.download_and_prepare()


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    home = root / "hf_home"
    policy = make_policy_dir(root / "src")
    sft_rows, prompts = rows_file(root, n=24), make_prompts_file(root, n=24)
    eval_prompts = make_prompts_file(root, n=6, seed=7, name="eval.jsonl")
    pairs = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(10, 26)]
    add_model_to_hub_cache(home / "hub", "tiny-org/tiny-gpt2", policy)
    add_model_to_hub_cache(home / "hub", "tinychar", policy)
    for repo, splits in {"tiny-org/sft-rows": {"train": jsonl_rows(sft_rows)},
                         "tiny-org/prompts": {"train": jsonl_rows(prompts), "test": jsonl_rows(eval_prompts)},
                         "tiny-org/pairs": {"train": pairs},
                         "tiny-org/bad-pairs": {"train": [pairs[0], {"prompt": "1+1=", "chosen": "2", "rejected": " "}]}
                         }.items():
        add_dataset_to_cache(home / "datasets", repo, splits, root / "data" / repo)
    return SimpleNamespace(root=root, home=home, policy=policy, sft_rows=sft_rows, prompts=prompts,
                           eval_prompts=eval_prompts, pairs=pairs)


@pytest.fixture
def offline(hub, monkeypatch):
    """HF_HOME and HF_HUB_OFFLINE=1 for this test. huggingface_hub and datasets read them into module constants
    when first imported, so the constants they consult at call time are set too (a fresh process needs only the
    environment: :func:`test_environment_alone_is_honoured_in_a_fresh_process`)."""
    import datasets.config
    import huggingface_hub.constants

    from tether import hub as tether_hub

    for key, value in {"HF_HOME": hub.home, "HF_HUB_CACHE": hub.home / "hub", "HF_DATASETS_CACHE": hub.home / "datasets",
                       "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub.home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hub.home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(tether_hub, "_SNAPSHOTS", {})
    return hub


# ------------------------------------------------------------------------------------------------ models
def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(offline):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(offline.home / "hub")
    assert not info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {"tiny-org/tiny-gpt2", "tinychar"}
    (revision,) = repos["tiny-org/tiny-gpt2"].revisions
    assert revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert {f.file_name for f in revision.files} == {p.name for p in offline.policy.iterdir()}


def test_a_hub_id_resolves_to_its_cached_snapshot(offline):
    from tether.presets import resolve_model_path

    snapshot = offline.home / "hub" / "models--tiny-org--tiny-gpt2" / "snapshots" / COMMIT
    assert resolve_model_path("tiny-org/tiny-gpt2", what="policy") == snapshot
    assert resolve_model_path(f"tiny-org/tiny-gpt2@{COMMIT}") == snapshot  # a pinned revision
    assert resolve_model_path("tinychar") == offline.home / "hub" / "models--tinychar" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == (offline.policy / "model.safetensors").read_bytes()


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(offline, tmp_path, monkeypatch):
    from tether.presets import resolve_model_path

    monkeypatch.chdir(tmp_path)
    make_policy_dir(tmp_path / "tiny-org" / "x")
    (tmp_path / "tiny-org" / "x" / "policy").rename(tmp_path / "tiny-org" / "tiny-gpt2")
    assert resolve_model_path("tiny-org/tiny-gpt2") == Path("tiny-org/tiny-gpt2")


@pytest.mark.parametrize("spec, what, start", [
    ("tiny-org/missing", "policy", "tiny-org/missing: policy is not a local directory, and HF_HUB_OFFLINE is set"),
    ("gpt2", "model", "gpt2: model is neither a directory nor a known preset (presets: minilm-l6, "),
    ("tiny-org/tiny-gpt2@v2", "policy", "tiny-org/tiny-gpt2@v2: policy is not a local directory, and HF_HUB_OFFLINE"),
])
def test_not_cached_offline_is_one_line_saying_how_to_get_it(offline, spec, what, start):
    from tether.presets import resolve_model_path

    with pytest.raises(TetherError) as err:
        resolve_model_path(spec, what=what)
    message = str(err.value)
    repo, _, revision = spec.partition("@")
    assert message.startswith(start) and "\n" not in message
    assert f"hf download {repo}{f' --revision {revision}' if revision else ''} --local-dir DIR" in message
    assert str(offline.home / "hub") in message


def test_an_unreachable_hub_falls_back_to_the_cache(offline, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) but the Hub refuses connections: the cached snapshot is used, as
    huggingface_hub does; an uncached id says the Hub cannot be reached."""
    import huggingface_hub.constants

    from tether.presets import resolve_model_path

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    snapshot = offline.home / "hub" / "models--tiny-org--tiny-gpt2" / "snapshots" / COMMIT
    assert resolve_model_path("tiny-org/tiny-gpt2") == snapshot
    with pytest.raises(TetherError, match=r"^tiny-org/missing: model is not a local directory, and the Hugging Face "
                                          r"Hub cannot be reached \(ConnectError\) while the cache"):
        resolve_model_path("tiny-org/missing")


@pytest.mark.parametrize("command", [
    ["ppo", "--policy", "tiny-org/missing", "--prompts", "{prompts}", "--reward", "tether.rules:char_share:char=7"],
    ["sft", "--model", "tiny-org/missing", "--data", "{sft_rows}"],
    ["train-rm", "--model", "tiny-org/missing", "--data", "hf:tiny-org/pairs"],
    ["sample", "--policy", "tiny-org/missing", "--prompts", "{prompts}", "--reward", "tether.rules:char_share:char=7",
     "--output", "{root}/out.jsonl"],
])
def test_every_stage_refuses_an_uncached_id_in_one_line_with_exit_2(offline, tmp_path, capsys, command):
    args = [a.format(prompts=offline.prompts, sft_rows=offline.sft_rows, root=tmp_path) for a in command]
    if command[0] != "sample":
        args += ["--output-dir", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"tether {command[0]}: error: tiny-org/missing: ")
    assert "hf download tiny-org/missing --local-dir DIR" in err[-1]


def test_paths_are_never_taken_for_hub_ids(offline, tmp_path):
    from tether.hub import parse_model_id
    from tether.presets import is_model_spec, resolve_model_path

    assert parse_model_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for path in ("./org/name", "/abs/name", "~/name", "a/b/c", "org/na--me", "org/name@", "tether.rules:char_share"):
        assert parse_model_id(path) is None or ":" in path
    assert not is_model_spec("tether.rules:char_share:char=7") and is_model_spec("tiny-org/tiny-gpt2")
    with pytest.raises(TetherError, match=r"nope: policy directory not found$"):
        resolve_model_path(str(tmp_path / "nope"), what="policy")


def test_only_what_a_pytorch_load_reads_is_fetched():
    """gpt2's repository (its real file list): one copy of the weights, not six."""
    from huggingface_hub.utils import filter_repo_objects

    from tether.hub import skipped_files

    gpt2 = ["64-8bits.tflite", "64-fp16.tflite", "64.tflite", "config.json", "flax_model.msgpack",
            "generation_config.json", "merges.txt", "model.safetensors", "onnx/config.json", "onnx/decoder_model.onnx",
            "pytorch_model.bin", "rust_model.ot", "tf_model.h5", "tokenizer.json", "tokenizer_config.json",
            "vocab.json", "README.md", ".gitattributes"]
    kept = set(filter_repo_objects(gpt2, ignore_patterns=skipped_files(gpt2)))
    assert kept == {"config.json", "generation_config.json", "merges.txt", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "vocab.json", "README.md", ".gitattributes"}
    older = ["config.json", "pytorch_model.bin", "tokenizer.json"]  # no safetensors: the .bin is the model
    assert set(filter_repo_objects(older, ignore_patterns=skipped_files(older))) == set(older)


def test_plan_reads_a_hub_models_config(offline, capsys):
    assert main(["plan", "--model", "tiny-org/tiny-gpt2"]) == 0
    assert main(["plan", "--model", "tiny-org/missing"]) == 2
    assert "hf download tiny-org/missing --local-dir DIR" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- datasets
def test_hub_dataset_rows_are_the_files_rows(offline):
    from tether.inputs.records import read_records

    assert [r for _, r in read_records("hf:tiny-org/prompts")] == jsonl_rows(offline.prompts)  # train by default
    test_rows = jsonl_rows(offline.eval_prompts)
    assert [r for _, r in read_records("hf:tiny-org/prompts:test")] == test_rows  # a split
    assert [r for _, r in read_records("hf:tiny-org/prompts:default:test")] == test_rows  # config and split
    assert [n for n, _ in read_records("hf:tiny-org/prompts:test")] == list(range(1, len(test_rows) + 1))


@pytest.mark.parametrize("spec, message", [
    ("hf:tiny-org/prompts:nope", "hf:tiny-org/prompts:nope: Couldn't find cache for tiny-org/prompts for config 'nope'"),
    ("hf:tiny-org/prompts:default:nope", "hf:tiny-org/prompts:default:nope: Unknown split \"nope\""),
    ("hf:tiny-org/absent", "hf:tiny-org/absent: HF_HUB_OFFLINE is set and the datasets cache ("),
    ("hf:a/b/c", "hf:a/b/c: not a Hub dataset; expected hf:org/name[:config][:split]"),
])
def test_bad_hub_dataset_is_one_line(offline, spec, message):
    from tether.inputs.records import read_records

    with pytest.raises(DataError) as err:
        read_records(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    if "absent" in spec:
        assert "hf download tiny-org/absent --repo-type dataset --local-dir DIR" in str(err.value)


def test_hub_rows_are_validated_as_file_rows_are(offline):
    from tether.inputs.pairs import load_preference_pairs

    with pytest.raises(DataError, match=r"^hf:tiny-org/bad-pairs: row 2: field 'rejected' is empty$"):
        load_preference_pairs(["hf:tiny-org/bad-pairs"])
    pairs, stats = load_preference_pairs(["hf:tiny-org/pairs"])
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(r["prompt"], r["chosen"], r["rejected"])
                                                                   for r in offline.pairs]
    assert pairs[1].source == "hf:tiny-org/pairs: row 2"


# ------------------------------------------------------------------------------------------ every stage
@pytest.mark.slow
def test_every_stage_loads_models_and_data_by_id(offline, tmp_path):
    """sft -> train-rm -> ppo -> sample, every model and data argument a Hub id; the SFT run by id is the SFT run of
    the same model and rows from local files, step for step."""

    common = ["--steps", "2", "--batch-size", "4", "--progress", "false", "--eval-fraction", "0"]
    assert main(["sft", "--model", "tiny-org/tiny-gpt2", "--data", "hf:tiny-org/sft-rows", "--output-dir",
                 str(tmp_path / "sft_hub"), *common]) == 0
    assert main(["sft", "--model", str(offline.policy), "--data", str(offline.sft_rows), "--output-dir",
                 str(tmp_path / "sft_local"), *common]) == 0
    losses = [[row["sft/loss"] for row in jsonl_rows(tmp_path / run / "metrics.jsonl")]
              for run in ("sft_hub", "sft_local")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]

    rm = tmp_path / "rm"
    assert main(["train-rm", "--model", "tiny-org/tiny-gpt2", "--data", "hf:tiny-org/pairs", "--output-dir", str(rm),
                 "--epochs", "1", "--batch-size", "8", "--format", "plain"]) == 0
    add_model_to_hub_cache(offline.home / "hub", "tiny-org/tiny-rm", rm)

    ppo = tmp_path / "ppo"
    assert main(["ppo", "--policy", "tiny-org/tiny-gpt2", "--prompts", "hf:tiny-org/prompts", "--eval-prompts",
                 "hf:tiny-org/prompts:test", "--reward", "tiny-org/tiny-rm", "--critic", "separate", "--critic-model",
                 "tinychar", "--output-dir", str(ppo), "--steps", "2", "--batch-size", "4", "--mini-batches", "2",
                 "--max-new-tokens", "4", "--eval-every", "1", "--progress", "false"]) == 0
    rows = jsonl_rows(ppo / "metrics.jsonl")
    trained = [r for r in rows if "objective/scores" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["objective/scores"]) for r in trained)
    assert [r["step"] for r in rows if any(k.startswith("eval/") for k in r)] == [0, 1, 2]  # the hf: test split
    saved = yaml.safe_load((ppo / "config.yaml").read_text())  # the ids as given: a resumed run resolves them again
    assert saved["model"]["policy"] == "tiny-org/tiny-gpt2" and saved["reward"]["sources"] == ["tiny-org/tiny-rm"]

    out = tmp_path / "samples.jsonl"
    assert main(["sample", "--policy", "tiny-org/tiny-gpt2", "--prompts", "hf:tiny-org/prompts:test", "--reward",
                 "tiny-org/tiny-rm", "--output", str(out), "--samples-per-prompt", "2", "--max-new-tokens", "4",
                 "--min-score", "-1000"]) == 0
    kept = jsonl_rows(out)
    assert kept and {r["prompt"] for r in kept} <= {r["prompt"] for r in jsonl_rows(offline.eval_prompts)}


@pytest.mark.slow
def test_the_python_api_takes_ids_too(offline, tmp_path):
    """RewardTrainer on a Hub model and Hub pairs; RewardModel.from_pretrained by id scores as the directory does."""
    import tether

    out = tmp_path / "rm"
    tether.RewardTrainer({"model": "tiny-org/tiny-gpt2", "data": {"files": ["hf:tiny-org/pairs"], "format": "plain"},
                          "output_dir": str(out), "optim": {"epochs": 1, "batch_size": 8}}).train()
    add_model_to_hub_cache(offline.home / "hub", "tiny-org/python-rm", out)
    prompts, replies = ["12+12=", "3+3="], ["24", "7"]
    by_id = tether.RewardModel.from_pretrained("tiny-org/python-rm", device="cpu").score(prompts, replies, raw=True)
    local = tether.RewardModel.from_pretrained(out, device="cpu").score(prompts, replies, raw=True)
    assert by_id.tolist() == local.tolist()


def test_environment_alone_is_honoured_in_a_fresh_process(offline, tmp_path):
    """No patched constants: HF_HOME and HF_HUB_OFFLINE in the environment of a new process, as a user sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(offline.home), HF_HUB_OFFLINE="1")
    script = ("from tether.presets import resolve_model_path; from tether.inputs.records import read_records;"
              "print(resolve_model_path('tiny-org/tiny-gpt2')); print(len(read_records('hf:tiny-org/prompts:test')))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(offline.home / "hub" / "models--tiny-org--tiny-gpt2" / "snapshots" / COMMIT),
                                   str(len(jsonl_rows(offline.eval_prompts)))]
    missing = subprocess.run([sys.executable, "-m", "tether", "plan", "--model", "tiny-org/missing"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "hf download tiny-org/missing --local-dir DIR" in missing.stderr.splitlines()[-1]
