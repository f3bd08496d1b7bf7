"""Process reward models (A9): a score for every reasoning step, read at the step's separator.

A PRM is the reward model's backbone and one-output linear head (A1), read not at the last token but at
the last token of every step's separator (TRL's PRM layout): the text is the prompt (+ the format's
prompt separator), then ``step + separator`` for every step, the last one included, so every step is
scored in the same context whether or not the response wrote its final separator. Each read-out z_k is the
logit of P(step k is right | prompt, steps ≤ k), trained with per-step binary cross-entropy
(:func:`tether.core.steps.step_bce_loss`). An outcome RM is the one-step case: the whole response as one
step, labelled by whether the final answer is right.

Texts too long for ``max_length`` lose the start of the prompt first (down to one token), then whole steps
from the end: a step whose read-out token does not fit has no score (NaN) and its label is left out of
training. Scoring a response (:meth:`ProcessRewardModel.score`, PPO's reward source) also reads a first step
that alone does not fit at the last token that fits — an outcome RM reads a too-long reply so —, so every
response gets a score, never NaN for its length.

:class:`ProcessRewardModel` wraps the :class:`~tether.rm.model.RewardModel` it is saved as (same directory
layout, ``"kind": "process"`` in ``tether_reward.json``): its backbone helpers are :mod:`tether.rm.backbone`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from tether.inputs.conversations import prompt_text
from tether.core.stats import wilson_interval
from tether.core.steps import first_error, split_steps
from tether.errors import TetherError
from tether.rm.backbone import last_hidden_states, linear_head, pad_batch
from tether.rm.model import load_reward_dir


class EncodedSteps(NamedTuple):
    ids: list[int]
    positions: list[int | None]  # token index of each step's read-out; None = cut by max_length
    prompt_truncated: bool


def encode_steps(tokenizer, prompt: str, steps: Sequence[str], separator: str, prompt_separator: str = "",
                 max_length: int = 512, read_cut_first: bool = False) -> EncodedSteps:
    """Token ids of ``prompt + prompt_separator + Σ_k (step_k + separator)`` and, per step, the index of the
    last token of its piece. Pieces are tokenised one by one (TRL does the same), so the read-out token is
    always the separator's, whatever the tokenizer merges across a boundary. Too long: the prompt loses its
    start (down to one token), then every step from the first whose piece does not fit is cut (None; it
    would lack its context). ``read_cut_first``: a first step that alone does not fit keeps its first tokens
    up to ``max_length`` and is read at the last of them (scoring; training leaves it unlabelled)."""
    prompt_ids = list(tokenizer(prompt_text(prompt) + prompt_separator, add_special_tokens=True)["input_ids"])
    pieces = [list(tokenizer(step + separator, add_special_tokens=False)["input_ids"]) for step in steps]
    step_tokens = sum(len(p) for p in pieces)
    prompt_cut = False
    excess = len(prompt_ids) + step_tokens - max_length
    if excess > 0:  # the prompt loses its start first, down to one token
        drop = min(excess, len(prompt_ids) - 1)
        prompt_ids, prompt_cut = prompt_ids[drop:], drop > 0
    ids, positions = list(prompt_ids), []
    for piece in pieces:
        if positions and positions[-1] is None or len(ids) + len(piece) > max_length or not piece:
            if read_cut_first and not positions and piece and len(ids) < max_length:
                ids += piece[:max_length - len(ids)]
                positions.append(len(ids) - 1)
            else:
                positions.append(None)
            continue
        ids += piece
        positions.append(len(ids) - 1)
    return EncodedSteps(ids, positions, prompt_cut)


def step_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
    """(B, K) float32 logits z_{b,k} = w·h[b, positions[b, k]] (+ bias) of right-padded rows; ``positions``
    (B, K) long, any valid index where a step is padding (the caller masks it)."""
    hidden = last_hidden_states(model, input_ids, attention_mask)  # (B, T, H)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1)  # (B, 1)
    return linear_head(model)(hidden[rows, positions])[..., 0].float()  # (B, K)


def batch_tensors(encoded: Sequence[EncodedSteps], pad_id: int) -> tuple[torch.Tensor, ...]:
    """``(input_ids, attention_mask, positions, step_mask)``: (B, T), (B, T), (B, K), (B, K) with K the most
    steps of a row; cut and padded steps have step_mask 0 and position 0."""
    ids, mask = pad_batch([e.ids for e in encoded], pad_id, "right")
    k_max = max(1, max(len(e.positions) for e in encoded))
    positions = torch.zeros((len(encoded), k_max), dtype=torch.long)
    step_mask = torch.zeros((len(encoded), k_max), dtype=torch.bool)
    for b, e in enumerate(encoded):
        for k, pos in enumerate(e.positions):
            if pos is not None:
                positions[b, k], step_mask[b, k] = pos, True
    return ids, mask, positions, step_mask


class ProcessRewardModel:
    """A process reward model (A9): the backbone and head of ``rm`` (a :class:`~tether.rm.model.RewardModel`,
    as it is saved), read at every step's separator instead of the last token.

    ``score_steps(prompts, responses)``: per response, (K,) P(step k is right), the logits with ``raw=True``;
    ``score``: one score per response, the worst step's (Lightman et al. rank solutions so)."""

    def __init__(self, rm):
        self.rm = rm

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None) -> "ProcessRewardModel":
        """Load a directory written by ``tether train-rm --process``; TetherError if it is not one."""
        rm = load_reward_dir(path, device, dtype)
        if rm.metadata.get("kind") != "process":
            raise TetherError(f"{path}: an outcome reward model; scoring steps needs a process reward model "
                              f"(trained with train-rm --process)")
        return cls(rm)

    model = property(lambda self: self.rm.model)
    tokenizer = property(lambda self: self.rm.tokenizer)
    text_format = property(lambda self: self.rm.text_format)
    metadata = property(lambda self: self.rm.metadata)
    device = property(lambda self: self.rm.device)

    @property
    def step_separator(self) -> str:
        return self.rm.metadata.get("step_separator", "\n")

    def save_pretrained(self, path, extra: dict | None = None) -> None:
        self.rm.save_pretrained(path, extra)

    def encode(self, prompts: Sequence[str], steps: Sequence[Sequence[str]], read_cut_first: bool = False
               ) -> list[EncodedSteps]:
        """:func:`encode_steps` of every row, in the model's text format."""
        if len(prompts) != len(steps):
            raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
        fmt, sep = self.text_format, self.step_separator
        return [encode_steps(self.tokenizer, p, s, sep, fmt.separator, fmt.max_length, read_cut_first)
                for p, s in zip(prompts, steps)]

    @torch.no_grad()
    def read_out(self, encoded: Sequence[EncodedSteps], raw: bool = False, batch_size: int = 64
                 ) -> list[torch.Tensor]:
        """Per row, (K,) float32 on CPU: P(step k is right) = σ(z_k), or the logits z_k with ``raw``; NaN for a
        step that was cut (position None). Batched by similar length; no gradients."""
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            ids, mask, positions, step_mask = batch_tensors([encoded[i] for i in rows], pad_id)
            logits = step_logits(self.model, ids.to(self.device), mask.to(self.device),
                                 positions.to(self.device)).cpu()
            values = torch.where(step_mask, logits if raw else torch.sigmoid(logits), torch.nan)
            for b, i in enumerate(rows):
                out[i] = values[b, :len(encoded[i].positions)].clone()
        return out

    def score_step_lists(self, prompts: Sequence[str], steps: Sequence[Sequence[str]], raw: bool = False,
                         batch_size: int = 64) -> list[torch.Tensor]:
        """Per row of given steps, (K,): P(step k is right), the logits with ``raw``; NaN for a step cut by
        max_length (the evaluation's and training's rule: a cut step has no score)."""
        return self.read_out(self.encode(prompts, steps), raw=raw, batch_size=batch_size)

    def score_steps(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
                    batch_size: int = 64) -> list[torch.Tensor]:
        """:meth:`score_step_lists` of responses split at the step separator (``split_steps``)."""
        _check_lists(prompts, responses)
        steps = [split_steps(r, self.step_separator)[0] for r in responses]
        return self.score_step_lists(prompts, steps, raw=raw, batch_size=batch_size)

    def read_responses(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
                       batch_size: int = 64) -> list[StepScores]:
        """Scoring whole responses (``score``, PPO's reward source): per response its steps' values (as
        :meth:`score_steps`), which steps were read and where each step ends in the response's text. A
        too-long response is read on the steps that fit, its first step at the last token that fits when it
        alone does not (``read_cut_first``), so at least one step is read, whatever the length."""
        _check_lists(prompts, responses)
        split = [split_steps(r, self.step_separator) for r in responses]
        encoded = self.encode(prompts, [steps for steps, _ in split], read_cut_first=True)
        values = self.read_out(encoded, raw=raw, batch_size=batch_size)
        return [StepScores(v, torch.tensor([pos is not None for pos in e.positions], dtype=torch.bool), ends)
                for v, e, (_, ends) in zip(values, encoded, split)]

    def score(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
              batch_size: int = 64) -> torch.Tensor:
        """(B,) float32: min over the steps read (:meth:`read_responses`) of P(step k is right), of the logits
        with ``raw`` (min is monotone in σ)."""
        return torch.tensor([s.values[s.read].min() if s.read.any() else torch.nan
                             for s in self.read_responses(prompts, responses, raw, batch_size)], dtype=torch.float32)


