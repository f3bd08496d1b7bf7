"""Reward sources and their post-processing (SPEC B4, A8, A9).

A source maps decoded text to one score per response: ``source(prompts, responses, fields) -> (B,)``.
Sources: a reward model directory (standardised scores, A5) — several of them form one ensemble
(mean or min, A8) — a process reward model directory (A9: per-step scores; with ``per_step`` its step rewards
land on the tokens that end the steps, :func:`dense_step_rewards`) and rules, any Python callable
``f(prompts, responses, **fields) -> list[float]`` named ``module:function`` (optionally
``module:function:key=value,...`` for keyword arguments), and any of these given from Python as objects
(``python:NAME`` in the config, :mod:`tether.ppo.inputs`). The PPO step scores a rollout with
:func:`score_rollout`: a :class:`RewardScores` record holding the sequence channel (the sequence-level
sources' summed scores, B4 applies to it) and the dense channel (per-step PRM rewards per token) apart.
Rules get the prompt rows' other columns as keyword lists and, from PPO training and evaluation, the
reserved keyword ``ended_with_eos`` (one bool per response: False when cut by max_new_tokens), so that a
rule can refuse to credit truncated replies; rules that don't name it and take no ``**fields`` never see it.
A rule is called through :func:`tether.rules.calls.call_rule` (a bad row costs the row, B16). Sequence scores
are summed, a rule counting only on the rows it judged (None: "does not apply", :func:`judged_sum`). Then:
length penalty r' = r − α·len, missing-EOS penalty, normalisation (batch or running z-score) and clipping to
[−c, c] (:func:`postprocess_scores`). Sources keep no state between calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tether.core.length import soft_overlong_penalty
from tether.errors import TetherError
from tether.rules import load_rule  # noqa: F401 - part of this module's API (tether.ppo.setup uses it)
from tether.rules.calls import (  # noqa: F401 - this module's API before the move
    EOS_FIELD, NOT_APPLICABLE, call_rule, judged_sum, rollout_fields, with_eos_field)


PYTHON = "python:"  # the spec of a reward given from Python as an object (tether.ppo.inputs names it)


class RuleSource:
    """A rule: ``spec`` imported (``module:function[:key=value,...]``), or the callable ``fn`` given from Python."""

    def __init__(self, spec: str, fn: Callable | None = None):
        self.name = spec
        self.fn = fn if fn is not None else load_rule(spec)

    def judge(self, prompts, responses, fields) -> tuple[torch.Tensor, dict[int, str], set[int]]:
        """(B,) scores, ``{row: "raised ExcType: message"}`` for the rows it failed on (NaN) and the rows it
        returned None for (NaN: TRL's "does not apply"), :func:`call_rule`."""
        errors: dict[int, str] = {}
        not_applicable: set[int] = set()
        return call_rule(self.fn, prompts, responses, fields, errors=errors, not_applicable=not_applicable), \
            errors, not_applicable

    def __call__(self, prompts, responses, fields) -> torch.Tensor:
        return self.judge(prompts, responses, fields)[0]


class RewardModelSource:
    """One reward model or an ensemble, scoring decoded text with its own tokenizer (standardised)."""

    def __init__(self, directories: list[str], reduce: str = "mean", batch_size: int = 64, device=None,
                 given: list[tuple[str, object]] = ()):
        """``given``: ``(name, RewardModel or RewardEnsemble)`` objects from Python, in the ensemble too."""
        from tether.rm.model import RewardEnsemble, RewardModel

        self.name = "+".join([*directories, *(name for name, _ in given)])
        models = [RewardModel.from_pretrained(d, device=device) for d in directories] + [m for _, m in given]
        self.scorer = models[0] if len(models) == 1 else RewardEnsemble(models, reduce=reduce)
        self.batch_size = batch_size

    def __call__(self, prompts, responses, fields) -> torch.Tensor:
        return self.scorer.score(prompts, responses, batch_size=self.batch_size).float().cpu()


class ProcessRewardSource:
    """A process reward model (A9), read on the steps that fit its max_length
    (:meth:`tether.rm.process.ProcessRewardModel.read_responses`). ``per_step`` (``dense``): step k's reward
    (:func:`judged_step_rewards`) lands on the token that ends the step (:meth:`step_rewards`,
    :func:`dense_step_rewards`); a call returns Σ_k r_k per response, the total that evaluation reports.
    ``min`` / ``last``: one score per response, min_k p_k or p_K over the steps read, like any source."""

    def __init__(self, directory: str, aggregation: str = "per_step", threshold: float = 0.5, batch_size: int = 64,
                 device=None, prm=None):
        """``prm``: a :class:`~tether.rm.process.ProcessRewardModel` given from Python (``directory`` names it)."""
        from tether.rm.process import ProcessRewardModel

        self.name, self.aggregation, self.threshold, self.batch_size = directory, aggregation, threshold, batch_size
        self.prm = prm if prm is not None else ProcessRewardModel.from_pretrained(directory, device=device)
        self.dense = aggregation == "per_step"

    def step_rewards(self, prompts, responses) -> tuple[list[list[float]], list[list[int | None]]]:
        """Per response: each step's reward r_k (:func:`judged_step_rewards`) and the character index that ends
        the step in the response (None: its last step, with no separator after it)."""
        read = self.prm.read_responses(prompts, responses, batch_size=self.batch_size)
        return ([judged_step_rewards(s.values, s.read, self.threshold).tolist() for s in read],
                [s.ends for s in read])

    def __call__(self, prompts, responses, fields) -> torch.Tensor:
        from tether.core.steps import aggregate_steps

        if self.dense:
            return torch.tensor([sum(r) for r in self.step_rewards(prompts, responses)[0]], dtype=torch.float32)
        read = self.prm.read_responses(prompts, responses, batch_size=self.batch_size)
        return torch.tensor([aggregate_steps(s.values[s.read], self.aggregation) if s.read.any() else math.nan
                             for s in read], dtype=torch.float32)  # NaN stays NaN: the row is dropped (B16)


def judged_step_rewards(p_good: torch.Tensor, read: torch.Tensor, threshold: float) -> torch.Tensor:
    """(K,) per-step PPO rewards from a PRM's (K,) probabilities:

        r_k = min(p_k − η, 0)  if the PRM read step k,   r_k = 0  if max_length cut it off,

    (:func:`~tether.core.steps.clipped_step_reward`). A cut step is not judged either way, as an outcome RM does
    not judge the end of a reply it truncates; a NaN probability of a step that was read stays NaN (B16)."""
    from tether.core.steps import clipped_step_reward

    return torch.where(read, clipped_step_reward(p_good, threshold), 0.0)


def dense_step_rewards(step_rewards: list[list[float]], step_ends: list[list[int | None]], response: torch.Tensor,
                       response_mask: torch.Tensor, tokenizer) -> torch.Tensor:
    """(B, T) float32 on CPU: each response's step rewards, each on the token that ends its step
    (:func:`~tether.core.steps.step_token_positions`: the first token whose decoded prefix reaches past the
    step's separator; the last valid token — EOS, or the last sampled token of a truncated response — for a
    final step with no separator). ``step_ends``: per response, the character index ending each step. A NaN
    reward stays NaN (the row is then dropped, B16); a response with no tokens keeps it on its first column."""
    from tether.core.steps import place_step_rewards, step_token_positions

    positions, rewards = [], []
    for b, (ends, row_rewards) in enumerate(zip(step_ends, step_rewards)):
        tokens = response[b][response_mask[b].bool()].tolist()
        if not tokens:
            positions.append([0] if not all(map(math.isfinite, row_rewards)) else [])
            rewards.append([math.nan] if positions[-1] else [])
            continue
        positions.append(step_token_positions(ends, _DecodedLength(tokenizer, tokens)))
        rewards.append(row_rewards)
    return place_step_rewards(rewards, positions, tuple(response.shape))


class _DecodedLength:
    """``[j]`` = characters decoded from tokens 0..j (special tokens skipped, as responses are decoded)."""

    def __init__(self, tokenizer, tokens: list[int]):
        self.tokenizer, self.tokens = tokenizer, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, j: int) -> int:
        return len(self.tokenizer.decode(self.tokens[:j + 1], skip_special_tokens=True))


