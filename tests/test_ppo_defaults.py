"""The defaults the tool recommends (#49): PPO holds out a share of its prompts by prompt (seeded) and evaluates
them at the start and about ten times a run; the launch checklist agrees with the defaults; one answer-length cap
for every stage that generates; train-rm turns dropout off as TRL does. The demo and the recipes keep their
settings (the recipes' held-out problems do not move)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.ppo.checks import eval_every, held_out_fraction
from tether.ppo.config import RunConfig
from tether.ppo.prompts import split_held_out


def ppo_config(**keys) -> RunConfig:
    cfg = RunConfig()
    cfg.model.policy, cfg.data.prompts, cfg.reward.sources = "no/such/policy", "prompts.jsonl", ["m:f"]
    for key, value in keys.items():
        obj = cfg
        *parts, last = key.split("__")
        for part in parts:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    cfg.validate()
    return cfg


def test_the_split_keeps_each_prompt_on_one_side_and_holds_out_the_share():
    rng = random.Random(0)
    rows = [{"prompt": f"{i}+1=", "copy": c} for i in range(40) for c in range(rng.randint(1, 3))]
    rng.shuffle(rows)
    train, held = split_held_out(rows, 0.1, seed=3)
    assert sorted(map(json.dumps, train + held)) == sorted(map(json.dumps, rows))  # every row once
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}  # no prompt on both sides
    target = int(len(rows) * 0.1)
    last = held[-1]["prompt"]  # the last prompt held out was needed: without it the share is not reached
    assert len(held) >= target and len([r for r in held if r["prompt"] != last]) < target
    assert split_held_out(rows, 0.1, seed=3) == (train, held)  # seeded
    assert split_held_out(rows, 0.1, seed=4)[1] != held
    # conversational prompts (message lists) are grouped the same way
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    assert len(split_held_out(chats, 0.1, seed=3)[1]) == len(held)


def test_with_distinct_prompts_the_split_is_the_row_split_of_before():
    """Recipes 2 and 3 (SVAMP, HH: every prompt distinct) hold out the same problems as before the split went by
    prompt: the earlier row split, written out here, gives the same rows in the same order."""
    rows = [{"prompt": f"q{i}"} for i in range(1000)]
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    n_eval = max(1, int(1000 * 0.1))
    assert split_held_out(rows, 0.1, seed=0) == ([rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]])


@pytest.mark.parametrize("keys, fraction, every", [
    ({}, 0.1, 2),                                                  # 20 steps: every 2, a tenth held out
    ({"steps": 5}, 0.1, 1),                                        # never less than every step
    ({"steps": 100}, 0.1, 10),
    ({"data__eval_fraction": 0.0}, 0.0, 0),                        # turned off
    ({"data__eval_fraction": 0.25}, 0.25, 2),
    ({"eval__every": 7}, 0.1, 7),
    ({"data__eval_prompts": "held.jsonl"}, 0.0, 2),                # held-out prompts given: no share of --prompts
    ({"data__prompts": "rg:chain_sum"}, 0.0, 2),                   # a task's own held-out problems
    ({"data__prompts": "rg:chain_sum", "data__task_eval": 0}, 0.0, 0),
])
def test_default_share_and_schedule(keys, fraction, every):
    cfg = ppo_config(**keys)
    assert held_out_fraction(cfg) == fraction
    assert eval_every(cfg) == cfg.eval_every == every
    assert cfg.eval.at_start  # the step-0 baseline the doctor's gold band starts from


def test_a_default_run_evaluates_its_held_out_prompts_from_step_0(tmp_path):
    """Every evaluation setting at its default (tiny_config turns them off; set back here): 32 distinct prompts, 3 held
    out (the first 3 of the seeded permutation), evaluated at step 0 and every max(1, 2 // 10) = 1 step, and never
    drawn for training."""
    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    defaults = RunConfig()
    cfg = tiny_config(tmp_path, policy, prompts, data__eval_fraction=defaults.data.eval_fraction,
                      eval__at_start=defaults.eval.at_start)
    from tether.ppo.train import PPOTrainer

    trainer = PPOTrainer(cfg)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    order = torch.randperm(32, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    held = {rows[i]["prompt"] for i in order[:3]}
    assert {r["prompt"] for r in trainer.run.data.eval_rows} == held
    assert not held & {r["prompt"] for r in trainer.run.data.prompts.rows}
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "eval/reward" in r] == [0, 1, 2]
    step_0 = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in step_0} == held


def test_the_launch_checklist_agrees_with_the_defaults():
    from tether.ppo.dryrun import launch_checklist

    def verdicts(cfg):
        return {i.name: i.ok for i in launch_checklist(cfg)}

    assert verdicts(ppo_config())["KL penalty"] and verdicts(ppo_config())["held-out evaluation"]
    assert verdicts(ppo_config(kl__controller="adaptive"))["KL penalty"]
    assert not verdicts(ppo_config(kl__coef=0.0))["KL penalty"]  # beta 0: no tether
    assert not verdicts(ppo_config(data__eval_fraction=0.0))["held-out evaluation"]
    assert not verdicts(ppo_config(eval__every=0))["held-out evaluation"]


def test_one_answer_length_default_for_every_stage_that_generates():
    from tether.config import MAX_NEW_TOKENS
    from tether.sft.config import SFTConfig
    from tether.sft.sample import SampleConfig

    assert RunConfig().generation.max_new_tokens == SFTConfig().eval.max_new_tokens \
        == SampleConfig().generation.max_new_tokens == MAX_NEW_TOKENS == 256


def test_the_demo_passes_its_own_settings():
    """The demo's PPO keeps what it measured with: its own held-out file, its schedule, 8 new tokens, fixed beta."""
    from pathlib import Path

    from tether.demo.pipeline import QUICK, demo_ppo_config

    cfg = demo_ppo_config(Path("run"), Path("out"), Path("p.jsonl"), Path("e.jsonl"), 0.05, QUICK, 0)
    assert held_out_fraction(cfg) == 0.0 and cfg.eval_every == QUICK.eval_every and cfg.eval.at_start
    assert cfg.generation.max_new_tokens == 8 and cfg.kl.controller == "fixed" and cfg.warnings() == []


def test_train_rm_turns_the_backbone_dropout_off_by_default(tmp_path):
    """As TRL's RewardTrainer (disable_dropout=True); --disable-dropout false keeps the model's 0.1, and a LoRA
    adapter's own dropout (--lora-dropout) is kept as set."""
    from test_rm_resume import gpt2_with_dropout

    from tether.rm.config import LoraConfig, RewardTrainingConfig
    from tether.rm.train import load_model

    path = gpt2_with_dropout(tmp_path / "gpt2")

    def dropouts(**keys):
        cfg = RewardTrainingConfig(model=str(path), output_dir=str(tmp_path / "rm"), **keys)
        cfg.data.files = ["pairs.jsonl"]
        model = load_model(cfg, path, torch.device("cpu"))[0]
        return {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}

    assert RewardTrainingConfig().disable_dropout
    assert set(dropouts().values()) == {0.0}
    assert set(dropouts(disable_dropout=False).values()) == {0.1}
    cfg_lora = dropouts(lora=LoraConfig(r=2, dropout=0.2))
    assert {p for n, p in cfg_lora.items() if "lora_dropout" in n} == {0.2}
    assert {p for n, p in cfg_lora.items() if "lora_dropout" not in n} == {0.0}
