"""What a Python caller hands :class:`tether.PPOTrainer` in memory — rewards as callables or model objects,
prompt datasets — and the stable names the run's ``config.yaml`` records for them.

Names. A plain function defined at the top level of an importable module is recorded as ``module:function``,
the spec the command line takes, so the run can be resumed from anywhere. Anything else — a lambda, a closure,
a callable object, a function of the script being run, a ``RewardModel`` — is recorded as ``python:NAME``
(NAME: the key it was given under in a dict, else its ``__name__`` or class name, made unique); a run with
such a reward is resumed from Python with the same name given again, and ``--resume`` from the command line
refuses it in one line (:func:`tether.ppo.sources.check_given`). Prompts given as data are recorded as
``python:prompts`` with their row count and a digest of their content, so a resume with other prompts is
refused like any other changed setting.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from dataclasses import dataclass, field

from tether.errors import ConfigError, TetherError
from tether.ppo.sources import PYTHON, check_given, reward_kind


@dataclass
class GivenInputs:
    """The run's inputs given as objects: ``rewards`` by their spec in ``reward.sources``, prompt rows."""

    rewards: dict[str, object] = field(default_factory=dict)
    prompts: list[dict] | None = None       # in place of data.prompts
    eval_prompts: list[dict] | None = None  # in place of data.eval_prompts
    gold: object | None = None  # the eval/accuracy rule, when reward.gold is a python: name


def importable_spec(fn) -> str | None:
    """``module:function`` when ``fn`` is that module's top-level function of that name, else None. The shortest
    package on the module's path that exports the same object names it (``tether.rules:char_share``, not
    ``tether.rules.library:char_share``): the public spec stays valid when a package moves its insides."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not name.isidentifier():
        return None
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        try:
            found = getattr(importlib.import_module(prefix), name, None)
        except ImportError:
            continue
        if found is fn:
            return f"{prefix}:{name}"
    return None


def object_name(obj) -> str:
    """NAME of ``python:NAME`` for an object with no importable spec: its ``__name__`` (a lambda: ``lambda``) or
    its class name, without ':'."""
    return getattr(obj, "__name__", type(obj).__name__).replace("<lambda>", "lambda").replace(":", "_")


def reward_specs(reward) -> dict[str, object]:
    """``{spec: object}`` in order (a string source maps to itself) for ``reward``: one source, a dict
    ``{name: object}``, or a list of these (specs and objects mixed). A ``python:NAME`` spec already there as a
    string (a saved config's) is filled by the object given under NAME."""
    items = []
    for r in reward if isinstance(reward, (list, tuple)) else [reward]:
        items += list(r.items()) if isinstance(r, dict) else [(None, r)]
    out: dict[str, object] = {}
    for name, obj in items:
        obj = str(obj) if isinstance(obj, os.PathLike) else obj  # a directory
        if isinstance(obj, str):
            out[obj] = obj
            continue
        if name is not None and (not isinstance(name, str) or not name or ":" in name):
            raise ConfigError(f"--reward: the name {name!r} of a Python reward must be text without ':'")
        spec = PYTHON + name if name is not None else importable_spec(obj)
        if spec is None:
            base = object_name(obj)
            spec, n = PYTHON + base, 2
            while spec in out and not isinstance(out[spec], str):
                spec, n = f"{PYTHON}{base}_{n}", n + 1
        reward_kind(obj, spec)  # not a reward: one line now, before anything loads
        out[spec] = obj
    return out


def data_name(rows: list[dict], what: str) -> str:
    """``python:WHAT (N rows, sha256 …)``: what config.yaml records for rows given from Python."""
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{PYTHON}{what} ({len(rows)} rows, sha256 {digest})"


def detached(cfg):
    """A copy of the RunConfig ``cfg`` that the trainer may complete: nested sections copied, the reward sources
    list copied but not the objects in it (a reward model is not duplicated)."""
    import copy

    sources = cfg.reward.sources
    cfg.reward.sources = []
    try:
        out = copy.deepcopy(cfg)
    finally:
        cfg.reward.sources = sources
    out.reward.sources = list(sources) if isinstance(sources, (list, tuple)) else sources
    return out


def resolve_inputs(cfg, reward=None, prompts=None, eval_prompts=None, gold=None) -> GivenInputs:
    """Record in ``cfg`` (a RunConfig, before its checks) the names of what is given as objects — rewards in
    ``reward`` or as objects in ``cfg.reward.sources``, prompt data, the gold rule ``gold`` (a spec, or a callable
    named as a reward is) — and return the objects. A ``python:`` name already in the config (a resumed run's)
    is filled by the object given under it."""
    from tether.ppo.prompts import prompts_from_data

    current = cfg.reward.sources
    current = current.split(",") if isinstance(current, str) else list(current) if isinstance(current, (list, tuple)) \
        else [current]  # one object set from Python
    specs = reward_specs(current + ([] if reward is None else list(reward) if isinstance(reward, (list, tuple))
                                    else [reward]))
    cfg.reward.sources = list(specs)
    out = GivenInputs(rewards={spec: obj for spec, obj in specs.items() if not isinstance(obj, str)})
    if prompts is not None:
        out.prompts = prompts_from_data(prompts, "prompts")
        cfg.data.prompts = data_name(out.prompts, "prompts")
    if eval_prompts is not None:
        out.eval_prompts = prompts_from_data(eval_prompts, "eval_prompts")
        cfg.data.eval_prompts = data_name(out.eval_prompts, "eval_prompts")
    if gold is not None and not isinstance(gold, str):
        if not callable(gold):
            raise ConfigError(f"gold: a rule spec or a callable f(prompts, responses, **columns), got "
                              f"{type(gold).__name__}")
        spec = importable_spec(gold) or PYTHON + object_name(gold)
        out.gold = gold if spec.startswith(PYTHON) else None
        cfg.reward.gold = spec
    elif gold is not None:
        cfg.reward.gold = gold
    if cfg.reward.gold.startswith(PYTHON) and out.gold is None:
        raise TetherError(f"--gold {cfg.reward.gold}: this run's gold rule was a Python function; resume it from "
                          f"Python, giving it again: tether.PPOTrainer(config, ..., gold=..., resume=True)")
    check_given(cfg.reward.sources, out.rewards)
    for key, value, data in (("--prompts", cfg.data.prompts, out.prompts),
                             ("--eval-prompts", cfg.data.eval_prompts, out.eval_prompts)):
        if value.startswith(PYTHON) and data is None:
            raise TetherError(f"{key} {value}: this run's prompts were given from Python; resume it from Python, "
                              f"giving them again: tether.PPOTrainer(config, ..., prompts=..., resume=True)")
    return out