def is_reward_model_dir(spec: str) -> bool:
    """A reward model: a directory, or a Hugging Face Hub id (no colon: rules are ``module:function``)."""
    from tether.presets import is_model_spec

    return is_model_spec(spec)


def is_process_reward_model(directory: str) -> bool:
    """Whether ``directory``'s ``tether_reward.json`` says it is a process reward model."""
    import json

    from tether.rm.model import METADATA_FILE

    from tether.presets import resolve_model_path

    try:
        path = resolve_model_path(directory, what="reward model")
        return json.loads((path / METADATA_FILE).read_text()).get("kind") == "process"
    except (OSError, ValueError, AttributeError, TetherError):
        return False  # RewardModel.from_pretrained gives the one-line error


def reward_kind(obj, name: str) -> str:
    """What a reward given from Python is: ``"outcome"`` (a RewardModel or RewardEnsemble: scores joined with the
    reward-model directories' ensemble), ``"process"`` (a ProcessRewardModel) or ``"rule"`` (any other callable
    with the rule signature); anything else is a one-line error."""
    from tether.rm.model import RewardEnsemble, RewardModel
    from tether.rm.process import ProcessRewardModel

    if isinstance(obj, ProcessRewardModel):
        return "process"
    if isinstance(obj, (RewardModel, RewardEnsemble)):
        return "outcome"
    if callable(obj):
        return "rule"
    raise TetherError(f"--reward {name}: a {type(obj).__name__} is not a reward (a callable f(prompts, responses, "
                      f"**columns) -> list of numbers, a RewardModel, RewardEnsemble or ProcessRewardModel)")


