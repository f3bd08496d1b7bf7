"""Set up a PPO run: processes (accelerate), models, optimisation, and the data the step reads.

:func:`setup` returns a :class:`Run` of four typed parts, each built by one small function:

- :class:`~tether.ppo.processes.Processes` — the accelerator, this process's rank, the cross-process
  reductions (:mod:`tether.ppo.processes`);
- :class:`Models` — tokenizer, policy (and its reference), critic (none for a critic-free estimator, B17), and
  the precision they compute in (C5);
- :class:`Optimisation` — optimisers, schedulers, the parameters they own, the fp16 loss scaler, the KL
  controller;
- :class:`Data` — the prompt stream, held-out rows, reward sources, the gold rule, the score normaliser.

``tether.ppo.step`` reads the same on one CPU process and under ``accelerate launch --num_processes N``.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from tether.core.kl import FixedKLController, make_kl_controller
from tether.errors import TetherError
from tether.hf import DTYPES, context_positions, load_tokenizer
from tether.ppo.checks import MIN_PROMPTS_FOR_SHARE, held_out_fraction
from tether.ppo.curriculum import Curriculum
from tether.ppo.forward import ForwardOptions, resolved_forward_options
from tether.ppo.inputs import GivenInputs
from tether.ppo.models import (
    Policy,
    ValueHead,
    load_critic,
    load_policy,
    same_vocabulary,
)
from tether.ppo.noop import WeightProbe, WeightVersions
from tether.ppo.offpolicy import OneStepOff
from tether.ppo.perf import Throughput, throughput_of
from tether.ppo.processes import Processes, make_processes
from tether.ppo.skips import ForwardSkips, plan_skips, startup_lines
from tether.ppo.prompts import PromptStream, load_prompts, prompt_group_key, split_held_out
from tether.ppo.sources import RunningMoments, build_sources, is_reward_model_dir
from tether.precision import Precision
from tether.presets import resolve_model_path
from tether.rules.calls import gold_rule
from tether.rollout.engines import Engine, make_engine
from tether.rollout.sampling import encode_prompts
from tether.sharding import FsdpSettings, shard

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Models:
    """The models of the run. ``policy_model``/``critic`` are what trains (DDP-wrapped under several
    processes); ``unwrapped_*`` are the same modules unwrapped (generation, saving). Under FSDP2 both names
    are the same sharded module (``fsdp`` holds the settings)."""

    tokenizer: PreTrainedTokenizerBase
    use_chat_template: bool
    policy: Policy                 # reference access: the adapter disabled (LoRA) or the frozen copy
    policy_model: nn.Module
    unwrapped_policy: PreTrainedModel
    critic: nn.Module | None       # ValueHead on the policy's hidden states, SeparateCritic, or None (B17)
    unwrapped_critic: nn.Module | None
    engine: Engine                 # samples the rollouts (C3): --engine, over unwrapped_policy
    precision: Precision           # every policy/reference/critic forward runs in precision.autocast() (C5)
    fsdp: FsdpSettings | None = None
    forward: ForwardOptions = ForwardOptions()  # how every policy/reference forward computes (checked at set-up)
    skips: ForwardSkips = ForwardSkips()  # the scoring forwards left out because their result is known (skips.py)

    @property
    def critic_is_head(self) -> bool:
        return isinstance(self.unwrapped_critic, ValueHead)


@dataclass
class Optimisation:
    """What updates the weights and β, and the state a checkpoint must carry to resume exactly."""

    policy_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None       # None without a critic (a critic-free estimator, B17)
    policy_scheduler: torch.optim.lr_scheduler.LRScheduler
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    policy_params: list[nn.Parameter]
    critic_params: list[nn.Parameter]
    kl_controller: FixedKLController   # fixed, adaptive or proportional (same interface)
    scaler: torch.amp.GradScaler       # fp16 loss scaling of the policy + value loss; a pass-through otherwise


@dataclass
class Data:
    """What the step reads besides the models: prompts, reward sources, the gold rule, the score normaliser."""

    prompts: PromptStream
    eval_rows: list[dict]
    eval_every: int                # evaluate every N steps and at the last; 0 = never (no held-out rows)
    sources: list[Callable]        # each (prompts, responses, fields) -> (B,) scores
    gold: Callable | None          # rule for eval/accuracy
    running_scores: RunningMoments
    # the step-0 evaluation: the untrained policy's (= the reference's) held-out answers and reward, against which
    # later evaluations measure eval/reference_overlap and eval/reward_gain (checkpointed)
    reference_answers: dict | None = None
    ahead: OneStepOff | None = None  # --async-rollout 1: the batch in flight to the rollout processes (C7)


@dataclass
class Run:
    processes: Processes
    models: Models
    optim: Optimisation
    data: Data
    perf: Throughput               # FLOP shapes and the device peak, for perf/mfu
    # the no-op checks (tether.ppo.noop): the trainer's and the engine's weight versions, the update-norm probe
    versions: WeightVersions = field(default_factory=WeightVersions)
    probe: WeightProbe | None = None


def seed_everything(seed: int, rank: int = 0) -> None:
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # ranks sample different responses


def resolve_gold(spec: str, rows: list[dict], given=None):
    """The eval/accuracy rule (:func:`tether.rules.calls.gold_rule`, shared with SFT's evaluation)."""
    return gold_rule(spec, rows, given)


def load_prompt_sets(cfg, given: GivenInputs | None = None) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompt rows: --eval-prompts, an rg: task's own held-out problems, or a share of
    --prompts split off by prompt (:func:`split_prompts`); ``given``: rows handed over from Python in place of the
    files."""
    given = given or GivenInputs()
    if given.prompts is None and cfg.data.prompts.startswith("rg:"):  # a generated task: its own held-out split
        from tether.tasks import split_rows

        rows, held_out = split_rows(cfg.data.prompts, cfg.data.task_train, cfg.data.task_eval, cfg.data.task_seed)
        if given.eval_prompts is not None or cfg.data.eval_prompts:
            held_out = given.eval_prompts if given.eval_prompts is not None else load_prompts(cfg.data.eval_prompts)
        return rows, held_out
    rows = given.prompts if given.prompts is not None else load_prompts(cfg.data.prompts)
    if given.eval_prompts is not None:
        return rows, given.eval_prompts
    if cfg.data.eval_prompts:
        return rows, load_prompts(cfg.data.eval_prompts)
    return split_prompts(cfg, rows)


def split_prompts(cfg, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The held-out share of ``rows`` (data.eval_fraction, by default 0.1: :func:`tether.ppo.checks.held_out_fraction`)
    split off by prompt, seeded by --seed. The default share holds out nothing from a file of fewer than 10 distinct
    prompts; an explicit one needs two (one to hold out, one to train on)."""
    fraction = held_out_fraction(cfg)
    n_prompts = len({prompt_group_key(r["prompt"]) for r in rows})
    if not fraction or (cfg.data.eval_fraction is None and n_prompts < MIN_PROMPTS_FOR_SHARE):
        if cfg.eval.every:  # asked for evaluation, and nothing to evaluate on
            raise TetherError(f"--eval-every {cfg.eval.every}: no held-out prompts (--prompts {cfg.data.prompts} has "
                              f"{n_prompts} distinct prompts, too few for the default held-out share, which needs "
                              f"{MIN_PROMPTS_FOR_SHARE}); give --eval-fraction F or --eval-prompts FILE, or "
                              "--eval-every 0")
        return rows, []
    if n_prompts < 2:
        raise TetherError(f"--eval-fraction {fraction:g}: --prompts {cfg.data.prompts} has one distinct prompt, and "
                          "holding it out leaves nothing to train on; give --eval-prompts FILE, or --eval-fraction 0")
    return split_held_out(rows, fraction, cfg.seed)


def default_critic_backbone(cfg, tokenizer, policy_path: Path) -> Path:
    """A separate critic starts from the first reward model when it shares the policy's tokenizer
    (the common recipe), else from the policy."""
    for spec in cfg.reward.sources:
        if is_reward_model_dir(spec):
            try:
                path = resolve_model_path(spec, what="reward model")  # a Hub id: its snapshot folder
                if same_vocabulary(load_tokenizer(path), tokenizer):
                    return path
            except (OSError, ValueError, TetherError):
                pass
    return policy_path


def chat_template_on(cfg, tokenizer) -> bool:
    """Whether prompts go through the tokenizer's chat template (data.chat_template), checked against it."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.data.chat_template == "on" and not has_template:
        raise TetherError(f"--policy {cfg.model.policy}: data.chat_template=on but the tokenizer has no chat template")
    use = cfg.data.chat_template == "on" or (cfg.data.chat_template == "auto" and has_template)
    if cfg.data.system_prompt and not use:
        raise TetherError(f"--system-prompt: the policy {cfg.model.policy} is not prompted through a chat template "
                          "(data.chat_template); put the instruction in --prompt-template instead")
    return use


def adamw(params: list, lr: float, o) -> torch.optim.AdamW:
    """AdamW; with ``--fused-adamw`` torch's fused kernel where it applies (one kernel over all parameters: 12.6 vs
    38.7 ms per step for the 10.7M bench policy on 2 CPU cores, bench/fast_paths.py; not for FSDP2's DTensors)."""
    fused = o.fused_adamw and all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=o.weight_decay, eps=o.adam_eps, fused=fused or None)


