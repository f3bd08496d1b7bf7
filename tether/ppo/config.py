"""The PPO run config (Stage B): one dataclass, nested by concern, every field documented once.

Hyper-parameter names are the same in code, YAML (``kl.coef``), command line (``--kl-coef``) and
metric names (``objective/kl_coef``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.config import check_fields, option
from tether.core.group import CRITIC_FREE, ESTIMATORS, GROUP_BASELINES
from tether.core.kl import K3_CLIP
from tether.core.losses import POLICY_LOSSES
from tether.diagnostics.health import HealthConfig
from tether.errors import ConfigError
from tether.trl_compat.keys import accepts_trl_keys
from tether.ppo.checks import (check_defaults_apply, check_policy_loss, eval_every,
                               run_warnings)
from tether.ppo.config_rollout import (CorrectionConfig, DataConfig, GenerationConfig, ModelConfig,  # noqa: F401
                                       RewardConfig)

# tokens whose output-head logits one training forward holds at once (tether.ppo.forward.head_logprobs); the
# memory plan counts them
LOGIT_CHUNK_TOKENS = 1024


@dataclass
class KLConfig:
    coef: float = option(0.05, "initial beta of the per-token KL penalty", low=0.0, flag="--kl-coef")
    estimator: str = option("k1", "per-token KL estimator", choices=("k1", "k2", "k3"),
                            flag="--kl-estimator")
    k3_clip: float = option(K3_CLIP, "k3 per token clipped to at most this, as veRL and OpenRLHF do (kl.estimator "
                            "k3, and the k3 loss term of --kl-in loss); 0 = off, as TRL", low=0.0, flag="--kl-k3-clip")
    controller: str = option("fixed", "beta controller", choices=("fixed", "adaptive", "proportional"),
                             flag="--kl-controller")
    target: float = option(0.01, "target per-token KL to the reference for the adaptive/proportional controller "
                           "(not the PPO epoch early stop: --ppo-early-stop-kl)", low=0.0, low_open=True, flag="--kl-target",
                           old_flags=("--target-kl",))
    horizon: float = option(10000.0, "proportional controller horizon (in samples)", low=1.0)
    penalty_in: str = option("reward", "where the tether acts: 'reward' (-beta * KL_t on each token's reward, "
                             "kl.estimator; the objective is reward - beta * KL) or 'loss' (beta * k3(pi, pi_ref) "
                             "token mean added to the policy loss, as GRPO; the reward is the score alone)",
                             choices=("reward", "loss"), flag="--kl-in")
    reference: str = option("auto", "the reference forward: 'auto' skips it when beta = 0 throughout (kl.coef 0, "
                            "fixed controller, --kl-in reward), the KL metrics then not computed; 'always' runs it "
                            "(objective/kl* reported)", choices=("auto", "always"), flag="--kl-reference")


@dataclass
class GAEConfig:
    gamma: float = option(1.0, "discount", low=0.0, high=1.0, flag="--gamma")
    lam: float = option(0.95, "GAE lambda", low=0.0, high=1.0, flag="--lam")


@dataclass
class AdvantageConfig:
    estimator: str = option("gae", "advantage estimator: 'gae' with a critic; critic-free (no critic "
                            "built): 'rloo' (minus the mean of the prompt's other samples), 'grpo' (group z-score), "
                            "'dr_grpo' (minus the group mean; loss over a constant length), 'reinforce_pp' "
                            "(REINFORCE++: batch-whitened returns); docs/group-baselines.md",
                            choices=ESTIMATORS, flag="--advantage")
    std_eps: float = option(1e-6, "grpo: eps in (s - mean) / (std + eps), std the group's sample std", low=0.0,
                            low_open=True)

    @property
    def critic_free(self) -> bool:
        return self.estimator in CRITIC_FREE


@dataclass
class DifficultyConfig:
    filter_groups: bool = option(False, "dynamic sampling (DAPO): a group whose kept scores have no spread (all "
                                 "equal: every group baseline gives it advantage 0) is dropped and more prompts are "
                                 "drawn until the step holds --batch-size groups with spread; needs "
                                 "--samples-per-prompt >= 2", flag="--filter-groups")
    max_rounds: int = option(4, "--filter-groups: extra rounds of drawing at most per step; reached, the "
                             "step trains on the groups it has (filter/groups_short, one warning line)", low=0,
                             flag="--filter-max-rounds")
    oversample: float = option(1.0, "--filter-groups: prompts the first round draws, as a multiple of --batch-size; "
                               "1 = rounds of exactly --batch-size prompts (on a CPU, where decoding more rows costs "
                               "more: docs/performance.md), 0 = one round sized from the recent steps' share of groups "
                               "with no spread (the first step draws --batch-size; for a GPU's weight-bound decoding)",
                               low=0.0, flag="--filter-oversample")
    curriculum: bool = option(False, "an online prompt curriculum: each prompt's pass rate over its last "
                              "difficulty.memory visits is remembered (checkpointed); prompts that passed all or none "
                              "of their samples in every remembered visit are drawn with weight "
                              "difficulty.min_weight instead of 1, never excluded", flag="--curriculum")
    pass_threshold: float = option(0.5, "a sample passes when its score is above this (0/1 verifier rewards: 0.5)")
    memory: int = option(2, "visits per prompt the curriculum remembers", low=1)
    min_weight: float = option(0.25, "draw weight of a prompt solved (or failed) in every remembered visit; the others "
                               "weigh 1", low=0.0, low_open=True, high=1.0)


@dataclass
class PPOConfig:
    epochs: int = option(4, "optimisation epochs over each rollout batch", low=1, flag="--ppo-epochs")
    mini_batches: int = option(4, "minibatches per epoch (must divide --batch-size)", low=1,
                               flag="--mini-batches")
    grad_accumulation: int = option(1, "micro-batches per minibatch (must divide the minibatch)", low=1,
                                    flag="--grad-accumulation")
    policy_loss: str = option("ppo", "the policy loss (docs/losses.md): 'ppo' the clipped surrogate of token "
                              "ratios; 'gspo' the sequence ratio (geometric mean of the token ratios) clipped by "
                              "--gspo-clip-range, one loss per response; 'gspo_token' its per-token form (the same "
                              "value, each token's gradient weighted by its own advantage); 'cispo' the clipped ratio, "
                              "held constant, times advantage times log-prob (every token keeps a gradient)",
                              choices=POLICY_LOSSES, flag="--policy-loss",
                              value_aliases={"token": "ppo", "sequence": "gspo"})  # TRL's importance_sampling_level
    clip_range: float = option(0.2, "epsilon of the clipped surrogate (ppo, cispo: ratio clipped below at "
                               "1 - epsilon)", low=0.0, low_open=True, flag="--clip-range")
    clip_range_high: float | None = option(None, "epsilon_high: ratio clipped above at 1 + epsilon_high (ppo, cispo; "
                                           "DAPO's clip-higher uses 0.28 with --clip-range 0.2); default: --clip-range",
                                           low=0.0, low_open=True, flag="--clip-range-high")
    gspo_clip_range: float = option(3e-4, "gspo, gspo_token: the sequence ratio clipped below at 1 - this (the GSPO "
                                    "paper's 3e-4: a sequence ratio stays far closer to 1 than a token's)", low=0.0,
                                    low_open=True, flag="--gspo-clip-range")
    gspo_clip_range_high: float = option(4e-4, "gspo, gspo_token: the sequence ratio clipped above at 1 + this",
                                         low=0.0, low_open=True, flag="--gspo-clip-range-high")
    clip_range_value: float = option(0.2, "epsilon_v of value clipping; 0 = off", low=0.0)
    vf_coef: float = option(0.5, "c1: weight of the value loss", low=0.0)
    entropy_coef: float = option(0.0, "c2: entropy bonus weight", low=0.0)
    whiten_advantages: bool = option(True, "z-score GAE's advantages over the batch's valid tokens; the "
                                     "critic-free estimators do what theirs prescribes (reinforce_pp always, the "
                                     "group baselines never)")
    packing: bool | None = option(None, "pack every policy and reference forward: each distinct prompt once, followed "
                                  "by its K responses' tokens, with a block attention mask and positions restarting "
                                  "per response (no prompt copies, no padding; the same log-probs to float rounding, "
                                  "checked on the model at start-up); null (default) = on when K > 1 and the check "
                                  "passes (not under FSDP2), --no-packing = padded rows", flag="--packing")
    old_logprobs: str = option("auto", "log pi_old: 'auto' takes it from the training forward (no separate pass) when "
                               "provably equal: one epoch, one minibatch, no --async-rollout, no KL in the reward, "
                               "no value head, no rollout correction (docs/performance.md); 'forward' always runs "
                               "the separate pass", choices=("auto", "forward"), flag="--old-logprobs")
    trim_padding: bool = option(True, "train on micro-batches of similar lengths with their all-padding columns "
                                "cut (same loss and gradients, less compute)")
    early_stop: bool = option(True, "stop the epoch loop after an epoch whose mean approx KL to pi_old > "
                              "early_stop_factor x target_kl (false: every epoch runs)")
    target_kl: float = option(0.01, "approx KL to pi_old (per token) the epoch early stop is measured against "
                              "(CleanRL's target_kl; kl.target is the controller's, a KL to the reference); > 0, "
                              "the stop is turned off by --ppo-early-stop false", low=0.0, low_open=True, flag="--ppo-early-stop-kl",
                              old_flags=("--ppo-target-kl",))
    early_stop_factor: float = option(1.5, "early-stop threshold in units of ppo.target_kl", low=0.0,
                                      low_open=True)
    mask_truncated: bool = option(False, "DAPO's overlong filtering: rows cut by --max-new-tokens (no EOS) weigh "
                                  "nothing in the policy, value, entropy and KL losses (they still count in the "
                                  "scores, advantages and metrics)", flag="--mask-truncated")


@dataclass
class CriticConfig:
    kind: str = option("head", "value model: a head on the policy's last hidden state (detached) or a "
                       "separate model", choices=("head", "separate"), flag="--critic")
    model: str = option("", "backbone of a separate critic, a directory or Hub id (default: the first reward "
                        "model if it shares "
                        "the policy's tokenizer, else the policy)", flag="--critic-model")
    head: str = option("mlp", "value head architecture", choices=("linear", "mlp"))
    lora_r: int = option(0, "LoRA rank of a separate critic's backbone (frozen, in model.dtype; adapter and head "
                         "train); 0 = the whole critic trains", low=0, flag="--critic-lora-r")
    warmup_steps: int = option(0, "first K steps update the critic only", low=0,
                               flag="--critic-warmup-steps")


@dataclass
class OptimConfig:
    lr: float = option(1e-5, "actor learning rate", low=0.0, low_open=True, flag="--lr")
    critic_lr: float = option(5e-5, "critic learning rate (typically 5-10x the actor's)", low=0.0,
                              low_open=True, flag="--critic-lr")
    weight_decay: float = option(0.0, "AdamW weight decay", low=0.0, flag="--weight-decay",
                                 old_flags=("--optim-weight-decay",))
    adam_eps: float = option(1e-8, "AdamW epsilon", low=0.0, low_open=True)
    fused_adamw: bool = option(False, "torch's fused AdamW kernel (3x faster optimizer step, ~3% of a 10.7M update "
                               "on CPU; off by default: it rounds differently from the default foreach kernel, "
                               "so a run would not repeat the figures measured with it off); not under FSDP2",
                               flag="--fused-adamw")
    max_grad_norm: float = option(1.0, "gradient-norm clip per model; 0 = off", low=0.0, flag="--max-grad-norm",
                                  old_flags=("--optim-max-grad-norm",))
    warmup_steps: int = option(0, "LR warm-up in optimiser steps", low=0, flag="--warmup-steps",
                               old_flags=("--optim-warmup-steps",))
    schedule: str = option("constant", "LR schedule after warm-up", choices=("constant", "linear", "cosine"),
                           flag="--lr-scheduler", old_flags=("--optim-schedule",))


@dataclass
class EvalConfig:
    every: int | None = option(None, "evaluate every N steps and at the last; default: max(1, steps // 10) when "
                                "there are held-out prompts; 0 = never", low=0, flag="--eval-every")
    n: int = option(64, "held-out prompts per evaluation", low=1, flag="--eval-n")
    greedy: bool = option(True, "greedy decoding for evaluation (else sample at --temperature)")
    at_start: bool = option(True, "also evaluate before the first step: a step-0 row in metrics.jsonl, the "
                            "baseline the trend starts from", flag="--eval-at-start")
    samples: int | None = option(None, "held-out responses written to samples/step_K.jsonl; default: every one "
                                 "evaluated (--eval-n), which the doctor's per-problem checks read; 0 = none",
                                 low=0)
    kl_n: int = option(32, "held-out responses whose KL to the reference is computed (eval/kl_sequence, each sample's "
                       "kl): the first N, the same problems at every evaluation, the written samples among them; "
                       "a policy and a reference forward over each; 0 = all", low=0, flag="--eval-kl-n")
    keep_best: bool = option(False, "after each evaluation that beats every earlier one (strictly higher held-out "
                             "gold accuracy, else held-out reward; a tie keeps the earlier), write its checkpoint and "
                             "the policy as a plain model to RUN_DIR/best (never rotated; best.json says which step); "
                             "docs/reliability.md", flag="--keep-best")


@accepts_trl_keys  # TRL's flat names (learning_rate=...) accepted; other unknown keywords get a hint
@dataclass
class RunConfig:
    """Everything `tether ppo` needs. ``validate`` holds the cross-field checks."""

    output_dir: str = option("runs/ppo", "run directory: config, metrics, samples, checkpoints, policy",
                             flag="--output-dir")
    steps: int = option(20, "total PPO steps of the run (--resume continues up to this)", low=1, flag="--steps")
    batch_size: int = option(16, "prompts per PPO step, per process (each sampled --samples-per-prompt times)",
                             low=1, flag="--batch-size")
    samples_per_prompt: int = option(1, "K: responses sampled per prompt, a group kept together through "
                                     "minibatching and on one process (the group baselines need K >= 2)", low=1,
                                     flag="--samples-per-prompt")
    seed: int = option(0, "random seed", flag="--seed")
    save_every: int = option(0, "also checkpoint every N steps; 0 = by time only (--save-every-minutes)", low=0,
                             flag="--save-every")
    save_every_minutes: float = option(10.0, "checkpoint after a step when this many minutes have passed since "
                                       "the last checkpoint (a crash loses at most about this much); 0 = off",
                                       low=0.0, flag="--save-every-minutes")
    keep_checkpoints: int = option(2, "newest checkpoints kept", low=1)
    log_with: list[str] = option([], "experiment trackers through accelerate (tensorboard, wandb, mlflow, comet_ml, "
                                 "aim, clearml, dvclive, swanlab, trackio, all); repeatable or a comma list",
                                 flag="--log-with", repeat=True)
    tracker_project: str = option("tether", "project name for the trackers (TensorBoard writes RUN_DIR/PROJECT/)")
    tensorboard: bool = option(False, "the same as --log-with tensorboard (kept for older configs)")
    progress: bool = option(True, "show a progress bar")
    collective_timeout_minutes: float = option(60.0, "how long a process waits in a collective for the others "
                                               "(several processes) before the run fails: process 0 alone writes "
                                               "checkpoints and the final policy while the others wait; torch's "
                                               "default is 10 (NCCL) or 30 (gloo)", low=0.0, low_open=True)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    gae: GAEConfig = field(default_factory=GAEConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    difficulty: DifficultyConfig = field(default_factory=DifficultyConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def validate(self) -> None:
        check_fields(self)  # every field's type, choices and bounds, named by key and flag (kl.coef (--kl-coef))
        self.health.validate()
        if not self.model.policy:
            raise ConfigError("--policy: required (a model directory or preset)")
        if not self.data.prompts:
            raise ConfigError("--prompts: required (a prompt file)")
        if not self.reward.sources:
            raise ConfigError("--reward: at least one reward source is required")
        if "{prompt}" not in self.data.prompt_template:
            raise ConfigError(f"--prompt-template: {self.data.prompt_template!r} does not contain {{prompt}}")
        if self.model.export_lora == "adapter" and not self.model.lora_r:
            raise ConfigError("--export-lora adapter: needs --lora-r > 0 (a full fine-tune has no adapter)")
        if self.critic.lora_r and self.critic.kind != "separate":
            raise ConfigError("--critic-lora-r: needs --critic separate (a value head has no backbone of its own)")
        # Truncated sampling is refused, not scored as truncated: see docs/sampling.md for why.
        if self.generation.top_p < 1.0:
            raise ConfigError(f"--top-p: {self.generation.top_p} refused; PPO's log-probs, ratio and KL are of the "
                              "untruncated softmax(logits / T), so samples must be too (docs/sampling.md)")
        if self.generation.top_k > 0:
            raise ConfigError(f"--top-k: {self.generation.top_k} refused; PPO's log-probs, ratio and KL are of the "
                              "untruncated softmax(logits / T), so samples must be too (docs/sampling.md)")
        if self.generation.engine_tp > 1 and self.generation.engine != "vllm":
            raise ConfigError(f"--engine-tp {self.generation.engine_tp}: tensor parallelism is vLLM's; "
                              "use --engine vllm")
        if self.generation.engine_tp > 1 and self.generation.rollout_processes:
            raise ConfigError("--engine-tp with --rollout-processes: not supported (each rollout process runs one "
                              "engine of its own); use --engine-tp 1")
        if self.generation.async_rollout and not self.generation.rollout_processes:
            raise ConfigError(f"--async-rollout {self.generation.async_rollout}: needs rollout processes to sample "
                              "while the trainers train (--rollout-processes R, the disaggregated layout)")
        if self.batch_size % self.ppo.mini_batches:
            raise ConfigError(f"--mini-batches: {self.ppo.mini_batches} does not divide --batch-size "
                              f"{self.batch_size}")
        if self.reward.overlong_buffer > self.generation.max_new_tokens:
            raise ConfigError(f"--overlong-buffer: {self.reward.overlong_buffer} tokens, more than --max-new-tokens "
                              f"{self.generation.max_new_tokens} (the buffer is the last tokens of that budget)")
        if self.minibatch_size % self.ppo.grad_accumulation:
            raise ConfigError(f"--grad-accumulation: {self.ppo.grad_accumulation} does not divide the "
                              f"minibatch of {self.minibatch_size} rows")
        self.validate_advantage()
        check_policy_loss(self)
        check_defaults_apply(self)

    def warnings(self) -> list[str]:
        """Settings legal but doing nothing in this run, one line each (:func:`tether.ppo.checks.run_warnings`)."""
        return run_warnings(self)

    @property
    def eval_every(self) -> int:
        """Evaluate every N steps: ``eval.every``, or by default max(1, steps // 10) with held-out prompts."""
        return eval_every(self)

    def validate_advantage(self) -> None:
        estimator = self.advantage.estimator
        if estimator in GROUP_BASELINES and self.samples_per_prompt < 2:
            raise ConfigError(f"--advantage {estimator}: needs --samples-per-prompt of at least 2 (its baseline "
                              f"is the other samples of the same prompt), got {self.samples_per_prompt}")
        if 0 < self.difficulty.oversample < 1:
            raise ConfigError(f"difficulty.oversample (--filter-oversample): 0 (sized from the run) or at least 1, "
                              f"got {self.difficulty.oversample:g}")
        if self.difficulty.filter_groups and self.generation.async_rollout:
            raise ConfigError("--filter-groups with --async-rollout 1: the extra rounds would sample after the batch in "
                              "flight was sent, from weights one update newer; use one or the other")
        if self.difficulty.filter_groups and self.samples_per_prompt < 2:
            raise ConfigError("--filter-groups: needs --samples-per-prompt of at least 2 (a group's spread is over its "
                              f"samples), got {self.samples_per_prompt}")
        if self.advantage.critic_free and self.critic.warmup_steps:
            raise ConfigError(f"--critic-warmup-steps: {self.critic.warmup_steps}, but --advantage {estimator} "
                              "has no critic to warm up")

    @property
    def rows_per_step(self) -> int:
        """Responses sampled per step and process: prompts × samples per prompt."""
        return self.batch_size * self.samples_per_prompt

    @property
    def minibatch_size(self) -> int:
        """Rows per minibatch: whole groups, since --mini-batches divides the prompts."""
        return self.rows_per_step // self.ppo.mini_batches
