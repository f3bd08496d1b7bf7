"""Outcome reward models as components: text formatting, loading, scoring API, ensembles.

A reward model is any Hugging Face ``AutoModelForSequenceClassification`` with one output (A1). A process
reward model (A9) is the same backbone read at every step: :class:`tether.rm.process.ProcessRewardModel`.

- **Formatting.** ``TextFormat`` turns ``(prompt, reply)`` into token ids the same way in training and in
  scoring: the tokenizer's chat template when it has one (user = prompt, assistant = reply; HH
  transcripts become their Human/Assistant turns), plain concatenation ``prompt + separator + reply``
  otherwise. Too-long texts lose the *start of the prompt* first and the end of the reply only when the
  reply alone does not fit — pairs are never dropped (TRL drops them, and learns "longer wins").
- **Pooling.** Last-token pooling from the attention mask, or the model's own (:mod:`tether.rm.backbone`).
- **Scale (A5).** BT fixes scores only up to a constant, so ``RewardModel`` stores mean/std of raw
  scores on a reference sample and returns z = (r − mean) / std unless ``raw=True``.
- **Ensembles (A8).** ``RewardEnsemble`` reduces standardised scores by mean or min.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from tether.inputs.conversations import chat_messages, prompt_text
from tether.errors import TetherError
from tether.hf import load_tokenizer, quiet_transformers
from tether.rm.backbone import load_sequence_classifier, pad_batch, pooled_scores, pooling_of

METADATA_FILE = "tether_reward.json"
FORMAT_VERSION = 1
_SENTINEL = "\u2063TETHER_REPLY\u2063"  # placeholder for the reply when rendering a chat template


# ------------------------------------------------------------------------------------------ formatting
class Encoded(NamedTuple):
    ids: list[int]
    n_reply_tokens: int
    prompt_truncated: bool
    reply_truncated: bool


@dataclass
class TextFormat:
    """How a ``(prompt, reply)`` becomes tokens. ``kind``: ``"chat"`` (the tokenizer's chat template) or
    ``"plain"`` (``prompt + separator + reply``, with the tokenizer's own special tokens); ``max_length`` in
    tokens; truncation: the prompt from the left, then the reply from the right (special tokens kept)."""

    kind: str = "plain"
    separator: str = ""
    max_length: int = 512
    truncation: str = "prompt from the left, then reply from the right"

    def render(self, tokenizer, prompt, reply: str) -> tuple[str, int, int]:
        """``(text, reply_start, reply_end)``: the full text and the character span of the reply in it.
        ``prompt``: text, or chat messages (:mod:`tether.inputs.conversations`)."""
        if self.kind == "plain":
            prompt = prompt_text(prompt)  # messages as an HH transcript
            start = len(prompt) + len(self.separator)
            return prompt + self.separator + reply, start, start + len(reply)
        messages = chat_messages(prompt)
        template = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": _SENTINEL}],
                                                 tokenize=False)
        prefix, found, suffix = template.partition(_SENTINEL)
        if not found:
            raise TetherError("the tokenizer's chat template does not keep the assistant text verbatim; "
                              "use format 'plain'")
        reply = reply.strip()
        return prefix + reply + suffix, len(prefix), len(prefix) + len(reply)

    def encode(self, tokenizer, prompt: str, reply: str) -> Encoded:
        """Token ids of the formatted pair, truncated to ``max_length`` keeping the reply (see class doc)."""
        text, start, end = self.render(tokenizer, prompt, reply)
        # A chat template already writes BOS and friends; plain text gets the tokenizer's special tokens.
        enc = tokenizer(text, add_special_tokens=self.kind == "plain", return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        special = [s == e for s, e in offsets]  # tokens added by the post-processor cover no text
        prompt_cut = reply_cut = False
        excess = len(ids) - self.max_length
        if excess > 0:
            prompt_idx = [i for i, (s, e) in enumerate(offsets) if not special[i] and e <= start]
            drop = set(prompt_idx[:excess])
            prompt_cut = bool(drop)
            rest = excess - len(drop)
            if rest > 0:  # the reply alone is too long: keep its beginning
                tail = [i for i in range(len(ids)) if i not in drop and not special[i]]
                drop.update(tail[len(tail) - rest:])
                reply_cut = True
            keep = [i for i in range(len(ids)) if i not in drop][: self.max_length]
            ids, offsets, special = [ids[i] for i in keep], [offsets[i] for i in keep], [special[i] for i in keep]
        n_reply = sum(1 for (s, e), sp in zip(offsets, special) if not sp and s >= start and e <= end and e > s)
        if not ids:  # empty text with a tokenizer that adds nothing: score one EOS rather than nothing
            ids = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id]
        return Encoded(ids, n_reply, prompt_cut, reply_cut)


def choose_format(tokenizer, kind: str = "auto", separator: str = "", max_length: int = 512) -> TextFormat:
    """``"auto"``: the chat template when the tokenizer has one, else plain concatenation."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if kind == "chat" and not has_template:
        raise TetherError("format 'chat' was asked for but the tokenizer has no chat template")
    if kind == "auto":
        kind = "chat" if has_template else "plain"
    return TextFormat(kind=kind, separator=separator, max_length=max_length)


def prompt_groups(prompts: Sequence[str], batch_size: int) -> list[list[list[int]]]:
    """Indices of the texts grouped by prompt (first-seen order), the groups cut into batches of about
    ``batch_size`` texts (a group larger than that is a batch of its own)."""
    by_prompt: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(p if isinstance(p, str) else repr(p), []).append(i)
    batches, current, n = [], [], 0
    for group in by_prompt.values():
        if current and n + len(group) > batch_size:
            batches.append(current)
            current, n = [], 0
        current.append(group)
        n += len(group)
    return batches + ([current] if current else [])


# ---------------------------------------------------------------------------------------- scoring API
class RewardModel:
    """A trained reward model: ``score(prompts, responses)`` → standardised scores (B,) float32 on CPU.

    Text is formatted and tokenised here exactly as in training, so the policy may use any tokenizer.
    """

    def __init__(self, model, tokenizer, text_format: TextFormat, pooling: str | None = None,
                 mean: float = 0.0, std: float = 1.0, metadata: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.text_format = text_format
        self.pooling = pooling or pooling_of(model)
        self.mean, self.std = float(mean), float(std)
        self.metadata = dict(metadata or {})
        self.packing: bool | None = None  # scored packed when the check passes (:meth:`packed`)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None) -> "RewardModel":
        """Load a directory written by ``tether train-rm`` — or a one-output sequence classifier saved by another
        library (TRL's ``RewardTrainer``), scored raw (:func:`foreign_reward_model`); TetherError if it is neither,
        or if it holds a process reward model (whose scores are read per step:
        :class:`tether.rm.process.ProcessRewardModel`)."""
        rm = load_reward_dir(path, device, dtype)
        if rm.metadata.get("kind") == "process":
            raise TetherError(f"{path}: a process reward model (train-rm --process); load it with "
                              f"tether.rm.process.ProcessRewardModel.from_pretrained")
        return rm

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> list[Encoded]:
        if isinstance(prompts, str) or isinstance(responses, str):
            raise TypeError("score() takes lists of prompts and responses, not a single string")
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.text_format.encode(self.tokenizer, p, r) for p, r in zip(prompts, responses)]

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
              batch_size: int = 64) -> torch.Tensor:
        """Scores (B,) float32 on CPU, one per (prompt, response): standardised z = (r − mean)/std, or the
        raw head output r with ``raw=True``. Batched by similar length; no gradients."""
        encoded = [e.ids for e in self.encode(prompts, responses)]
        out = torch.empty(len(encoded), dtype=torch.float32)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.packed(prompts, encoded, pad_id):
            from tether.rm.packing import packed_scores

            for rows in prompt_groups(prompts, batch_size):  # each prompt once, its replies after it
                scores = packed_scores(self.model, [[encoded[i] for i in g] for g in rows], pad_id)
                out[torch.tensor([i for g in rows for i in g])] = scores.cpu()
            return out if raw else (out - self.mean) / self.std
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # less padding per batch
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            ids, mask = pad_batch([encoded[i] for i in rows], pad_id, "right")
            scores = pooled_scores(self.model, ids.to(self.device), mask.to(self.device), self.pooling)
            out[torch.tensor(rows)] = scores.float().cpu()
        return out if raw else (out - self.mean) / self.std

    def packed(self, prompts: Sequence[str], encoded: list[list[int]], pad_id: int) -> bool:
        """Whether to score packed (:mod:`tether.rm.packing`): ``self.packing`` None (the default) = checked once,
        on the first call's texts, against the padded scores (one line when it falls back); True / False forces."""
        if self.packing is None:
            from tether.rm.packing import packing_fallback

            groups = [[encoded[i] for i in g] for g in prompt_groups(prompts, 8)[0]]
            why_not = packing_fallback(self.model, groups, pad_id, self.pooling)
            if why_not:
                print(f"reward model: packing off ({why_not}); padded rows", file=sys.stderr)
            self.packing = not why_not
        return self.packing

    def set_normalization(self, raw_scores: torch.Tensor, sample: str = "") -> None:
        """Store mean/std (population) of ``raw_scores`` (N,) from the reference sample (A5)."""
        mean, std = raw_scores.double().mean().item(), raw_scores.double().std(unbiased=False).item()
        self.mean, self.std = mean, (std if std > 1e-8 and math.isfinite(std) else 1.0)
        self.metadata["normalization"] = {"mean": self.mean, "std": self.std, "n_responses": int(raw_scores.numel()),
                                          "sample": sample}

    def save_pretrained(self, path: str | Path, extra: dict | None = None) -> None:
        """Write model (safetensors), tokenizer and ``tether_reward.json`` into ``path`` (not atomic: the
        training stage writes into a temporary folder and renames it)."""
        path = Path(path)
        with quiet_transformers():
            self.model.save_pretrained(str(path))
            self.tokenizer.save_pretrained(str(path))
        # the mean/std in use win over any stale copy in the metadata
        norm = {**self.metadata.get("normalization", {}), "mean": self.mean, "std": self.std}
        meta = {"format_version": FORMAT_VERSION, "pooling": self.pooling, "text_format": asdict(self.text_format),
                "normalization": norm}
        meta.update({k: v for k, v in {**self.metadata, **(extra or {})}.items() if k not in meta})
        (path / METADATA_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_reward_dir(path: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | str | None = None) -> RewardModel:
    """The model, tokenizer, text format, scale and metadata of a directory written by ``tether train-rm``
    (outcome or process), on ``device`` (CUDA when there is one); TetherError if it is not one."""
    from tether.presets import resolve_model_path

    path = resolve_model_path(str(path), what="reward model")
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        return foreign_reward_model(path, device, dtype)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        text_format = TextFormat(**meta["text_format"])
        norm = meta["normalization"]
        mean, std = float(norm["mean"]), float(norm["std"])
    except (ValueError, KeyError, TypeError) as e:
        raise TetherError(f"{meta_path}: invalid tether reward metadata ({e})") from None
    tokenizer = load_tokenizer(path, need_pad=False, need_fast=True)
    model, _ = load_sequence_classifier(path, dtype=dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    return RewardModel(model, tokenizer, text_format, meta.get("pooling"), mean, std, meta)


RAW_SCORES_NOTE = ("no {file} (a reward model trained by TRL or another library): scored raw, the head's output as "
                   "it is, not standardised; --reward-normalize batch standardises each batch's scores")


def foreign_reward_model(path: Path, device=None, dtype=None) -> RewardModel:
    """A reward model saved by another library — TRL's ``RewardTrainer`` saves an
    ``AutoModelForSequenceClassification`` with ``num_labels=1`` and its tokenizer, nothing more — scored **raw**
    (mean 0, std 1: z = r), as TRL's trainers use a reward model's logit; one line on stderr says so. Text is
    formatted as TRL's reward trainer formats it: the tokenizer's chat template when it has one, else prompt +
    reply. A directory that is not a one-output sequence classifier is a one-line error saying what it is."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8")) if (path / "config.json").is_file() else {}
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        what = f"a {architectures[0]}" if architectures else "not a model with a classification head"
        raise TetherError(f"{path}: not a reward model (no {METADATA_FILE}, and {what}, not a one-output "
                          f"AutoModelForSequenceClassification); train one with tether train-rm --model {path}")
    tokenizer = load_tokenizer(path, need_pad=False, need_fast=True)
    model, _ = load_sequence_classifier(path, dtype=dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    limit = getattr(tokenizer, "model_max_length", 1024)
    text_format = choose_format(tokenizer, max_length=min(int(limit), 1024) if limit else 1024)
    print(f"reward model {path}: " + RAW_SCORES_NOTE.format(file=METADATA_FILE), file=sys.stderr)
    meta = {"origin": "no tether metadata", "normalization": {"mean": 0.0, "std": 1.0, "sample": "none (raw scores)"}}
    return RewardModel(model, tokenizer, text_format, None, 0.0, 1.0, meta)


class RewardEnsemble:
    """Several reward models as one reward source (A8): the mean or the min of their standardised scores
    (min is the pessimistic choice: a response must please every model)."""

    def __init__(self, models: Sequence[RewardModel], reduce: str = "mean"):
        if not models:
            raise ValueError("RewardEnsemble needs at least one model")
        if reduce not in ("mean", "min"):
            raise ValueError(f"reduce must be 'mean' or 'min', got {reduce!r}")
        self.models, self.reduce = list(models), reduce

    @classmethod
    def from_pretrained(cls, paths: Sequence[str | Path], reduce: str = "mean",
                        device: str | torch.device | None = None) -> "RewardEnsemble":
        return cls([RewardModel.from_pretrained(p, device=device) for p in paths], reduce)

    def scores_per_model(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
                         batch_size: int = 64) -> torch.Tensor:
        """(K, B): every model's scores (their spread is a cheap uncertainty signal)."""
        return torch.stack([m.score(prompts, responses, raw=raw, batch_size=batch_size) for m in self.models])

    def score(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
              batch_size: int = 64) -> torch.Tensor:
        """(B,) float32: mean or min over models of the standardised scores (raw ones with ``raw=True``)."""
        per_model = self.scores_per_model(prompts, responses, raw=raw, batch_size=batch_size)  # (K, B)
        return per_model.mean(0) if self.reduce == "mean" else per_model.min(0).values