def make_optimisation(cfg, policy: Policy, critic: nn.Module | None, precision: Precision) -> Optimisation:
    from transformers import get_scheduler

    o = cfg.optim
    policy_params = [p for p in policy.model.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad] if critic is not None else []
    policy_optimizer = adamw(policy_params, o.lr, o)
    critic_optimizer = adamw(critic_params, o.critic_lr, o) if critic is not None else None
    total_updates = cfg.steps * cfg.ppo.epochs * cfg.ppo.mini_batches
    schedule = "constant_with_warmup" if o.schedule == "constant" else o.schedule  # "constant" ignores warm-up
    return Optimisation(
        policy_optimizer=policy_optimizer, critic_optimizer=critic_optimizer,
        policy_scheduler=get_scheduler(schedule, policy_optimizer, o.warmup_steps, total_updates),
        critic_scheduler=None if critic is None else get_scheduler(schedule, critic_optimizer, o.warmup_steps,
                                                                    total_updates),
        policy_params=policy_params, critic_params=critic_params,
        kl_controller=make_kl_controller(cfg.kl.controller, cfg.kl.coef, cfg.kl.target, cfg.kl.horizon),
        scaler=precision.grad_scaler())


def probe_rules(sources: list, rows: list[dict]) -> None:
    """Call each rule once on a few prompts with empty replies, before anything is written, so that a rule
    returning the wrong length or a non-number is a one-line error now rather than at step 1. A rule
    that raises here is left to the step (it may just dislike empty replies; rows it fails on are dropped)."""
    from tether.ppo.prompts import collate_fields
    from tether.ppo.sources import RuleSource, call_rule
    from tether.rules.calls import with_completion_ids

    prompts = [r["prompt"] for r in rows]
    for source in sources:
        if isinstance(source, RuleSource) and prompts:
            try:
                call_rule(source.fn, prompts, [""] * len(prompts),
                          with_completion_ids(collate_fields(rows), [[] for _ in prompts]), [True] * len(prompts))
            except TetherError as e:
                if "raised on every response" not in str(e):
                    raise


