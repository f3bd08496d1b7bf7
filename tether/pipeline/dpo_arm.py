"""The DPO arm of ``tether rlhf`` (``--dpo``): ``tether dpo`` on the first round's pairs from the same start policy,
then its greedy held-out gold on the same problems as the PPO arms, so that the report pairs it against step 0 (and
a reader against any PPO arm) problem by problem.

The held-out evaluation is PPO's own (:meth:`tether.ppo.train.PPOTrainer.evaluate`: the same prompting, greedy
decoding, gold rule and ``eval/correct`` string), with the DPO policy as the policy and the first reward model for
``eval/reward``; nothing is trained there.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tether.checkpoint import list_checkpoints
from tether.config import check_config, load_yaml
from tether.errors import ConfigError
from tether.pipeline.config import RLHFConfig


def dpo_available() -> bool:
    """Whether this tether has ``tether dpo`` (:mod:`tether.dpo.train`)."""
    return importlib.util.find_spec("tether.dpo") is not None and importlib.util.find_spec("tether.dpo.train") \
        is not None


def dpo_stage(cfg: RLHFConfig, task_dir: Path, policy: str, pairs_file: str, d: Path) -> dict:
    """Train the DPO policy into ``d/policy`` (resumed from its checkpoint when it has one), evaluate it held out."""
    if not dpo_available():
        raise ConfigError("--dpo: this tether has no `tether dpo` (tether.dpo.train); run without --dpo")
    from tether.dpo.config import DPOConfig
    from tether.dpo.train import DPOTrainer

    c = DPOConfig()
    c.model.dtype, c.model.lora_r, c.model.lora_alpha = cfg.model.dtype, cfg.model.lora_r, cfg.model.lora_alpha
    c.data.chat_template, c.data.system_prompt = cfg.task.chat_template, cfg.task.system_prompt
    c.progress = cfg.progress
    if cfg.dpo.config:
        load_yaml(c, cfg.dpo.config)
    out = d / "policy"
    c.model.path, c.data.files, c.output_dir, c.seed = policy, [pairs_file], str(out), cfg.seed
    result = DPOTrainer(check_config(c), resume=bool(list_checkpoints(out))).train()
    evaluation = evaluate_policy(cfg, task_dir, str(out), str(d.parent / "rm_r0"), d / "eval")
    (d / "eval.json").write_text(json.dumps(evaluation, indent=1) + "\n", encoding="utf-8")
    return {"steps": result.steps, "policy": str(out), "preference_accuracy": result.metrics.get("eval/accuracy"),
            "eval": evaluation}


def evaluate_policy(cfg: RLHFConfig, task_dir: Path, policy: str, reward_dir: str, d: Path) -> dict:
    """The held-out ``eval/`` metrics of ``policy``, computed as a PPO arm's evaluation computes them."""
    from tether.pipeline.stages import ppo_config
    from tether.ppo.train import PPOTrainer

    config = ppo_config(cfg, task_dir, policy, reward_dir, cfg.ppo.kl_coef, False, d)
    config.eval.at_start = False  # evaluated below, once; no PPO step is taken
    metrics = PPOTrainer(config).evaluate()
    # eval/kl_sequence is left out: the reference of this evaluation is the DPO policy itself, not the start policy
    return {k: v for k, v in metrics.items() if k.startswith("eval/") and k != "eval/kl_sequence"}
