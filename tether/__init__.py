"""tether: classic RLHF — Bradley–Terry reward models and PPO with a per-token KL tether.

``import tether`` is light: it loads the math (torch only). ``RewardModel``, the trainers
(``SFTTrainer``, ``RewardTrainer``, ``DPOTrainer``, ``PPOTrainer``), their configs and callbacks, ``diagnose`` and
``report`` are resolved lazily on first access. TRL's names for the configs are there too: ``PPOConfig`` is ``RunConfig`` (the PPO
run's config; ``tether.ppo.config.PPOConfig`` is its ``ppo`` section), ``RewardConfig`` is ``RewardTrainingConfig``
(``tether.ppo.config.RewardConfig`` is a PPO run's ``reward`` section), ``SFTConfig`` and ``DPOConfig`` the same names.
"""

from tether.core.advantages import gae, masked_mean, shaped_rewards, whiten
from tether.core.kl import AdaptiveKLController, FixedKLController, ProportionalKLController, kl_penalty
from tether.core.losses import (bradley_terry_loss, cispo_policy_loss, gspo_policy_loss, ppo_policy_loss,
                                 ppo_value_loss)
from tether.core.stats import entropy_from_logits, explained_variance, logprobs_from_logits, wilson_interval

__version__ = "0.1.0"

_LAZY = {
    "RewardModel": "tether.rm.model",
    "RewardEnsemble": "tether.rm.model",
    "ProcessRewardModel": "tether.rm.process",
    "RewardTrainer": "tether.rm.trainer",
    "RewardTrainingConfig": "tether.rm.config",
    "PPOTrainer": "tether.ppo.train",
    "SFTTrainer": "tether.sft.train",
    "SFTConfig": "tether.sft.config",
    "DPOTrainer": "tether.dpo.train",
    "DPOConfig": "tether.dpo.config",
    "RunConfig": "tether.ppo.config",
    "PPOConfig": "tether.ppo.config:RunConfig",            # TRL's name of the run's config
    "RewardConfig": "tether.rm.config:RewardTrainingConfig",  # TRL's name of the reward trainer's config
    "RLHFPipeline": "tether.pipeline.run",
    "RLHFConfig": "tether.pipeline.config",
    "diagnose": "tether.diagnostics.doctor:diagnose_run",   # tether.diagnose(run_dir): what `tether doctor` reads
    "Callback": "tether.callbacks",
    "StopTraining": "tether.callbacks",
    "StepRecord": "tether.callbacks",
    "TrainResult": "tether.callbacks",
}

__all__ = [
    "bradley_terry_loss", "kl_penalty", "shaped_rewards", "gae", "whiten", "ppo_policy_loss",
    "gspo_policy_loss", "cispo_policy_loss",
    "ppo_value_loss", "masked_mean", "entropy_from_logits", "explained_variance", "logprobs_from_logits",
    "wilson_interval", "FixedKLController", "AdaptiveKLController", "ProportionalKLController",
    "report", *_LAZY,
]


def report(run_dirs, output=None, title=None):
    """Write the HTML report of one run directory (or a list of them, compared) and return its path: what
    ``tether report`` writes; ``output`` defaults to ``report.html`` in the first run directory."""
    from pathlib import Path

    from tether.diagnostics.report import write_report

    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    return write_report(run_dirs, output or Path(run_dirs[0]) / "report.html", title=title)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, _, attribute = _LAZY[name].partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy ones (IPython's and Jupyter's tab completion offer what ``dir()`` lists),
    without importing them."""
    return sorted({*globals(), *_LAZY})