def check_context(cfg, tokenizer, use_chat_template: bool, model_config, rows: list[dict]) -> None:
    """Prompt (after --max-prompt-length) + --max-new-tokens must fit the policy's positions, else the
    position embeddings are indexed past their end mid-run. Tokenises the prompts only when the
    configured lengths could overflow."""
    context = context_positions(model_config)
    g, d = cfg.generation, cfg.data
    if not context or d.max_prompt_length + g.max_new_tokens <= context:
        return
    for row in rows:
        query, _ = encode_prompts(tokenizer, [row["prompt"]], d.max_prompt_length, use_chat_template,
                                  d.system_prompt, d.prompt_template)
        if query.shape[1] + g.max_new_tokens > context:
            raise TetherError(f"--prompts {cfg.data.prompts}: prompt {row['prompt'][:40]!r}... is {query.shape[1]} "
                              f"tokens (data.max_prompt_length {d.max_prompt_length}) + --max-new-tokens "
                              f"{g.max_new_tokens} > the policy's context of {context} positions; lower "
                              f"data.max_prompt_length or --max-new-tokens")


def ddp_models(processes: Processes, policy: Policy, critic: nn.Module, tokenizer, use_chat_template: bool,
               optim: Optimisation, cfg, precision: Precision) -> Models:
    """Policy and critic (when there is one) wrapped by ``accelerator.prepare`` (DDP under several processes)."""
    accelerator = processes.accelerator
    if critic is None:  # a critic-free estimator (B17)
        policy_model, optim.policy_optimizer = accelerator.prepare(policy.model, optim.policy_optimizer)
    else:
        policy_model, critic, optim.policy_optimizer, optim.critic_optimizer = accelerator.prepare(
            policy.model, critic, optim.policy_optimizer, optim.critic_optimizer)
        critic.train()
    policy_model.train()
    unwrapped_policy = accelerator.unwrap_model(policy_model)
    return Models(tokenizer=tokenizer, use_chat_template=use_chat_template, policy=policy,
                  policy_model=policy_model, unwrapped_policy=unwrapped_policy,
                  critic=critic, unwrapped_critic=None if critic is None else accelerator.unwrap_model(critic),
                  engine=make_engine(cfg, unwrapped_policy, tokenizer, processes), precision=precision)


