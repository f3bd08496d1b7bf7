"""``RewardTrainer``: stage A from Python and the code path of ``tether train-rm``, over the two trainings —
pairwise (:mod:`tether.rm.train`) and process reward models (:mod:`tether.rm.train_process`, which reuses the
former's loading, optimisation and saving). Its own module so that both are imported from above, not one from the
other (the import circle train <-> train_process).
"""

from __future__ import annotations

from pathlib import Path

from tether.callbacks import Callbacks, TrainResult
from tether.config import check_config
from tether.rm.config import RewardTrainingConfig
from tether.rm.train import given_data, train_reward_model
from tether.rm.train_process import train_process_reward_model


class RewardTrainer:
    """Stage A from Python, the code path of ``tether train-rm`` too: ``RewardTrainer(config, pairs).train()``.

    ``config``: a :class:`RewardTrainingConfig`, a dict of its keys (nested or dotted) or a YAML path, checked
    as the command line checks its flags (a bad value is the same one-line ConfigError); ``pairs``: data in
    memory in place of ``data.files`` (a ``datasets.Dataset`` or a list of rows in any shape the files may
    have, :class:`~tether.inputs.pairs.PreferencePair` s; with ``process``, :class:`~tether.rm.steps.StepExample` s);
    ``callbacks``: :mod:`tether.callbacks`; ``resume``: continue the unfinished training in ``output_dir``. A
    file's path is taken for ``pairs``, TRL's names too (:func:`tether.trl_compat.arguments.reward_arguments`: ``args``,
    ``model`` as a name or path, ``train_dataset``); with no config, the defaults."""

    def __init__(self, config=None, pairs=None, callbacks=(), resume: bool = False, *, args=None, model=None,
                 train_dataset=None, eval_dataset=None):
        from tether.trl_compat.arguments import reward_arguments

        cfg, pairs = reward_arguments(RewardTrainingConfig, config, args, model, pairs, train_dataset, eval_dataset)
        self.cfg = check_config(given_data(cfg, pairs))
        self.pairs, self.callbacks, self.resume = pairs, Callbacks(callbacks), resume

    def train(self) -> TrainResult:
        """Train, evaluate on the held-out pairs and save; the result's ``model`` is the reward model."""
        if self.cfg.process:
            rm = train_process_reward_model(self.cfg, self.pairs, self.callbacks, self.resume)
        else:
            rm = train_reward_model(self.cfg, self.pairs, self.callbacks, self.resume)
        out, run = Path(self.cfg.output_dir), rm.metadata["run"]
        return TrainResult(run_dir=out, metrics=rm.metadata["evaluation"], models={"reward_model": out},
                           steps=run["steps"], stopped=run.get("stopped"), model=rm)