class StepScores(NamedTuple):
    values: torch.Tensor  # (K,) P(step k is right), or its logit; NaN where not read
    read: torch.Tensor  # (K,) bool: the step's read-out token fit in max_length
    ends: list[int | None]  # character index of each step's last separator character (None: the text's end)


def _check_lists(prompts, responses) -> None:
    if isinstance(prompts, str) or isinstance(responses, str):
        raise TypeError("score_steps() takes lists of prompts and responses, not a single string")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")


def evaluate_steps(step_probs: Sequence[torch.Tensor], labels: Sequence[Sequence[int]],
                   prompts: Sequence[str] | None = None) -> dict:
    """Step-level evaluation of a PRM on held-out step-labelled responses.

    step accuracy = share of scored steps with [p ≥ 0.5] = label, with its Wilson 95% interval; the accuracy on
    good and on bad steps and their mean (balanced: 0.5 for any constant answer), beside the majority-class
    share; first-error accuracy = share of responses whose predicted first error (the first step with
    p < 0.5, or none) is the labelled one (PRM800K's task), with its interval. With ``prompts``: within-prompt
    accuracy = over pairs of responses to one prompt, one with every step good and one with a bad step, the
    share where the first has the higher min-step score (ties wrong) — what Best-of-N needs. Step and
    response accuracy can be high from the prompt alone (hard prompts get low scores whatever the reply
    says); this one cannot. Its interval treats pairs as independent (optimistic: pairs share responses).
    """
    hits = {0: [0, 0], 1: [0, 0]}  # label -> [correct, total]
    first_hits = n_responses = 0
    for probs, ys in zip(step_probs, labels):
        scored = [(float(p), y) for p, y in zip(probs.tolist(), ys) if not math.isnan(p)]  # NaN = cut
        for p, y in scored:
            hits[y][0] += int((p >= 0.5) == bool(y))
            hits[y][1] += 1
        if len(scored) == len(ys):
            n_responses += 1
            first_hits += int(first_error([p >= 0.5 for p, _ in scored]) == first_error(ys))
    n = hits[0][1] + hits[1][1]
    if n == 0:
        raise TetherError("no scored held-out steps to evaluate")
    correct = hits[0][0] + hits[1][0]
    low, high = wilson_interval(correct, n)
    f_low, f_high = wilson_interval(first_hits, n_responses)
    within = _within_prompt(step_probs, labels, prompts) if prompts is not None else {}
    per_class = {name: hits[y][0] / hits[y][1] if hits[y][1] else float("nan") for y, name in ((1, "good"), (0, "bad"))}
    return {"n_steps": n, "n_good_steps": hits[1][1], "step_accuracy": correct / n, "wilson_low": low,
            "wilson_high": high, "excludes_chance": low > 0.5, "accuracy_good_steps": per_class["good"],
            "accuracy_bad_steps": per_class["bad"],
            "balanced_accuracy": (per_class["good"] + per_class["bad"]) / 2,
            "majority_share": max(hits[0][1], hits[1][1]) / n, "n_responses": n_responses,
            "first_error_accuracy": first_hits / n_responses if n_responses else float("nan"),
            "first_error_low": f_low, "first_error_high": f_high, **within}


