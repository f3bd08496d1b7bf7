"""Tiny models and files for tests: a character tokenizer, a random GPT-2 policy saved with
``save_pretrained``, prompt files, and PPO configs that run in about a second a step."""

from __future__ import annotations

import json
from pathlib import Path

from tether.ppo.config import RunConfig


def make_policy_dir(root: Path, seed: int = 0, n_layer: int = 2, n_embd: int = 32, n_head: int = 2) -> Path:
    from tether.demo.task import build_policy, build_tokenizer

    path = Path(root) / "policy"
    tokenizer = build_tokenizer(path)
    build_policy(tokenizer, seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head).save_pretrained(path)
    return path


def make_prompts_file(root: Path, n: int = 32, seed: int = 1, name: str = "prompts.jsonl") -> Path:
    from tether.demo.task import make_problems

    path = Path(root) / name
    path.write_text("".join(json.dumps(p) + "\n" for p in make_problems(n, seed=seed)), encoding="utf-8")
    return path


def tiny_config(root: Path, policy: Path, prompts: Path, **overrides) -> RunConfig:
    """A PPO config for the tiny models; ``overrides`` are dotted keys (``kl__coef`` for ``kl.coef``)."""
    cfg = RunConfig()
    cfg.output_dir = str(Path(root) / "run")
    cfg.model.policy = str(policy)
    cfg.data.prompts = str(prompts)
    cfg.reward.sources = ["tether.rules:char_share:char=7"]
    cfg.reward.gold = "none"
    cfg.steps, cfg.batch_size, cfg.ppo.mini_batches = 2, 8, 2
    cfg.generation.max_new_tokens = 6
    cfg.optim.lr, cfg.optim.critic_lr = 1e-3, 1e-3
    cfg.progress = False
    for key, value in overrides.items():
        obj = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            obj = getattr(obj, p)
        setattr(obj, parts[-1], value)
    cfg.validate()
    return cfg
