"""Dataclass configs loadable from YAML and overridable from the command line.

Each stage has one dataclass config, nested by concern (``kl``, ``gae``, ``generation``, ``optim``).
Fields are declared with :func:`option`, which documents the field once and carries its validation
(choices, bounds) and its command-line flag. The same checks run on YAML values and on flags, so every
bad value gets the same one-line error naming the key or the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tether.errors import ConfigError

_MISSING = dataclasses.MISSING

# One answer-length cap for every stage that generates (PPO's rollouts, SFT's gold evaluation, tether sample):
# 256 tokens hold a worked GSM8K answer, where a cut reply earns 0 from the math rules.
MAX_NEW_TOKENS = 256


def option(default: Any = _MISSING, help: str = "", *, choices: tuple | None = None,
           low: float | None = None, high: float | None = None, low_open: bool = False,
           flag: str | None = None, repeat: bool = False, default_factory: Any = _MISSING,
           aliases: tuple[str, ...] = (), value_aliases: dict | None = None, old_flags: tuple[str, ...] = ()):
    """A documented config field. ``low``/``high`` bound numbers (``low_open``: strictly above ``low``);
    ``flag`` is its command-line flag (``None``: ``--`` + the dotted key with ``.``/``_`` as ``-``);
    ``repeat`` makes a list field take one value per use of the flag. ``aliases``: older names of the
    key, still accepted in YAML (so saved configs load) and as flags; ``value_aliases``: older spellings
    of choices, mapped to the current one; ``old_flags``: former flags of the field, still accepted for one
    release, hidden from --help, each use printing one deprecation line that names ``flag``."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "low_open": low_open,
            "flag": flag, "repeat": repeat, "aliases": tuple(aliases), "value_aliases": value_aliases or {},
            "old_flags": tuple(old_flags)}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: list(value) if isinstance(value, list)
                                 else dict(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaf_fields(cls, prefix: str = ""):
    """Yield ``(dotted_key, field, type)`` for every non-dataclass field, depth first."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_config(tp):
            yield from leaf_fields(tp, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, tp


def flag_of(key: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + key.replace(".", "-").replace("_", "-")


def alias_flags(key: str, f: dataclasses.Field) -> list[str]:
    """The flags of a field's older names (``grad_accum`` -> ``--grad-accum``), next to its own."""
    prefix = key.rsplit(".", 1)[0] + "." if "." in key and not f.metadata.get("flag") else ""
    return ["--" + (prefix + a).replace(".", "-").replace("_", "-") for a in f.metadata.get("aliases", ())]


def _field_named(obj, name: str) -> dataclasses.Field | None:
    """The field ``name`` of config ``obj``, or the field that lists ``name`` among its aliases."""
    for f in dataclasses.fields(obj):
        if f.name == name or name in f.metadata.get("aliases", ()):
            return f
    return None


def _convert(value: Any, tp, where: str) -> Any:
    """Convert/check ``value`` against type ``tp``; strings from the command line are parsed."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], where)
        raise ConfigError(f"{where}: unsupported type {tp}")
    if origin is list:
        (inner,) = args or (str,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, inner, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _check(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Check choices and bounds; returns the value with older spellings of choices replaced."""
    m = f.metadata
    renames = m.get("value_aliases") or {}
    if renames:
        value = [renames.get(v, v) for v in value] if isinstance(value, list) else renames.get(value, value)
    values = value if isinstance(value, list) else [value]
    for v in values:
        if v is None:
            continue
        if m.get("choices") and v not in m["choices"]:
            raise ConfigError(f"{where}: {v!r} is not one of {', '.join(map(str, m['choices']))}")
        if m.get("low") is not None:
            if (v <= m["low"]) if m.get("low_open") else (v < m["low"]):
                op = ">" if m.get("low_open") else ">="
                raise ConfigError(f"{where}: must be {op} {m['low']}, got {v!r}")
        if m.get("high") is not None and v > m["high"]:
            raise ConfigError(f"{where}: must be <= {m['high']}, got {v!r}")
    return value


def _known_key(cfg, key: str, where: str) -> str:
    """tether's key for TRL's name of it (``learning_rate`` -> ``optim.lr``), else a one-line error with what the
    key may mean (:func:`tether.trl_compat.keys.resolve_key`)."""
    from tether.trl_compat.keys import resolve_key

    return resolve_key(type(cfg), key, where)


def _set(cfg, key: str, value: Any, where: str, check: bool = True) -> None:
    """Set dotted ``key`` on ``cfg`` after conversion and checks (``check`` False: as it is, for
    :func:`check_config` to check); unknown keys are errors."""
    parts = key.split(".")
    obj = cfg
    for p in parts[:-1]:
        sub = getattr(obj, p, None)
        if sub is None or not dataclasses.is_dataclass(sub):
            return _set(cfg, _known_key(cfg, key, where), value, where, check)
        obj = sub
    f = _field_named(obj, parts[-1])
    if f is None:
        return _set(cfg, _known_key(cfg, key, where), value, where, check)
    tp = _hints(type(obj))[f.name]
    if _is_config(tp):
        raise ConfigError(f"{where}: '{key}' is a section, give its keys")
    setattr(obj, f.name, _check(_convert(value, tp, where), f, where) if check else value)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"kl.coef": 0.05}`` (dotted keys, as in YAML and flags)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + str(k) + "."))
        else:
            out[prefix + str(k)] = v
    return out


