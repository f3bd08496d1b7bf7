"""``tether rlhf``'s config: the policy, the task, the budget and which arms run; defaults <- YAML (--config) <- flags.

The stages' own settings are their commands' configs (``tether sample``, ``train-rm``, ``ppo``, ``sft``). The
pipeline sets recipe 5's values on them (docs/real-models.md: the settings measured on SmolLM2-135M), then applies
the YAML file a ``*.config`` key names (the stage command's own keys), then its wiring: the paths between the
stages, the seed, the budget (``ppo.steps``, ``pairs.*``) and each arm's β — so a stage YAML tunes a stage and
cannot unplug it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.config import check_fields, option
from tether.errors import ConfigError


@dataclass
class PipelineModel:
    policy: str = option("", "the starting policy: a local causal-LM directory, a preset name or a Hub id",
                         flag="--policy")
    reward_model: str = option("", "the reward model's backbone ('' = the policy after SFT, as InstructGPT's)",
                               flag="--rm-backbone")
    dtype: str = option("fp32", "compute dtype of every stage (fp32, bf16, fp16)", choices=("fp32", "bf16", "fp16"),
                        flag="--dtype")
    lora_r: int = option(0, "LoRA rank of SFT, the reward model and PPO; 0 = full fine-tune", low=0, flag="--lora-r")
    lora_alpha: int = option(32, "LoRA alpha", low=1, flag="--lora-alpha")


@dataclass
class PipelineTask:
    prompts: str = option("", "the task: rg:DATASET[:key=value,...] (reasoning-gym, its own verifier) or a prompt "
                          "file (tether ppo's shapes) with --gold", flag="--task")
    gold: str = option("auto", "the gold rule module:function[:k=v] that labels the pairs and judges every arm; "
                       "'auto' = an rg: task's own check (required for a prompt file)", flag="--gold")
    eval_prompts: str = option("", "held-out prompt file for a prompt-file task ('' = the last --eval-n rows of "
                               "--task after a seeded shuffle)", flag="--eval-prompts")
    task_train: int = option(2000, "rg: tasks: training problems", low=1, flag="--task-train")
    task_seed: int = option(0, "the task split's seed (the same held-out problems for every run seed)",
                            flag="--task-seed")
    twins_apart: bool = option(False, "drop the training problems that have a twin among the held-out ones (the "
                               "same words in another order, the same answer: tether/pipeline/twins.py)",
                               flag="--twins-apart")
    chat_template: str = option("auto", "wrap prompts in the tokenizer's chat template",
                                choices=("auto", "on", "off"))
    system_prompt: str = option("", "system turn of the chat template, for every stage", flag="--system-prompt")
    max_new_tokens: int = option(64, "reply length cap of sampling, PPO and evaluation", low=1,
                                 flag="--max-new-tokens")
    temperature: float = option(0.7, "sampling temperature of the pairs and of PPO's rollouts", low=0.0,
                                low_open=True, flag="--temperature")


@dataclass
class PipelineSFT:
    data: str = option("", "SFT rows (tether sft's shapes); '' = no SFT stage", flag="--sft-data")
    steps: int = option(0, "SFT optimiser steps (0 = one epoch)", low=0, flag="--sft-steps")
    config: str = option("", "YAML of tether sft keys applied to the SFT stage", flag="--sft-config")


@dataclass
class PipelinePairs:
    samples_per_prompt: int = option(16, "replies sampled per training problem (pairs: right ≻ wrong by the gold "
                                     "rule)", low=2, flag="--pair-samples")
    prompts: int = option(0, "training problems sampled for pairs (0 = all)", low=0, flag="--pair-prompts")
    max_pairs: int = option(0, "the pair budget: at most this many pairs a round (0 = all)", low=0, flag="--pairs")
    max_per_prompt: int = option(12, "at most this many pairs a problem", low=0, flag="--pairs-per-prompt")
    length_gap: int = option(2, "length-matched pairs: replies differing by at most this many characters (0 = any)",
                             low=0, flag="--pair-length-gap")
    batch_size: int = option(4, "prompts per generate call while sampling", low=1, flag="--pair-batch-size")
    config: str = option("", "YAML of tether sample keys applied to every pairs stage", flag="--sample-config")


@dataclass
class PipelineRM:
    epochs: int = option(3, "passes over the pairs", low=1, flag="--rm-epochs")
    lr: float = option(2e-4, "the reward model's learning rate", low=0.0, low_open=True, flag="--rm-lr")
    batch_size: int = option(16, "pairs per step", low=1, flag="--rm-batch-size")
    eval_fraction: float = option(0.1, "pairs held out by problem for its verdict", low=0.0, high=0.9,
                                  flag="--rm-eval-fraction")
    config: str = option("", "YAML of tether train-rm keys applied to every reward-model stage", flag="--rm-config")


@dataclass
class PipelinePPO:
    steps: int = option(10, "PPO steps of each arm in each round", low=1, flag="--steps")
    kl_coef: float = option(0.04, "β of the tethered arm (k3 in the loss, recipe 5's)", low=0.0, low_open=True,
                            flag="--kl-coef")
    beta0: bool = option(True, "also run the arm with β = 0 (what the tether prevents)", flag="--beta0")
    beta0_steps: int = option(0, "PPO steps of the β = 0 arm (0 = --steps): its over-optimisation shows later than "
                              "the tethered arm's peak", low=0, flag="--beta0-steps")
    control: bool = option(False, "also run the control arm: β as the tethered arm, each batch's reward-model "
                           "scores shuffled across its rows (a reward that says nothing)", flag="--control")
    batch_size: int = option(8, "prompts per PPO step", low=1, flag="--batch-size")
    samples_per_prompt: int = option(8, "replies per prompt per step (GRPO's group)", low=1,
                                     flag="--samples-per-prompt")
    lr: float = option(1e-4, "the policy's learning rate", low=0.0, low_open=True, flag="--lr")
    eval_every: int = option(10, "held-out gold evaluation every N steps (and at step 0)", low=1,
                             flag="--eval-every")
    eval_n: int = option(200, "held-out problems (rg: tasks: the task's held-out split)", low=1, flag="--eval-n")
    save_every: int = option(0, "PPO checkpoint every N steps (0 = every 10 minutes), for resuming inside an arm",
                             low=0, flag="--save-every")
    config: str = option("", "YAML of tether ppo keys applied to every PPO arm", flag="--ppo-config")


@dataclass
class PipelineRefresh:
    rounds: int = option(0, "refresh rounds: sample the tethered arm's policy, retrain the reward model on old + "
                         "new pairs, PPO again from the current policy", low=0, flag="--refresh-rounds")
    beta0: bool = option(False, "refresh rounds continue the β = 0 arm too (from its own policy, against the "
                         "refreshed reward model)", flag="--refresh-beta0")


@dataclass
class PipelineDPO:
    run: bool = option(False, "a DPO arm on the first round's pairs from the same start policy (needs tether dpo)",
                       flag="--dpo")
    config: str = option("", "YAML of tether dpo keys applied to the DPO arm", flag="--dpo-config")


@dataclass
class RLHFConfig:
    """``tether rlhf``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    output_dir: str = option("runs/rlhf", "where every stage writes its folder, the report and results.json",
                             flag="--output-dir")
    seed: int = option(0, "seed of sampling, training and PPO", flag="--seed")
    engine: str = option("transformers", "rollout engine of sampling and PPO", choices=("transformers", "vllm"),
                         flag="--engine")
    parallel_arms: bool = option(False, "run a round's PPO arms side by side, one process each (cores permitting; "
                                 "the same numbers)", flag="--parallel-arms")
    estimate: bool = option(True, "time the stages' sampler and one packed update before starting, for the "
                            "expected time", flag="--estimate")
    progress: bool = option(True, "each stage's per-step progress on stderr: a bar on a terminal, one line a step in "
                            "a log (false: the stage lines and evaluations only)")
    model: PipelineModel = field(default_factory=PipelineModel)
    task: PipelineTask = field(default_factory=PipelineTask)
    sft: PipelineSFT = field(default_factory=PipelineSFT)
    pairs: PipelinePairs = field(default_factory=PipelinePairs)
    rm: PipelineRM = field(default_factory=PipelineRM)
    ppo: PipelinePPO = field(default_factory=PipelinePPO)
    refresh: PipelineRefresh = field(default_factory=PipelineRefresh)
    dpo: PipelineDPO = field(default_factory=PipelineDPO)

    def validate(self) -> None:
        check_fields(self)
        if not self.model.policy:
            raise ConfigError("--policy: required (a causal-LM directory, preset or Hub id)")
        if not self.task.prompts:
            raise ConfigError("--task: required (rg:DATASET[:key=value,...] or a prompt file with --gold)")
        if not self.task.prompts.startswith("rg:") and self.task.gold == "auto":
            raise ConfigError(f"--gold: required with a prompt file ({self.task.prompts}): the rule module:function "
                              "that labels the pairs and judges the arms")
