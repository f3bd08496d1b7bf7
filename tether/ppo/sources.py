"""Reward sources and their post-processing (SPEC B4, A8).

A source maps decoded text to one score per response: ``source(prompts, responses, fields) -> (B,)``.
Sources: a reward model directory (standardised scores, A5) — several of them form one ensemble
(mean or min, A8) — and rules, any Python callable ``f(prompts, responses, **fields) -> list[float]``
named ``module:function`` (optionally ``module:function:key=value,...`` for keyword arguments).
Rules get the prompt rows' other columns as keyword lists and, from PPO training and evaluation, the
reserved keyword ``ended_with_eos`` (one bool per response: False when cut by max_new_tokens), so that a
rule can refuse to credit truncated replies; rules that don't name it and take no ``**fields`` never see it.
Sources are summed. Then: length penalty r' = r − α·len, missing-EOS penalty, normalisation (batch or
running z-score) and clipping to [−c, c].
"""

from __future__ import annotations

import importlib
import inspect
import math
from pathlib import Path
from typing import Callable

import torch

from tether.errors import TetherError


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_rule(spec: str) -> Callable:
    """Import ``module:function[:key=value,...]``; one-line errors when it cannot be found."""
    parts = spec.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise TetherError(f"--reward {spec}: not a reward-model directory nor a rule 'module:function'")
    module_name, function_name = parts[0], parts[1]
    kwargs = {}
    for item in filter(None, ":".join(parts[2:]).split(",")):
        if "=" not in item:
            raise TetherError(f"--reward {spec}: rule arguments must be key=value, got {item!r}")
        key, value = item.split("=", 1)
        kwargs[key.strip()] = _parse_value(value.strip())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TetherError(f"--reward {spec}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise TetherError(f"--reward {spec}: module {module_name!r} has no function {function_name!r}")
    if kwargs:
        base = fn

        def fn(prompts, responses, **fields):
            return base(prompts, responses, **fields, **kwargs)

        fn.__name__ = function_name
    return fn


EOS_FIELD = "ended_with_eos"


def with_eos_field(fields: dict[str, list], ended_with_eos=None) -> dict[str, list]:
    """``fields`` plus the reserved ``ended_with_eos`` list (bools, from a (B,) tensor or a list); ``fields``
    itself when ``ended_with_eos`` is None."""
    if ended_with_eos is None:
        return fields
    if EOS_FIELD in fields:
        raise TetherError(f"prompt rows have a column {EOS_FIELD!r}: tether reserves that name for rules "
                          f"(whether each response ended with EOS); rename the column")
    flags = ended_with_eos.tolist() if hasattr(ended_with_eos, "tolist") else list(ended_with_eos)
    return {**fields, EOS_FIELD: [bool(f) for f in flags]}


def _rule_name(fn) -> str:
    return getattr(fn, "__name__", str(fn))


def _numbers(fn, out, n: int) -> list[float]:
    """The rule's output as ``n`` floats (NaN/Inf kept: the PPO step drops those rows, B16); a wrong length
    or a value that is not a number is a one-line error (a bug in the rule, not in one row)."""
    try:
        out = list(out)
    except TypeError:
        raise TetherError(f"rule {_rule_name(fn)}: returned {type(out).__name__}, not a list of numbers") from None
    if len(out) != n:
        raise TetherError(f"rule {_rule_name(fn)}: returned {len(out)} scores for {n} responses")
    values = []
    for v in out:
        if isinstance(v, (str, bytes)) or v is None:
            raise TetherError(f"rule {_rule_name(fn)}: returned {v!r} ({type(v).__name__}), not a number")
        try:
            values.append(float(v))
        except (TypeError, ValueError):
            raise TetherError(f"rule {_rule_name(fn)}: returned {v!r} ({type(v).__name__}), not a number") from None
    return values


def call_rule(fn: Callable, prompts: list[str], responses: list[str], fields: dict[str, list],
              ended_with_eos=None, errors: dict | None = None) -> torch.Tensor:
    """Call a rule with the prompt rows' other columns as keyword lists, plus ``ended_with_eos`` when given
    (only the keywords it accepts, unless it takes ``**fields``); check it returned one number per response.

    A rule that raises on the batch is called again row by row: rows that still raise score NaN (the PPO
    step drops them, B16) and ``errors`` (when given) gets ``{row: "ExcType: message"}``; a rule that raises
    on every row is a one-line error. Non-finite scores are returned as they are."""
    fields = with_eos_field(fields, ended_with_eos)
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    try:
        return torch.tensor(_numbers(fn, fn(prompts, responses, **fields), len(responses)), dtype=torch.float32)
    except TetherError:
        raise
    except Exception:  # noqa: BLE001 - a rule is user code: isolate the rows it fails on
        pass
    values, failed = [], {}
    for i in range(len(responses)):
        try:
            out = fn(prompts[i:i + 1], responses[i:i + 1], **{k: v[i:i + 1] for k, v in fields.items()})
            values += _numbers(fn, out, 1)
        except TetherError:
            raise
        except Exception as e:  # noqa: BLE001
            values.append(math.nan)
            failed[i] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    if len(failed) == len(responses):
        raise TetherError(f"rule {_rule_name(fn)}: raised on every response ({failed[0]})")
    if errors is not None:
        errors.update(failed)
    return torch.tensor(values, dtype=torch.float32)


class RuleSource:
    def __init__(self, spec: str):
        self.name = spec
        self.fn = load_rule(spec)
        self.errors: dict[int, str] = {}  # the rows of the last call that raised (named in the step's alert)

    def __call__(self, prompts, responses, fields) -> torch.Tensor:
        self.errors = {}
        return call_rule(self.fn, prompts, responses, fields, errors=self.errors)


class RewardModelSource:
    """One reward model or an ensemble, scoring decoded text with its own tokenizer (standardised)."""

    def __init__(self, directories: list[str], reduce: str = "mean", batch_size: int = 64, device=None):
        from tether.rm.model import RewardEnsemble, RewardModel

        self.name = "+".join(directories)
        models = [RewardModel.from_pretrained(d, device=device) for d in directories]
        self.scorer = models[0] if len(models) == 1 else RewardEnsemble(models, reduce=reduce)
        self.batch_size = batch_size

    def __call__(self, prompts, responses, fields) -> torch.Tensor:
        return self.scorer.score(prompts, responses, batch_size=self.batch_size).float().cpu()


def is_reward_model_dir(spec: str) -> bool:
    return Path(spec).expanduser().is_dir()


def build_sources(specs: list[str], ensemble: str = "mean", batch_size: int = 64, device=None) -> list:
    """Reward-model directories (one ensemble source) and rules (one source each), in that order."""
    rm_dirs = [s for s in specs if is_reward_model_dir(s)]
    rules = [s for s in specs if s not in rm_dirs]
    sources = [RewardModelSource(rm_dirs, ensemble, batch_size, device)] if rm_dirs else []
    return sources + [RuleSource(s) for s in rules]


class RunningMoments:
    """Running mean/variance over all scores seen (parallel Welford merge), for running z-scores."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        batch_mean, batch_m2 = x.double().mean().item(), ((x.double() - x.double().mean()) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def postprocess_scores(raw: torch.Tensor, lengths: torch.Tensor, ended_with_eos: torch.Tensor, cfg,
                       running: RunningMoments | None = None, valid: torch.Tensor | None = None,
                       gather=None) -> torch.Tensor:
    """B4 on (B,) raw scores: r − α·len − p·[no EOS], then z-score (batch or running), then clip to ±c.

    ``cfg`` is a ``RewardConfig``; ``lengths`` (B,) response tokens; ``ended_with_eos`` (B,) bool;
    ``valid`` (B,) bool: rows dropped from the update (B16) are left out of the normalisation statistics
    and score 0. ``gather`` maps this process's (B,) tensor to every process's (W·B,): the batch statistics
    and the running moments are then those of the whole batch, the same on every process."""
    valid = torch.ones_like(raw, dtype=torch.bool) if valid is None else valid
    scores = raw - cfg.length_penalty * lengths.float()
    scores = scores - cfg.missing_eos_penalty * (~ended_with_eos).float()
    gather = gather or (lambda x: x)
    # A dropped row may hold NaN: zero it before it travels, then keep only the valid rows of all processes.
    kept = gather(torch.where(valid, scores, 0.0))[gather(valid.to(torch.uint8)).bool()]
    if cfg.normalize == "batch" and len(kept):
        scores = (scores - kept.mean()) / (kept.std(unbiased=False) + 1e-8)
    elif cfg.normalize == "running":
        running.update(kept)
        scores = (scores - running.mean) / (running.std + 1e-8)
    if cfg.clip > 0:
        scores = scores.clamp(-cfg.clip, cfg.clip)
    return torch.where(valid, scores, 0.0)


def score_responses(sources: list, prompts: list[str], responses: list[str], fields: dict,
                    ended_with_eos=None) -> torch.Tensor:
    """Σ over sources of their (B,) scores; rules also get ``ended_with_eos`` when given (see call_rule)."""
    fields = with_eos_field(fields, ended_with_eos)
    return torch.stack([source(prompts, responses, fields) for source in sources]).sum(dim=0)