def load_yaml(cfg, path: str | Path) -> None:
    """Apply the keys of YAML file ``path`` (nested like the dataclass) to ``cfg``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{line} invalid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    for key, value in flatten(data).items():
        _set(cfg, key, value, f"{path}: key '{key}'")


def resolve_config(cls, args: argparse.Namespace, config_path: str | None = None):
    """Defaults ← YAML file ← command-line flags, each value checked; returns the config."""
    cfg = cls()
    if config_path:
        load_yaml(cfg, config_path)
    for key, f, _ in leaf_fields(cls):
        value = getattr(args, key, None)
        if value is not None:
            _set(cfg, key, value, flag_of(key, f))
    return check_config(cfg)


def named(key: str, f: dataclasses.Field) -> str:
    """How an error names a field: its config key and its flag, ``kl.coef (--kl-coef)`` -- the key a Python or
    YAML user set and the flag a command-line user typed, in one message that serves both."""
    return f"{key} ({flag_of(key, f)})"


def check_fields(cfg):
    """Every field of ``cfg`` through the checks a flag's value gets (type, choices, bounds; older spellings of
    choices replaced); a bad value is one line naming the key and the flag (:func:`named`). The configs'
    ``validate()`` starts with it, so a config set from Python is refused by ``validate()`` itself, as the
    trainer and the command line refuse it. Returns ``cfg``, checked in place."""
    for key, f, _ in leaf_fields(type(cfg)):
        obj = cfg
        for part in key.split(".")[:-1]:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{key.rsplit('.', 1)[0]}: expected a config section, got {type(obj).__name__}")
        _set(cfg, key, getattr(obj, f.name), named(key, f))
    return cfg


def check_config(cfg):
    """The one validation path of a config however it was made -- flags, YAML, or fields set from Python:
    :func:`check_fields`, then the config's ``validate()`` (the cross-field checks). Returns ``cfg``, checked in
    place."""
    check_fields(cfg)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def as_config(cls, config, check: bool = True):
    """``config`` as a ``cls``: a ``cls`` itself, a dict of keys nested as in the saved ``config.yaml`` or dotted
    (``{"kl.coef": 0.1}``), or the path of a YAML file; then :func:`check_config` unless ``check`` is False
    (the caller completes it first)."""
    if isinstance(config, dict):
        cfg = cls()
        for key, value in flatten(config).items():  # values checked below, named by key and flag
            _set(cfg, key, value, f"config: key '{key}'", check=False)
        config = cfg
    elif isinstance(config, (str, Path)):
        path, config = config, cls()
        load_yaml(config, path)
    elif not isinstance(config, cls):
        raise ConfigError(f"config: expected a {cls.__name__}, a dict or a YAML path, got {type(config).__name__}")
    return check_config(config) if check else config


def config_differences(cfg, saved: dict | str | Path, allowed: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """``(key, value in cfg, saved value)`` for every key whose value differs from ``saved`` (a flat dict of
    dotted keys, or a saved ``config.yaml``); keys starting with one of ``allowed``, and keys the saved config
    does not have (added since), are left out. A file that is not a config is a one-line error."""
    if not isinstance(saved, dict):
        try:
            saved = flatten(yaml.safe_load(Path(saved).read_text(encoding="utf-8")) or {})
        except (OSError, yaml.YAMLError, AttributeError):
            raise ConfigError(f"{saved}: not a readable config; cannot compare the run's settings with it") from None
    return [(key, value, saved[key]) for key, value in flatten(config_to_dict(cfg)).items()
            if key in saved and not key.startswith(allowed) and saved[key] != value]


def config_to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")


def config_from_dict(cls, data: dict, where: str = "config"):
    """Rebuild a config from :func:`config_to_dict` output (e.g. a saved run)."""
    cfg = cls()
    for key, value in flatten(data).items():
        _set(cfg, key, value, f"{where}: key '{key}'")
    return cfg