def sharded_models(processes: Processes, policy: Policy, critic: nn.Module, tokenizer,
                   use_chat_template: bool, cfg, precision: Precision) -> Models:
    """Policy and critic sharded with FSDP2 (tether.sharding), in place; the reference stays whole."""
    shard(policy.model, processes.fsdp, processes.device).train()
    if critic is not None:
        shard(critic, processes.fsdp, processes.device).train()
    return Models(tokenizer=tokenizer, use_chat_template=use_chat_template, policy=policy,
                  policy_model=policy.model, unwrapped_policy=policy.model, critic=critic, unwrapped_critic=critic,
                  engine=make_engine(cfg, policy.model, tokenizer, processes), precision=precision,
                  fsdp=processes.fsdp)


def setup(cfg, given: GivenInputs | None = None) -> Run:
    """The run of ``cfg``; ``given``: rewards and prompts handed over from Python (:mod:`tether.ppo.inputs`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # tether shows its own progress
    processes = make_processes(cfg)
    seed_everything(cfg.seed, processes.rank)
    precision = Precision(DTYPES[cfg.model.dtype], processes.device.type)
    if processes.fsdp is not None and precision.dtype == torch.float16:
        # GradScaler decides to skip a step from the gradients it sees: under FSDP2 each process sees only its
        # shard, so processes could disagree on skipping and on the next scale.
        raise TetherError("--dtype fp16 under FSDP2: not supported (the loss scaler would need a "
                          "cross-process inf check); use bf16, or fp16 with DDP")

    train_rows, eval_rows = load_prompt_sets(cfg, given)
    if processes.is_main:  # legal settings that do nothing here: one line each, once
        for line in cfg.warnings():
            print(f"warning: {line}", file=sys.stderr)
    policy, tokenizer, policy_path = load_policy(cfg.model)
    sources = build_sources(cfg.reward.sources, cfg.reward.ensemble, cfg.reward.batch_size, processes.device,
                            cfg.reward.process, cfg.reward.process_threshold, given.rewards if given else None)
    probe_rules(sources, train_rows[:4])
    critic = None if cfg.advantage.critic_free else load_critic(
        cfg.critic, policy, tokenizer, default_critic_backbone(cfg, tokenizer, policy_path), cfg.model)
    use_chat_template = chat_template_on(cfg, tokenizer)
    check_context(cfg, tokenizer, use_chat_template, policy.model.config, train_rows + eval_rows)
    forward, notes = resolved_forward_options(cfg, processes.fsdp is not None, policy.model)  # packing or not
    if policy.reference is not None:
        policy.reference.to(processes.device)  # frozen: a whole copy on every process, never sharded
    if processes.fsdp is not None:
        models = sharded_models(processes, policy, critic, tokenizer, use_chat_template, cfg, precision)
        optim = make_optimisation(cfg, policy, critic, precision)  # after sharding: the parameters are DTensors
    else:
        optim = make_optimisation(cfg, policy, critic, precision)
        models = ddp_models(processes, policy, critic, tokenizer, use_chat_template, optim, cfg, precision)
    models.forward, models.skips = forward, plan_skips(cfg, models.critic_is_head)
    if processes.is_main:  # the forwards this run leaves out, or why the one it is shaped for still runs
        for line in notes + startup_lines(cfg, models.skips):
            print(f"note: {line}", file=sys.stderr)
    processes.closing.append(models.engine.close)
    gold = resolve_gold(cfg.reward.gold, eval_rows or train_rows, given.gold if given else None)
    curriculum = None
    if cfg.difficulty.curriculum:
        curriculum = Curriculum(len(train_rows), cfg.difficulty.memory, cfg.difficulty.min_weight,
                                cfg.difficulty.pass_threshold)
    data = Data(prompts=PromptStream(train_rows, cfg.batch_size, cfg.seed, processes.rank, processes.world_size,
                                     curriculum=curriculum),
                eval_rows=eval_rows, eval_every=cfg.eval_every if eval_rows else 0, sources=sources, gold=gold,
                running_scores=RunningMoments(),
                ahead=OneStepOff() if cfg.generation.async_rollout else None)
    return Run(processes, models, optim, data, throughput_of(models, processes.device, precision.dtype))
