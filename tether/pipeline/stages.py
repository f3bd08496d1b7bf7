"""The stages of ``tether rlhf``, each a call of the command that does it (``tether sample``, ``train-rm``,
``ppo``, ``sft``) with its config built here: recipe 5's settings, then the stage YAML the user names, then the
wiring (paths, seed, budget, β). Each writes into its own folder and returns a summary for ``stage.json``.

Resuming inside a stage is the stage's own: a folder holding a checkpoint is continued with ``resume=True`` (SFT,
the reward model, PPO); sampling has no checkpoint and starts again (its output is written whole or not at all).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tether.checkpoint import list_checkpoints
from tether.config import check_config, load_yaml
from tether.errors import ConfigError
from tether.pipeline.config import RLHFConfig

TRAIN, HELD_OUT = "train.jsonl", "heldout.jsonl"
RG_GOLD = "tether.tasks:reasoning_gym_correct"


def gold_spec(cfg: RLHFConfig) -> str:
    """The rule that labels the pairs and judges every arm: an rg: task's own check unless one is named."""
    return RG_GOLD if cfg.task.gold == "auto" else cfg.task.gold


def check_task(cfg: RLHFConfig) -> None:
    """One-line errors before anything runs: the policy (and reward-model backbone) resolve to model folders, the gold
    rule imports, an rg: task parses and reasoning-gym takes it, the prompt and SFT files exist."""
    from tether.presets import resolve_model_path
    from tether.rules import load_rule

    resolve_model_path(cfg.model.policy, what="policy")  # a Hub id is fetched here, as the first stage would
    if cfg.model.reward_model:
        resolve_model_path(cfg.model.reward_model, what="reward-model backbone")
    load_rule(gold_spec(cfg), flag="--gold")
    if cfg.sft.data and not cfg.sft.data.startswith("hf:") and not Path(cfg.sft.data).exists():
        raise ConfigError(f"--sft-data {cfg.sft.data}: no such file")
    if cfg.task.prompts.startswith("rg:"):
        from tether.tasks import task_rows

        task_rows(cfg.task.prompts, 1, cfg.task.task_seed)
    else:
        for flag, path in (("--task", cfg.task.prompts), ("--eval-prompts", cfg.task.eval_prompts)):
            if path and not path.startswith("hf:") and not Path(path).exists():
                raise ConfigError(f"{flag} {path}: no such file (a prompt file, or rg:DATASET[:key=value,...])")


def task_prompt(cfg: RLHFConfig) -> str:
    """A training prompt of the task, as text (what the estimate's calibration generates from)."""
    if cfg.task.prompts.startswith("rg:"):
        from tether.tasks import task_rows

        return task_rows(cfg.task.prompts, 1, cfg.task.task_seed)[0]["prompt"]
    from tether.inputs.prompt_rows import load_prompts

    prompt = load_prompts(cfg.task.prompts)[0]["prompt"]
    return prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)


