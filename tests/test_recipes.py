"""The real-model recipes of ``examples/`` (docs/real-models.md): the example configs, the levers recipe 1
adds to train-rm (mean pooling, dropout off, length-grouped batches, a dev split), and smoke runs.

The config and lever tests use tiny random models and run in seconds. The smoke runs load the example
YAMLs and shrink them (train-rm on a handful of HH-RLHF pairs, max-length 64, one epoch; PPO one step,
batch 2, 8 new tokens) with the real MiniLM and SmolLM2 presets. They are skipped, with the install
command as the reason, when the real-models extra is missing, and when ``../shared/data`` is absent.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch
from test_reward_model import load_rm, save_tiny_bert, save_tiny_gpt2

from tether.config import resolve_config
from tether.inputs.pairs import PreferencePair, split_pairs
from tether.errors import TetherError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
RM_RECIPES = ("recipe1-rm-helpful.yaml", "recipe1-rm-harmless.yaml")
PPO_RECIPES = ("recipe2-ppo-svamp.yaml", "recipe3-ppo-hh-minilm.yaml")


def load_example(name: str):
    from tether.ppo.config import RunConfig
    from tether.rm.config import RewardTrainingConfig

    cls = RewardTrainingConfig if name in RM_RECIPES else RunConfig
    return resolve_config(cls, argparse.Namespace(), str(EXAMPLES / name))


def data_files(cfg) -> list[str]:
    if hasattr(cfg.data, "files"):
        return list(cfg.data.files)
    return [f for f in (cfg.data.prompts, cfg.data.eval_prompts) if f]


# ------------------------------------------------------------------------------------- example configs
@pytest.mark.parametrize("name", RM_RECIPES + PPO_RECIPES)
def test_example_config_loads_and_points_into_shared_data(name):
    cfg = load_example(name)  # unknown keys, bad values and failed cross-checks raise here
    files = data_files(cfg)
    assert files and all(f.startswith("../shared/data/") for f in files), files
    if DATA.is_dir():
        for f in files:
            assert (REPO / f).is_file(), f"{name}: {f} not found from the repository root"


def test_recipe_configs_agree_with_each_other():
    helpful, harmless = load_example("recipe1-rm-helpful.yaml"), load_example("recipe1-rm-harmless.yaml")
    # the two reward models differ only in their data and output folder
    for cfg in (helpful, harmless):
        cfg.data.files, cfg.output_dir = [], ""
    assert helpful == harmless
    svamp, hh = load_example("recipe2-ppo-svamp.yaml"), load_example("recipe3-ppo-hh-minilm.yaml")
    assert svamp.model.policy == hh.model.policy == "smollm2-135m-instruct" and svamp.model.lora_r > 0
    assert svamp.reward.sources == ["tether.rules:math_answer"] and svamp.reward.gold == "auto"
    # recipe 3 is rewarded by what recipe 1 writes, and its critic cannot share the MiniLM tokenizer
    assert hh.reward.sources == [load_example("recipe1-rm-helpful.yaml").output_dir]
    assert hh.critic.kind == "head"


# ------------------------------------------------------------------------------------------ the levers
def test_mean_pooling_is_the_head_on_the_masked_mean_under_any_padding(tmp_path):
    from tether.rm.backbone import pad_batch, pooled_scores

    rm = load_rm(save_tiny_bert(tmp_path / "bert"))
    texts = [rm.text_format.encode(rm.tokenizer, "what is 7 times 6? ", r).ids for r in ("42", "forty two!")]
    model = rm.model
    with torch.no_grad():
        expected = []
        for ids in texts:  # one unpadded row at a time, pooled by hand
            hidden = model.bert(input_ids=torch.tensor([ids])).last_hidden_state[0]  # (T, H)
            expected.append(model.classifier(hidden.mean(0))[0])
        expected = torch.stack(expected)
        for side in ("right", "left"):
            ids, mask = pad_batch(texts, rm.tokenizer.pad_token_id, side)
            got = pooled_scores(model, ids, mask, "mean")
            assert torch.allclose(got, expected, atol=1e-5), side
        # and it is not the model's own [CLS]-pooler head
        assert not torch.allclose(pooled_scores(model, ids, mask, "model"), expected, atol=1e-3)


def test_pooling_choice_is_checked_against_the_head(tmp_path):
    from tether.rm.backbone import check_pooling, load_sequence_classifier

    bert, _ = load_sequence_classifier(save_tiny_bert(tmp_path / "bert"))
    gpt2, _ = load_sequence_classifier(save_tiny_gpt2(tmp_path / "gpt2"), new_head=True)
    assert check_pooling(bert, "auto") == "model" and check_pooling(gpt2, "auto") == "last_token"
    assert check_pooling(bert, "mean") == "mean" and check_pooling(gpt2, "mean") == "mean"
    bert.classifier = torch.nn.Sequential(bert.classifier)  # no longer a plain linear head
    with pytest.raises(TetherError, match="pooling 'mean' needs a linear 'score' or 'classifier' head"):
        check_pooling(bert, "mean")


def test_pair_batches_cover_every_pair_once_and_grouping_cuts_padding():
    from tether.rm.train import pair_batches

    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(803)]
    padded = {}
    for grouped in (False, True):
        batches = pair_batches(lengths, 8, torch.Generator().manual_seed(0), grouped)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        assert all(len(b) == 8 for b in batches[:-1] if len(batches[-1]) == 8) or grouped
        padded[grouped] = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded[True] < 0.6 * padded[False]
    # ungrouped keeps the plain shuffled order (runs made before the option are reproduced exactly)
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    assert pair_batches(lengths, 8, torch.Generator().manual_seed(0), False)[0] == order[:8]


def _rule_pairs(n: int) -> list[PreferencePair]:
    rng = random.Random(1)
    pairs = []
    for i in range(n):
        word = "".join(rng.choice("abcdef") for _ in range(4))
        pairs.append(PreferencePair(f"{word}{i}?", word.upper(), word, f"row {i}"))
    return pairs


def test_dev_split_trains_and_evaluates_on_the_train_side_only(tmp_path, monkeypatch):
    import tether.rm.train as rt

    pairs = _rule_pairs(60)
    seen = {}
    real_evaluate, real_loop = rt.evaluate_pairs, rt.train_loop

    def spy_evaluate(scorer, evaluated, batch_size=64):
        seen["evaluated"] = list(evaluated)
        return real_evaluate(scorer, evaluated, batch_size)

    def spy_loop(model, encoded, cfg, device, pad_id, pooling=None, length_w=None, progress=None):
        seen["n_train"] = len(encoded)
        seen["dropout"] = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        return real_loop(model, encoded, cfg, device, pad_id, pooling, length_w, progress)

    monkeypatch.setattr(rt, "evaluate_pairs", spy_evaluate)
    monkeypatch.setattr(rt, "train_loop", spy_loop)
    cfg = rt.RewardTrainingConfig(model=str(save_tiny_bert(tmp_path / "bert")), output_dir=str(tmp_path / "rm"))
    cfg.data.dev_fraction, cfg.pooling, cfg.disable_dropout = 0.25, "mean", True
    cfg.data.max_length, cfg.optim.epochs, cfg.optim.group_by_length = 16, 1, True
    rm = rt.train_reward_model(cfg, pairs=pairs)

    train_side, held_out = split_pairs(pairs, 0.2, 0)
    evaluated = seen["evaluated"]
    assert not {p.prompt for p in evaluated} & {p.prompt for p in held_out}  # the held-out pairs stay unseen
    assert {p.prompt for p in evaluated} <= {p.prompt for p in train_side}
    assert seen["n_train"] + len(evaluated) == len(train_side) == 48 and len(evaluated) == 12
    assert seen["dropout"] and all(p == 0.0 for p in seen["dropout"])
    meta = json.loads((tmp_path / "rm" / "tether_reward.json").read_text())
    assert meta["pooling"] == "mean" and meta["evaluation"]["split"] == "dev"
    assert meta["data"] | {"evaluated_on": "dev", "dev": 12, "held_out": 12} == meta["data"]
    # the saved model scores with the pooling it was trained with
    from tether import RewardModel

    loaded = RewardModel.from_pretrained(tmp_path / "rm", device="cpu")
    assert loaded.pooling == "mean"
    prompts, replies = [p.prompt for p in evaluated], [p.chosen for p in evaluated]
    assert torch.allclose(loaded.score(prompts, replies, raw=True), rm.score(prompts, replies, raw=True), atol=1e-5)


# ------------------------------------------------------------------------------------ smoke runs (slow)
def _need_real_models(*presets: str) -> None:
    from tether.presets import resolve_model_path

    if not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA}")
    for name in presets:
        try:
            resolve_model_path(name)
        except TetherError as e:  # the message gives the install command
            pytest.skip(f"real-models extra not installed: {e}")


@pytest.fixture(scope="module")
def smoke_rm(tmp_path_factory):
    """Recipe 1 (helpful) shrunk: the first 20 pairs (16 train, 4 held out), max-length 64, one epoch."""
    _need_real_models("minilm-l6")
    from tether.cli import main

    out = tmp_path_factory.mktemp("recipe1") / "rm"
    mp = pytest.MonkeyPatch()
    mp.chdir(REPO)  # the example's data paths are relative to the repository root
    try:
        rc = main(["train-rm", "--config", str(EXAMPLES / "recipe1-rm-helpful.yaml"), "--output-dir", str(out),
                   "--max-pairs", "20", "--max-length", "64", "--epochs", "1", "--norm-sample", "16"])
    finally:
        mp.undo()
    assert rc == 0
    return out


@pytest.mark.slow
def test_recipe1_smoke_trains_a_mean_pooled_minilm_reward_model(smoke_rm):
    from tether import RewardModel

    meta = json.loads((smoke_rm / "tether_reward.json").read_text())
    assert meta["pooling"] == "mean" and meta["text_format"]["max_length"] == 64
    assert meta["training"]["loss"]["length_expert"] and math.isfinite(meta["run"]["length_expert_w"])
    assert meta["data"]["pairs"] == 20 and meta["data"]["held_out"] == meta["evaluation"]["n_pairs"] >= 1
    assert "balanced_train" not in meta["data"]  # the length expert keeps every pair
    ev = json.loads((smoke_rm / "eval.json").read_text())
    assert {"chosen_longer", "chosen_shorter", "prefers_longer"} <= set(ev) and ev["split"] == "held_out"
    rm = RewardModel.from_pretrained(smoke_rm, device="cpu")
    z = rm.score(["\n\nHuman: How do I boil an egg?\n\nAssistant:"] * 2, [" Put it in boiling water.", " No."])
    assert z.shape == (2,) and torch.isfinite(z).all() and z[0] != z[1]


@pytest.mark.slow
def test_recipe3_smoke_ppo_step_on_smollm2_with_the_minilm_reward(smoke_rm, tmp_path, monkeypatch):
    _need_real_models("smollm2-135m-instruct")
    from tether.cli import main

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    rc = main(["ppo", "--config", str(EXAMPLES / "recipe3-ppo-hh-minilm.yaml"), "--reward", str(smoke_rm),
               "--output-dir", str(out), "--steps", "1", "--batch-size", "2", "--mini-batches", "1",
               "--ppo-epochs", "1", "--max-new-tokens", "8", "--eval-every", "0", "--progress", "false"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    row = rows[0]
    for key in ("objective/scores_raw", "objective/kl", "policy/loss", "value/loss", "perf/seconds_generate",
                "perf/seconds_score", "perf/seconds_train"):
        assert math.isfinite(row[key]), key
    assert 1 <= row["response/length_max"] <= 8
    saved = (out / "config.yaml").read_text()
    assert "smollm2-135m-instruct" in saved and str(smoke_rm) in saved


def test_recipes_4_and_5_differ_only_in_their_reward():
    """Recipe 5 (#38 path b) is recipe 4 with a reward model trained on the policy's own samples in place of the
    task's check (and no dynamic sampling: a reward model's scores are never flat) and half the steps (past ~10 a
    learned reward is over-optimised); its pairs are sampled from the same training split, prompt and reply format,
    with the held-out problems left out (in bf16: the checker labels them, so the engine's precision costs nothing)."""
    from tether.sft.sample import SampleConfig

    checker, learned = load_example("recipe4-grpo-chain-sum.yaml"), load_example("recipe5-rm-chain-sum.yaml")
    assert checker.reward.sources == ["tether.tasks:reasoning_gym_score"] and checker.difficulty.filter_groups
    assert learned.reward.sources == ["runs/rm-chain-sum"] and learned.reward.gold == checker.reward.gold == "auto"
    assert not learned.difficulty.filter_groups and not learned.difficulty.curriculum
    assert learned.steps < checker.steps
    for cfg in (checker, learned):
        cfg.output_dir, cfg.reward.sources, cfg.difficulty, cfg.steps = "", [], type(cfg.difficulty)(), 0
    assert checker == learned
    pairs = resolve_config(SampleConfig, argparse.Namespace(), str(EXAMPLES / "recipe5-sample-pairs.yaml"))
    assert pairs.accept.keep == "pairs" and pairs.model.policy == learned.model.policy
    assert pairs.accept.pair_length_gap > 0  # length-matched, as run
    for key in ("prompts", "task_train", "task_eval", "task_seed", "system_prompt", "chat_template"):
        assert getattr(pairs.data, key) == getattr(learned.data, key), key
    assert pairs.generation.max_new_tokens == learned.generation.max_new_tokens
