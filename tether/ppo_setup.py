"""Set up the components of a PPO run: devices and processes (accelerate), policy and reference,
critic, reward sources, prompt streams, optimisers, schedulers and the KL controller.

:class:`Components` also carries the few distributed helpers the step needs (global mean/max of a
metric, backward, no-sync for gradient accumulation), so ``tether.ppo`` reads the same on one CPU
process and under ``accelerate launch --num_processes N``.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.errors import TetherError
from tether.kl import make_kl_controller
from tether.models import load_critic, load_policy, load_tokenizer, same_vocabulary
from tether.prompts import PromptStream, load_prompts
from tether.rewards import RunningMoments, build_sources, is_reward_model_dir, load_rule


@dataclass
class Components:
    accelerator: object
    device: torch.device
    world_size: int
    rank: int
    tokenizer: object
    use_chat_template: bool
    policy: object                 # tether.models.Policy (reference access)
    policy_model: object           # the trained model, possibly DDP-wrapped
    unwrapped_policy: object       # the same model, unwrapped (generation, saving)
    critic: object                 # ValueHead or SeparateCritic, possibly DDP-wrapped
    critic_is_head: bool
    sources: list
    prompts: PromptStream
    eval_rows: list
    gold: object                   # rule for eval/accuracy, or None
    policy_optimizer: object
    critic_optimizer: object
    policy_scheduler: object
    critic_scheduler: object
    policy_params: list
    critic_params: list
    kl_controller: object
    running_scores: RunningMoments

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def unwrapped_critic(self):
        return self.accelerator.unwrap_model(self.critic)

    def _reduce(self, x, op) -> float:
        t = torch.as_tensor(x, dtype=torch.float64, device=self.device).detach().clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=op)
        return float(t)

    def global_mean(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.SUM if self.world_size > 1 else None) / self.world_size

    def global_sum(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.SUM if self.world_size > 1 else None)

    def global_max(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.MAX if self.world_size > 1 else None)

    def global_min(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.MIN if self.world_size > 1 else None)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on every micro-batch but the last of a minibatch."""
        with contextlib.ExitStack() as stack:
            if not last and self.world_size > 1:
                stack.enter_context(self.accelerator.no_sync(self.policy_model))
                stack.enter_context(self.accelerator.no_sync(self.critic))
            yield

    @staticmethod
    def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def seed_everything(seed: int, rank: int = 0) -> None:
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # ranks sample different responses


def resolve_gold(spec: str, rows: list[dict]):
    """The eval/accuracy rule: explicit ``module:function``, ``none``, or ``auto`` (the math rule when
    the prompt rows carry an ``answer``)."""
    if spec == "none":
        return None
    if spec == "auto":
        if rows and all("answer" in r for r in rows):
            from tether.rules import math_correct

            return math_correct
        return None
    return load_rule(spec)


def load_prompt_sets(cfg) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompt rows (a seeded split of --prompts when there is no --eval-prompts)."""
    rows = load_prompts(cfg.data.prompts)
    if cfg.data.eval_prompts:
        return rows, load_prompts(cfg.data.eval_prompts)
    if cfg.data.eval_fraction > 0:
        g = torch.Generator().manual_seed(cfg.seed)
        order = torch.randperm(len(rows), generator=g).tolist()
        n_eval = max(1, int(len(rows) * cfg.data.eval_fraction))
        return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]
    return rows, []


def default_critic_backbone(cfg, tokenizer, policy_path: Path) -> Path:
    """A separate critic starts from the first reward model when it shares the policy's tokenizer
    (the common recipe), else from the policy."""
    for spec in cfg.reward.sources:
        if is_reward_model_dir(spec):
            try:
                if same_vocabulary(load_tokenizer(spec), tokenizer):
                    return Path(spec)
            except (OSError, ValueError):
                pass
    return policy_path


def setup(cfg) -> Components:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from transformers import get_scheduler
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # tether shows its own progress

    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    world_size, rank = accelerator.num_processes, accelerator.process_index
    seed_everything(cfg.seed, rank)

    train_rows, eval_rows = load_prompt_sets(cfg)
    policy, tokenizer, policy_path = load_policy(cfg.model)
    sources = build_sources(cfg.reward.sources, cfg.reward.ensemble, cfg.reward.batch_size, accelerator.device)
    critic = load_critic(cfg.critic, policy, tokenizer, default_critic_backbone(cfg, tokenizer, policy_path),
                         cfg.model.trust_remote_code)
    use_chat_template = cfg.data.chat_template == "on" or (
        cfg.data.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None)))
    if cfg.data.chat_template == "on" and not getattr(tokenizer, "chat_template", None):
        raise TetherError(f"--policy {cfg.model.policy}: data.chat_template=on but the tokenizer has no chat template")
    if cfg.data.system_prompt and not use_chat_template:
        raise TetherError(f"--system-prompt: the policy {cfg.model.policy} is not prompted through a chat template "
                          "(data.chat_template); put the instruction in --prompt-template instead")

    policy_params = [p for p in policy.model.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    o = cfg.optim
    policy_optimizer = torch.optim.AdamW(policy_params, lr=o.lr, weight_decay=o.weight_decay, eps=o.adam_eps)
    critic_optimizer = torch.optim.AdamW(critic_params, lr=o.critic_lr, weight_decay=o.weight_decay, eps=o.adam_eps)
    total_updates = cfg.steps * cfg.ppo.epochs * cfg.ppo.mini_batches
    policy_scheduler = get_scheduler(o.schedule, policy_optimizer, o.warmup_steps, total_updates)
    critic_scheduler = get_scheduler(o.schedule, critic_optimizer, o.warmup_steps, total_updates)

    if policy.reference is not None:
        policy.reference.to(accelerator.device)
    policy_model, critic, policy_optimizer, critic_optimizer = accelerator.prepare(
        policy.model, critic, policy_optimizer, critic_optimizer)
    policy_model.train()
    critic.train()

    from tether.models import ValueHead

    return Components(
        accelerator=accelerator, device=accelerator.device, world_size=world_size, rank=rank,
        tokenizer=tokenizer, use_chat_template=use_chat_template, policy=policy, policy_model=policy_model,
        unwrapped_policy=accelerator.unwrap_model(policy_model), critic=critic,
        critic_is_head=isinstance(accelerator.unwrap_model(critic), ValueHead), sources=sources,
        prompts=PromptStream(train_rows, cfg.batch_size, cfg.seed, rank, world_size), eval_rows=eval_rows,
        gold=resolve_gold(cfg.reward.gold, eval_rows or train_rows),
        policy_optimizer=policy_optimizer, critic_optimizer=critic_optimizer,
        policy_scheduler=policy_scheduler, critic_scheduler=critic_scheduler,
        policy_params=policy_params, critic_params=critic_params,
        kl_controller=make_kl_controller(cfg.kl.controller, cfg.kl.coef, cfg.kl.target, cfg.kl.horizon),
        running_scores=RunningMoments(),
    )