def _within_prompt(step_probs, labels, prompts) -> dict:
    groups: dict[str, list[tuple[float, bool]]] = {}
    for probs, ys, prompt in zip(step_probs, labels, prompts):
        if probs.numel() and not torch.isnan(probs).any():
            groups.setdefault(prompt, []).append((float(probs.min()), all(ys)))
    right = n = 0
    for rows in groups.values():
        good, bad = [s for s, ok in rows if ok], [s for s, ok in rows if not ok]
        right += sum(g > b for g in good for b in bad)
        n += len(good) * len(bad)
    low, high = wilson_interval(right, n)
    return {"within_prompt_pairs": n, "within_prompt_accuracy": right / n if n else float("nan"),
            "within_prompt_low": low, "within_prompt_high": high}


def format_step_evaluation(e: dict) -> str:
    return (f"held-out steps: accuracy {e['step_accuracy']:.3f} [{e['wilson_low']:.3f}, {e['wilson_high']:.3f}] "
            f"on {e['n_steps']} steps (good {e['accuracy_good_steps']:.3f}, bad {e['accuracy_bad_steps']:.3f}, "
            f"balanced {e['balanced_accuracy']:.3f}; majority class {e['majority_share']:.3f}); first error found "
            f"in {e['first_error_accuracy']:.3f} [{e['first_error_low']:.3f}, {e['first_error_high']:.3f}] of "
            f"{e['n_responses']} responses"
            + (f"; within a prompt, all-good over flawed in {e['within_prompt_accuracy']:.3f} "
               f"[{e['within_prompt_low']:.3f}, {e['within_prompt_high']:.3f}] of {e['within_prompt_pairs']} pairs"
               if e.get("within_prompt_pairs") else ""))
