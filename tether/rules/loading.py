"""Loading a rule named ``module:function[:key=value,...]`` (``--reward``, ``--gold``, PPO reward sources, step
rules, the task gate's checker): the function imported, its ``key=value`` arguments bound by keyword, and a one-line
error naming the flag when it cannot be found. A shipped rule on an optional package (``math_verify_correct``)
says now, not at the first step, that the package is missing.

Imports only the standard library and the rule library (:mod:`tether.rules.library`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from tether.errors import TetherError
from tether.rules.library import NEEDS_PACKAGE

SHIPPED = ("tether.rules", "tether.rules.library")  # where the shipped rules resolve: the package and its library


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_rule(spec: str, flag: str = "--reward") -> Callable:
    """Import ``module:function[:key=value,...]``; one-line errors, naming ``flag``, when it cannot be found."""
    parts = spec.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        what = "a reward-model directory nor a rule" if flag == "--reward" else "a rule"
        raise TetherError(f"{flag} {spec}: not {what} 'module:function'")
    module_name, function_name = parts[0], parts[1]
    kwargs = {}
    for item in filter(None, ":".join(parts[2:]).split(",")):
        if "=" not in item:
            raise TetherError(f"{flag} {spec}: rule arguments must be key=value, got {item!r}")
        key, value = item.split("=", 1)
        kwargs[key.strip()] = _parse_value(value.strip())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TetherError(f"{flag} {spec}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise TetherError(f"{flag} {spec}: module {module_name!r} has no function {function_name!r}")
    if module_name in SHIPPED and function_name in NEEDS_PACKAGE:  # an optional package: missing is said now
        try:
            NEEDS_PACKAGE[function_name]()
        except TetherError as e:
            raise TetherError(f"{flag} {spec}: {e}") from None
    if kwargs:  # bound by keyword: the rule keeps its own signature, so it is called its own way (tether.rules.calls)
        fn = functools.partial(fn, **kwargs)
        fn.__name__ = function_name
    return fn