def check_given(specs: list[str], given: dict) -> None:
    """Every ``python:NAME`` reward source must be given as an object: a run made with a Python reward is
    resumed from Python with that reward given again (a command line cannot bring it back)."""
    for spec in specs:
        if spec.startswith(PYTHON) and spec not in given:
            name = spec[len(PYTHON):]
            raise TetherError(f"--reward {spec}: this run's reward {name!r} was a Python object; resume it from "
                              f"Python, giving it again: tether.PPOTrainer(config, reward={{{name!r}: ...}}, "
                              f"resume=True)")


def build_sources(specs: list[str], ensemble: str = "mean", batch_size: int = 64, device=None,
                  process: str = "per_step", process_threshold: float = 0.5, given: dict | None = None) -> list:
    """Outcome reward models (directories and given objects: one ensemble source), process reward models (one
    source each, A9) and rules (one source each), in that order. ``given``: ``{spec: object}`` for the sources
    given from Python (:func:`reward_kind`)."""
    given = given or {}
    check_given(specs, given)
    kinds = {s: reward_kind(given[s], s) for s in specs if s in given}
    dirs = [s for s in specs if s not in given and is_reward_model_dir(s)]
    prm_dirs = [d for d in dirs if is_process_reward_model(d)]
    rm_dirs = [d for d in dirs if d not in prm_dirs]
    rm_given = [(s, given[s]) for s in specs if kinds.get(s) == "outcome"]
    sources = [RewardModelSource(rm_dirs, ensemble, batch_size, device, rm_given)] if rm_dirs or rm_given else []
    sources += [ProcessRewardSource(d, process, process_threshold, batch_size, device, given.get(d))
                for d in specs if d in prm_dirs or kinds.get(d) == "process"]
    return sources + [RuleSource(s, given.get(s)) for s in specs if s not in dirs and kinds.get(s, "rule") == "rule"]


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
                       gather=None, max_new_tokens: int = 0) -> torch.Tensor:
    """B4 on (B,) raw scores: r − α·len − p·[no EOS] + B4-overlong (DAPO's soft overlong punishment with
    L_max = ``max_new_tokens``, L_cache = ``cfg.overlong_buffer``: :func:`~tether.core.length.soft_overlong_penalty`),
    then z-score (batch or running), then clip to ±c.

    ``cfg`` is a ``RewardConfig``; ``lengths`` (B,) response tokens; ``ended_with_eos`` (B,) bool;
    ``valid`` (B,) bool: rows dropped from the update (B16) are left out of the normalisation statistics
    and score 0. ``gather`` maps this process's (B,) tensor to every process's (W·B,): the batch statistics
    and the running moments are then those of the whole batch, the same on every process."""
    valid = torch.ones_like(raw, dtype=torch.bool) if valid is None else valid
    scores = raw - cfg.length_penalty * lengths.float()
    scores = scores - cfg.missing_eos_penalty * (~ended_with_eos).float()
    if cfg.overlong_buffer:
        if max_new_tokens < cfg.overlong_buffer:  # a caller that forgot L_max: every reply would read as overlong
            raise ValueError(f"overlong_buffer {cfg.overlong_buffer} needs max_new_tokens >= it, got {max_new_tokens}")
        scores = scores + soft_overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer,
                                                cfg.overlong_penalty_factor).to(scores.device)
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
    """Σ over sources of their (B,) scores (:func:`judged_sum`: a rule's None leaves the row to the others);
    rules also get ``ended_with_eos`` when given (see call_rule)."""
    fields = with_eos_field(fields, ended_with_eos)
    judged = [judge(source, prompts, responses, fields) for source in sources]
    return judged_sum([(scores, not_applicable) for scores, _, not_applicable in judged], len(responses))


