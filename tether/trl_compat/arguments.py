"""TRL's trainer arguments in tether's terms: ``args=`` for the config, ``model=`` as a name or path,
``train_dataset=``/``eval_dataset=``, ``reward_funcs=``, ``processing_class=``; and a dataset given as a path string
(``prompts="prompts.jsonl"``) set as the config's file key, as the command line sets it (the run then resumes from
the command line too). One function per trainer, called first thing by its constructor.
"""

from __future__ import annotations

import os
import typing

from tether.errors import ConfigError
from tether.trl_compat.keys import set_dotted


def is_path(data) -> bool:
    """A dataset named by a path (or an ``hf:`` name) rather than handed over as rows."""
    return isinstance(data, (str, os.PathLike))


def one_of(where: str, **given):
    """The one of ``given`` (TRL's name and tether's for the same argument) that is not None; both is an error."""
    present = {k: v for k, v in given.items() if v is not None}
    if len(present) > 1:
        raise ConfigError(f"{where}: {' and '.join(present)} name the same thing; give one")
    return next(iter(present.values()), None)


def model_argument(cfg, key: str, model):
    """TRL's ``model=`` as a name or path sets the config's model key (``model.policy``, ``model.path``, ``model``);
    returns the model object when one was given instead (None otherwise)."""
    if model is None or not is_path(model):
        return model
    set_dotted(cfg, key, os.fspath(model))
    return None


def data_argument(cfg, key: str, data):
    """A dataset given as a path (or a list of paths) sets the config's file key, as the flag would — the run is
    then resumable from the command line; rows or a ``datasets.Dataset`` are returned to be handed over as data."""
    paths = data if isinstance(data, (list, tuple)) and data and all(is_path(d) for d in data) else None
    if is_path(data) or paths:
        value = [os.fspath(p) for p in (paths or [data])]
        hints = typing.get_type_hints(type(_owner(cfg, key)))
        set_dotted(cfg, key, value if typing.get_origin(hints[key.rsplit(".", 1)[-1]]) is list else value[0])
        return None
    return data


def _owner(cfg, key: str):
    obj = cfg
    for part in key.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


TRL_OUTPUT_DIR = "trainer_output"  # TRL's default output_dir, used from Python when none is set


def _config(cls, config, args, where: str, copy=None):
    """A copy of the config of a trainer called either way — ``config`` or TRL's ``args=`` (one of them), else the
    defaults — with TRL's default output directory when none is set. ``copy``: how to copy it (deep by default)."""
    import copy as copying

    from tether.config import as_config

    config = one_of(where, config=config, args=args)
    cfg = (copy or copying.deepcopy)(as_config(cls, cls() if config is None else config, check=False))
    if not cfg.output_dir:
        cfg.output_dir = TRL_OUTPUT_DIR
    return cfg


def ppo_arguments(config_cls, detached, config, args, model, reward, reward_funcs, prompts, train_dataset,
                  eval_prompts, eval_dataset):
    """``(config, reward, prompts, eval_prompts)`` of ``PPOTrainer`` called with tether's or TRL's (GRPOTrainer's)
    argument names; datasets given as paths go into ``data.prompts``/``data.eval_prompts``. The stage passes its
    config class and its copy (``detached``) in, so that this shared module imports no stage."""
    cfg = _config(config_cls, config, args, "PPOTrainer", detached)  # reward objects in it are not duplicated
    if model_argument(cfg, "model.policy", model) is not None:
        raise ConfigError("PPOTrainer(model=...): give the policy as a directory, preset or Hub id; a model object is "
                          "not taken (the reference and the rollout engine load their own copies from it)")
    prompts = data_argument(cfg, "data.prompts", one_of("PPOTrainer", prompts=prompts, train_dataset=train_dataset))
    eval_prompts = data_argument(cfg, "data.eval_prompts",
                                 one_of("PPOTrainer", eval_prompts=eval_prompts, eval_dataset=eval_dataset))
    return cfg, one_of("PPOTrainer", reward=reward, reward_funcs=reward_funcs), prompts, eval_prompts


def sft_arguments(config_cls, config, args, model, tokenizer, processing_class, train_data, train_dataset, eval_data,
                  eval_dataset, eval_prompts=None):
    """``(config, model, tokenizer, train_data, eval_data, eval_prompts)`` of ``SFTTrainer`` called with tether's or
    TRL's argument names: ``model`` a name or path (``model.path``) or an object, whose tokenizer is loaded from where
    it was loaded (``model.name_or_path``) when none is given, as TRL does; datasets given as paths go into
    ``data.files``/``data.eval_files``/``eval.prompts``."""
    cfg = _config(config_cls, config, args, "SFTTrainer")
    model = model_argument(cfg, "model.path", model)
    tokenizer = one_of("SFTTrainer", tokenizer=tokenizer, processing_class=processing_class)
    if model is not None and tokenizer is None and getattr(model, "name_or_path", ""):
        from tether.hf import load_tokenizer
        from tether.presets import resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(model.name_or_path, what="tokenizer of model="))
    train = data_argument(cfg, "data.files", one_of("SFTTrainer", train_data=train_data, train_dataset=train_dataset))
    held_out = data_argument(cfg, "data.eval_files", one_of("SFTTrainer", eval_data=eval_data,
                                                            eval_dataset=eval_dataset))
    return cfg, model, tokenizer, train, held_out, data_argument(cfg, "eval.prompts", eval_prompts)


def reward_arguments(config_cls, config, args, model, pairs, train_dataset, eval_dataset):
    """``(config, pairs)`` of ``RewardTrainer`` called with tether's or TRL's argument names."""
    cfg = _config(config_cls, config, args, "RewardTrainer")
    if model_argument(cfg, "model", model) is not None:
        raise ConfigError("RewardTrainer(model=...): give the backbone as a directory, preset or Hub id; tether "
                          "loads it with a one-output head itself")
    if eval_dataset is not None:
        raise ConfigError("RewardTrainer(eval_dataset=...): tether holds out data.eval_fraction of the pairs itself, "
                          "by prompt (no prompt on both sides); give every pair as train_dataset")
    return cfg, data_argument(cfg, "data.files", one_of("RewardTrainer", pairs=pairs, train_dataset=train_dataset))


def dpo_arguments(config_cls, config, args, model, ref_model, pairs, train_dataset, eval_dataset):
    """``(config, pairs)`` of ``DPOTrainer`` called with tether's or TRL's argument names."""
    cfg = _config(config_cls, config, args, "DPOTrainer")
    if model_argument(cfg, "model.path", model) is not None:
        raise ConfigError("DPOTrainer(model=...): give the policy as a directory, preset or Hub id; tether loads it "
                          "(and its reference) itself")
    if ref_model is not None:
        raise ConfigError("DPOTrainer(ref_model=...): the reference is the starting policy (its log-probs computed "
                          "once, or the LoRA adapter turned off); leave ref_model out")
    if eval_dataset is not None:
        raise ConfigError("DPOTrainer(eval_dataset=...): tether holds out data.eval_fraction of the pairs itself, "
                          "by prompt (no prompt on both sides); give every pair as train_dataset")
    return cfg, data_argument(cfg, "data.files", one_of("DPOTrainer", pairs=pairs, train_dataset=train_dataset))
