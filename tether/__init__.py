"""tether: classic RLHF — Bradley–Terry reward models and PPO with a per-token KL tether.

``import tether`` is light: it loads the math (torch only). ``RewardModel``, the trainers
(``SFTTrainer``, ``RewardTrainer``, ``PPOTrainer``), their configs and callbacks are resolved lazily on first access.
"""

from tether.core.advantages import gae, masked_mean, shaped_rewards, whiten
from tether.core.kl import AdaptiveKLController, FixedKLController, ProportionalKLController, kl_penalty
from tether.core.losses import bradley_terry_loss, ppo_policy_loss, ppo_value_loss
from tether.core.stats import entropy_from_logits, explained_variance, logprobs_from_logits, wilson_interval

__version__ = "0.1.0"

_LAZY = {
    "RewardModel": "tether.rm.model",
    "RewardEnsemble": "tether.rm.model",
    "ProcessRewardModel": "tether.rm.process",
    "RewardTrainer": "tether.rm.train",
    "RewardTrainingConfig": "tether.rm.config",
    "PPOTrainer": "tether.ppo.train",
    "SFTTrainer": "tether.sft.train",
    "SFTConfig": "tether.sft.config",
    "RunConfig": "tether.ppo.config",
    "Callback": "tether.callbacks",
    "StopTraining": "tether.callbacks",
    "StepRecord": "tether.callbacks",
    "TrainResult": "tether.callbacks",
}

__all__ = [
    "bradley_terry_loss", "kl_penalty", "shaped_rewards", "gae", "whiten", "ppo_policy_loss",
    "ppo_value_loss", "masked_mean", "entropy_from_logits", "explained_variance", "logprobs_from_logits",
    "wilson_interval", "FixedKLController", "AdaptiveKLController", "ProportionalKLController",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy ones (IPython's and Jupyter's tab completion offer what ``dir()`` lists),
    without importing them."""
    return sorted({*globals(), *_LAZY})