def judge(source, prompts, responses, fields) -> tuple[torch.Tensor, dict[int, str], set[int]]:
    """A source's (B,) scores, the rows it failed on and the rows it does not apply to (rules only:
    :meth:`RuleSource.judge`; a model scores every row)."""
    return source.judge(prompts, responses, fields) if isinstance(source, RuleSource) else \
        (source(prompts, responses, fields), {}, set())


@dataclass(frozen=True)
class RewardScores:
    """What the reward sources gave one rollout (B4, A9), two channels apart, both float32 on CPU:

    - ``sequence`` (B,): the summed scores of the sequence-level sources (reward models, rules, a PRM read as
      ``min``/``last``); B4's penalties, normalisation and clip apply to it, then it lands on the last token.
      Exactly 0 where no sequence-level source scored (a per-step PRM alone).
    - ``dense`` (B, T): the step rewards of per-step PRMs on the tokens that end the steps (zeros if none);
      outside B4.

    ``errors``: why a row's score is NaN where a rule made it so: ``{row: "SOURCE raised ExcType: message"}`` (or
    "SOURCE returned ..., not a number"), or that every rule returned None for it (does not apply)."""

    sequence: torch.Tensor
    dense: torch.Tensor
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> torch.Tensor:
        """(B,) what each response earned from the sources, sequence + Σ_t dense; NaN (non-finite) if either
        channel is, so a finite check on it covers both."""
        return self.sequence + self.dense.sum(dim=1)


def score_rollout(sources: list, prompts: list[str], responses: list[str], fields: dict, rollout, tokenizer
                  ) -> RewardScores:
    """The sources' scores of one rollout (B4, A9): ``responses`` the decoded texts of ``rollout.response``
    (its valid tokens, special tokens skipped), ``fields`` the prompt rows' other columns; rules also get
    ``ended_with_eos`` and ``completion_ids``. ``tokenizer``: the policy's, to find the token that ends each PRM step."""
    fields = rollout_fields(fields, rollout)  # + ended_with_eos, completion_ids
    dense = torch.zeros(tuple(rollout.response.shape), dtype=torch.float32)
    errors: dict[int, str] = {}
    parts, dense_sources = [], False
    for source in sources:
        if getattr(source, "dense", False):
            rewards, ends = source.step_rewards(prompts, responses)
            dense += dense_step_rewards(rewards, ends, rollout.response.cpu(), rollout.response_mask.cpu(),
                                        tokenizer)
            dense_sources = True
        else:
            scores, failed, not_applicable = judge(source, prompts, responses, fields)
            errors.update({row: f"{source.name} {e}" for row, e in failed.items() if row not in errors})
            parts.append((scores, not_applicable))
    sequence = judged_sum(parts, len(responses), all_judged=dense_sources)
    for row in torch.isnan(sequence).nonzero().flatten().tolist():
        if row not in errors and all(row in skipped for _, skipped in parts):
            errors[row] = f"no reward judged it ({NOT_APPLICABLE})"
    return RewardScores(sequence=sequence, dense=dense, errors=errors)