def prepare_task(cfg: RLHFConfig, d: Path) -> dict:
    """The training and held-out rows, written once so that every stage and arm reads the same problems: an rg:
    task's own split (:func:`tether.tasks.split_rows`), or the prompt file with ``--eval-prompts`` (else its last
    ``--eval-n`` rows after a shuffle seeded by ``--task-seed``); with ``--twins-apart`` less the training rows that
    have a held-out twin (:mod:`tether.pipeline.twins`)."""
    from tether.inputs.prompt_rows import load_prompts

    t = cfg.task
    if t.prompts.startswith("rg:"):
        from tether.tasks import split_rows

        train, held_out = split_rows(t.prompts, t.task_train, cfg.ppo.eval_n, t.task_seed)
    else:
        rows = load_prompts(t.prompts)
        if t.eval_prompts:
            train, held_out = rows, load_prompts(t.eval_prompts)
        else:
            random.Random(t.task_seed).shuffle(rows)
            n_eval = min(cfg.ppo.eval_n, len(rows) // 2)
            train, held_out = rows[:len(rows) - n_eval], rows[len(rows) - n_eval:]
    from tether.pipeline.twins import twin_flags

    twins = twin_flags(held_out, train)  # a training row with a held-out twin
    if t.twins_apart:
        train = [row for row, twin in zip(train, twins) if not twin]
    if not train or not held_out:
        raise ConfigError(f"--task {t.prompts}: {len(train)} training and {len(held_out)} held-out rows; both are "
                          "needed")
    d.mkdir(parents=True, exist_ok=True)
    for name, rows in ((TRAIN, train), (HELD_OUT, held_out)):
        (d / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return {"train": len(train), "held_out": len(held_out), "gold": gold_spec(cfg),
            "training_rows_with_a_held_out_twin": sum(twins), "twins_dropped": t.twins_apart}


def _apply_yaml(stage_cfg, path: str) -> None:
    if path:
        load_yaml(stage_cfg, path)


def sft_stage(cfg: RLHFConfig, task_dir: Path, d: Path) -> dict:
    """``tether sft`` of the starting policy on ``--sft-data``; the fine-tuned policy is the folder itself."""
    from tether.sft.config import SFTConfig
    from tether.sft.train import SFTTrainer

    c = SFTConfig()
    c.model.dtype, c.model.lora_r, c.model.lora_alpha = cfg.model.dtype, cfg.model.lora_r, cfg.model.lora_alpha
    c.data.chat_template, c.data.system_prompt = cfg.task.chat_template, cfg.task.system_prompt
    c.progress = cfg.progress
    _apply_yaml(c, cfg.sft.config)
    c.model.path, c.data.files, c.output_dir, c.seed = cfg.model.policy, [cfg.sft.data], str(d), cfg.seed
    if cfg.sft.steps:
        c.optim.max_steps = cfg.sft.steps
    c.eval.prompts, c.eval.gold, c.eval.n = str(task_dir / HELD_OUT), gold_spec(cfg), cfg.ppo.eval_n
    c.eval.max_new_tokens = cfg.task.max_new_tokens
    result = SFTTrainer(check_config(c), resume=bool(list_checkpoints(d))).train()
    return {"steps": result.steps, "policy": str(d),
            "eval_accuracy": result.metrics.get("eval/accuracy")}


def pairs_stage(cfg: RLHFConfig, task_dir: Path, policy: str, d: Path, seed: int) -> dict:
    """``tether sample --keep pairs``: the policy's own replies to the training problems, each right reply ≻ each
    wrong one of the same problem by the gold rule, length-matched (``--pair-length-gap``); at most ``--pairs``."""
    from tether.runlog import write_text_atomic
    from tether.sft.sample import rejection_sample

    p = cfg.pairs
    result = rejection_sample(sample_config(cfg, task_dir, policy, d, seed))
    rows = result.rows[:p.max_pairs] if p.max_pairs else result.rows
    if len(rows) < len(result.rows):  # the pair budget: the first problems' pairs, as sampled
        write_text_atomic(result.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    if not rows:
        raise ConfigError(f"{policy}: no pair from {result.counts['samples']} samples (the gold rule passed "
                          f"{result.counts['accepted']}): every problem all right or all wrong; choose a task in the "
                          "policy's reach (a sampled pass rate of 15-60%) or more --pair-samples")
    c_ = result.counts
    return {"pairs": len(rows), "samples": c_["samples"], "sample_accuracy": c_["accepted"] / max(c_["samples"], 1),
            "prompts": c_["prompts"], "prompts_with_pairs": c_["prompts_with_kept"], "file": str(result.output),
            "policy": policy}


def sample_config(cfg: RLHFConfig, task_dir: Path, policy: str, d: Path, seed: int):
    """The pairs stage's :class:`~tether.sft.sample.SampleConfig` (the estimate's calibration samples with it too)."""
    from tether.sft.sample import SampleConfig

    c, p = SampleConfig(), cfg.pairs
    c.samples_per_prompt, c.batch_size, c.progress = p.samples_per_prompt, p.batch_size, cfg.progress
    c.model.dtype = cfg.model.dtype
    c.data.chat_template, c.data.system_prompt = cfg.task.chat_template, cfg.task.system_prompt
    c.generation.max_new_tokens, c.generation.temperature = cfg.task.max_new_tokens, cfg.task.temperature
    c.accept.keep, c.accept.max_per_prompt, c.accept.pair_length_gap = "pairs", p.max_per_prompt, p.length_gap
    _apply_yaml(c, p.config)
    c.output, c.seed, c.model.policy = str(d / "pairs.jsonl"), seed, policy
    c.data.prompts, c.data.max_prompts = str(task_dir / TRAIN), p.prompts
    c.accept.sources, c.generation.engine = [gold_spec(cfg)], cfg.engine
    return check_config(c)


def rm_stage(cfg: RLHFConfig, backbone: str, pair_files: list[str], d: Path) -> dict:
    """``tether train-rm`` on the pairs (all rounds' so far): its held-out verdict (``eval.json``) and the probe of
    what it learned on the training problems' own replies (:func:`tether.pipeline.probe.probe_reward_model`)."""
    from tether.pipeline.probe import probe_reward_model
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.trainer import RewardTrainer

    c, r = RewardTrainingConfig(), cfg.rm
    c.optim.epochs, c.optim.lr, c.optim.batch_size, c.data.eval_fraction = r.epochs, r.lr, r.batch_size, \
        r.eval_fraction
    c.dtype = cfg.model.dtype
    if cfg.model.lora_r:
        c.lora.r, c.lora.alpha, c.lora.target_modules = cfg.model.lora_r, float(cfg.model.lora_alpha), "all-linear"
    _apply_yaml(c, r.config)
    c.model, c.data.files, c.output_dir, c.seed = backbone, list(pair_files), str(d), cfg.seed
    RewardTrainer(check_config(c), resume=bool(list_checkpoints(d))).train()
    ev = json.loads((d / "eval.json").read_text(encoding="utf-8"))
    keep = ("accuracy", "wilson_low", "wilson_high", "n_pairs", "excludes_chance")
    return {"held_out": {k: ev.get(k) for k in keep}, "probe": probe_reward_model(d, pair_files),
            "pairs_files": list(pair_files), "backbone": backbone}


def ppo_config(cfg: RLHFConfig, task_dir: Path, policy: str, reward_dir: str, beta: float, shuffle: bool,
               d: Path, steps: int | None = None):
    """One PPO arm's :class:`~tether.ppo.config.RunConfig`: recipe 5's GRPO (k3 in the loss, greedy held-out
    evaluation from step 0), the user's ``--ppo-config``, then this arm's policy, reward model, β and budget."""
    from tether.ppo.config import RunConfig

    c, p = RunConfig(), cfg.ppo
    c.batch_size, c.samples_per_prompt, c.optim.lr = p.batch_size, p.samples_per_prompt, p.lr
    c.advantage.estimator, c.kl.estimator, c.kl.penalty_in, c.kl.controller = "grpo", "k3", "loss", "fixed"
    c.ppo.epochs, c.ppo.mini_batches = 1, 2
    c.eval.at_start, c.eval.greedy, c.eval.kl_n = True, True, 32
    c.generation.max_new_tokens, c.generation.temperature = cfg.task.max_new_tokens, cfg.task.temperature
    c.model.dtype, c.model.lora_r, c.model.lora_alpha = cfg.model.dtype, cfg.model.lora_r, cfg.model.lora_alpha
    c.data.chat_template, c.data.system_prompt, c.progress = cfg.task.chat_template, cfg.task.system_prompt, \
        cfg.progress
    c.kl.reference = "always"  # the beta = 0 arm's KL is part of what the arms are compared on (tether.ppo.skips)
    _apply_yaml(c, p.config)
    c.output_dir, c.seed, c.steps, c.save_every = str(d), cfg.seed, steps or p.steps, p.save_every
    c.model.policy, c.reward.sources, c.reward.shuffle, c.kl.coef = policy, [reward_dir], shuffle, beta
    c.data.prompts, c.data.eval_prompts = str(task_dir / TRAIN), str(task_dir / HELD_OUT)
    c.reward.gold, c.eval.every, c.eval.n = gold_spec(cfg), p.eval_every, p.eval_n
    c.eval.samples, c.generation.engine = None, cfg.engine  # every held-out answer: the report pairs them
    return check_config(c)


def run_ppo(config, callbacks=()) -> dict:
    """A PPO arm, continued from its newest checkpoint when its folder holds one."""
    from tether.ppo.train import PPOTrainer

    d = Path(config.output_dir)
    result = PPOTrainer(config, callbacks=callbacks, resume=bool(list_checkpoints(d))).train()
    return {"steps": result.steps, "stopped": result.stopped, "policy": str(d / "policy")}


def run_ppo_process(run_dir: Path, config_dict: dict) -> Path:
    """A PPO arm in a process of its own (``--parallel-arms``; :func:`tether.demo.side_by_side.run_side_by_side`)."""
    from tether.config import as_config
    from tether.ppo.config import RunConfig

    run_ppo(as_config(RunConfig, config_dict))
    return run_dir
