"""Reward models as components: text formatting, last-token pooling, loading, scoring API, ensembles.

A reward model is any Hugging Face ``AutoModelForSequenceClassification`` with one output (A1).

- **Formatting.** ``TextFormat`` turns ``(prompt, reply)`` into token ids the same way in training and in
  scoring: the tokenizer's chat template when it has one (user = prompt, assistant = reply; HH
  transcripts become their Human/Assistant turns), plain concatenation ``prompt + separator + reply``
  otherwise. Too-long texts lose the *start of the prompt* first and the end of the reply only when the
  reply alone does not fit — pairs are never dropped (TRL drops them, and learns "longer wins").
- **Pooling.** Causal LMs: score = head(h_last), h_last the last hidden state at the last position whose
  attention mask is 1. Found from the mask, never by searching for the pad id, so it is right under left,
  right or no padding and when PAD = EOS (HF's own pooling searches for pad_token_id and picks the
  token *before* a final EOS when PAD = EOS). Encoders (BERT-like) keep their own pooling (the logits)
  unless ``mean`` is asked for: score = head(masked mean of the last hidden states), the pooling that
  sentence-embedding encoders (MiniLM) were trained with.
- **Scale (A5).** BT fixes scores only up to a constant, so ``RewardModel`` stores mean/std of raw
  scores on a reference sample and returns z = (r − mean) / std unless ``raw=True``.
- **Ensembles (A8).** ``RewardEnsemble`` reduces standardised scores by mean or min.
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from tether.data import transcript_messages
from tether.errors import TetherError
from tether.hf import check_tokenizer_files, load_errors, quiet_transformers

METADATA_FILE = "tether_reward.json"
FORMAT_VERSION = 1
_SENTINEL = "\u2063TETHER_REPLY\u2063"  # placeholder for the reply when rendering a chat template
HEAD_NAMES = ("score", "classifier", "pre_classifier")  # randomly initialised heads of HF seq-cls models


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

    def render(self, tokenizer, prompt: str, reply: str) -> tuple[str, int, int]:
        """``(text, reply_start, reply_end)``: the full text and the character span of the reply in it."""
        if self.kind == "plain":
            start = len(prompt) + len(self.separator)
            return prompt + self.separator + reply, start, start + len(reply)
        messages = transcript_messages(prompt) or [{"role": "user", "content": prompt}]
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


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both (B, T) with T the longest row; padded on ``side``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(seqs):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------- pooling
POOLINGS = ("last_token", "mean", "model")


def pooling_of(model) -> str:
    """``"last_token"`` for models with a linear ``score`` head on a decoder (GPT-2, Llama, Qwen, …),
    ``"model"`` (the model's own logits, e.g. BERT's [CLS] pooler + classifier) otherwise."""
    head = getattr(unwrap(model), "score", None)
    head = getattr(head, "original_module", head)  # peft's modules_to_save wrapper keeps the original
    return "last_token" if isinstance(head, torch.nn.Linear) else "model"


def linear_head(model):
    """The one-output linear head that ``last_token``/``mean`` pooling feed: ``score`` (decoders) or
    ``classifier`` (BERT-like encoders); None when the model has neither as a plain linear layer."""
    hf = unwrap(model)
    for name in ("score", "classifier"):
        head = getattr(hf, name, None)
        if isinstance(getattr(head, "original_module", head), torch.nn.Linear):
            return head  # the peft wrapper itself when there is one: it routes to the trained copy
    return None


def check_pooling(model, pooling: str) -> str:
    """``pooling`` resolved (``"auto"`` → :func:`pooling_of`) and checked against the model's head."""
    if pooling == "auto":
        return pooling_of(model)
    if pooling not in POOLINGS:
        raise TetherError(f"pooling must be auto or one of {', '.join(POOLINGS)}, got {pooling!r}")
    if pooling != "model" and linear_head(model) is None:
        raise TetherError(f"pooling '{pooling}' needs a linear 'score' or 'classifier' head; "
                          f"{type(unwrap(model)).__name__} has neither (use pooling 'model')")
    return pooling


def unwrap(model):
    """The Hugging Face model inside a peft wrapper (LoRA layers stay injected and active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _accepts(module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def last_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) last hidden states of the backbone without its head; position ids count real tokens only
    (cumsum of the mask) so left padding does not shift positions."""
    body = unwrap(model).base_model  # GPT2Model, LlamaModel, …: the backbone without the head
    kwargs = {}
    if _accepts(body, "position_ids"):
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    if _accepts(body, "use_cache"):
        kwargs["use_cache"] = False
    return body(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def pooled_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Raw scores (B,) float32 of padded rows ``input_ids``/``attention_mask`` (B, T).

    ``last_token``: r = w·h[b, t_b] (+ bias), t_b = the last t with attention_mask[b, t] = 1, so padding on
    either side, or none, gives the same score; position ids count real tokens only (cumsum of the mask)
    so left padding does not shift positions. ``mean``: r = w·(Σ_t m[b,t]·h[b,t] / Σ_t m[b,t]) (+ bias),
    every real token (special ones included, as sentence-transformers does). ``model``: the model's own
    pooled logits.
    """
    if pooling == "model":
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()
    hidden = last_hidden_states(model, input_ids, attention_mask)  # (B, T, H)
    if pooling == "mean":
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)  # (B, H)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        last = (positions * attention_mask).argmax(-1)  # (B,) last position with mask 1
        pooled = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]  # (B, H)
    return linear_head(model)(pooled)[:, 0].float()  # (B,)


# ------------------------------------------------------------------------------------------------ loading
def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    check_tokenizer_files(path)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise TetherError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise TetherError(f"{path}: tether needs a fast tokenizer (tokenizer.json) to locate the reply in the text")
    # TextFormat.encode truncates after tokenising (to keep the reply), so long texts are expected there:
    # mute transformers' one-time "sequence length is longer than the maximum" warning.
    getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def load_sequence_classifier(path: str | Path, *, dtype: torch.dtype | str | None = None, new_head: bool = False):
    """``AutoModelForSequenceClassification`` from a local directory; ``new_head``: one output, a head
    initialised randomly when the checkpoint has none (e.g. a causal LM). Returns ``(model, head_is_new)``."""
    from transformers import AutoModelForSequenceClassification

    kwargs = {"num_labels": 1, "ignore_mismatched_sizes": True} if new_head else {}
    try:
        with quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=dtype, output_loading_info=True, **kwargs)
    except ValueError as e:
        raise TetherError(f"{path}: cannot load as a sequence classifier ({str(e).splitlines()[0]})") from None
    except load_errors() as e:  # missing or corrupt weights (safetensors), a config.json that is not JSON
        raise TetherError(f"{path}: cannot load model weights ({str(e).splitlines()[0]})") from None
    if model.config.num_labels != 1:
        raise TetherError(f"{path}: a reward model has one output, this one has {model.config.num_labels}")
    names = list(info.get("missing_keys", [])) + [m[0] if isinstance(m, tuple) else m
                                                  for m in info.get("mismatched_keys", [])]
    return model, any(n.split(".")[0] in HEAD_NAMES for n in names)


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: str = ""):
    """Wrap ``model`` in peft LoRA (``task_type="SEQ_CLS"``) with the head fully trained
    (``modules_to_save``); all trainable weights cast to fp32 (A6). ``target_modules``: comma list, or ``""``
    for peft's default for the architecture, or ``"all-linear"``."""
    from peft import LoraConfig, get_peft_model

    targets = None if not target_modules else (
        "all-linear" if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",") if t.strip()])
    heads = [n for n in HEAD_NAMES if isinstance(getattr(model, n, None), torch.nn.Module)]
    config = LoraConfig(task_type="SEQ_CLS", r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, modules_to_save=heads)
    try:
        with warnings.catch_warnings():  # peft notes GPT-2's Conv1D layout and a transformers deprecation
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, config)
    except ValueError as e:
        raise TetherError(f"LoRA: {str(e).splitlines()[0]} (set lora.target_modules)") from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


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

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None) -> "RewardModel":
        """Load a directory written by ``tether train-rm``; TetherError if it is not one."""
        from tether.presets import resolve_model_path

        path = resolve_model_path(str(path), what="reward model")
        meta_path = path / METADATA_FILE
        if not meta_path.is_file():
            raise TetherError(f"{path}: not a tether reward model (no {METADATA_FILE})")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            text_format = TextFormat(**meta["text_format"])
            norm = meta["normalization"]
            mean, std = float(norm["mean"]), float(norm["std"])
        except (ValueError, KeyError, TypeError) as e:
            raise TetherError(f"{meta_path}: invalid tether reward metadata ({e})") from None
        tokenizer = load_tokenizer(path)
        model, _ = load_sequence_classifier(path, dtype=dtype)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device).eval()
        return cls(model, tokenizer, text_format, meta.get("pooling"), mean, std, meta)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_process(self) -> bool:
        """A process reward model (A9): one score per step (``score_steps``); ``score`` is their minimum."""
        return self.metadata.get("kind") == "process"

    @property
    def step_separator(self) -> str:
        return self.metadata.get("step_separator", "\n")

    def score_steps(self, prompts: Sequence[str], responses: Sequence[str], raw: bool = False,
                    batch_size: int = 64) -> list[torch.Tensor]:
        """PRMs only: per response, (K,) P(step k is right) for its steps (split at ``step_separator``), the
        logits with ``raw=True``; NaN for a step cut by max_length (:mod:`tether.rm.process`)."""
        from tether.rm.process import score_responses_steps

        if not self.is_process:
            raise TetherError("score_steps() needs a process reward model (trained with train-rm --process)")
        return score_responses_steps(self, prompts, responses, raw=raw, batch_size=batch_size)

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
        if self.is_process:  # the worst step's probability (logit with raw=True): min is monotone in σ
            per_step = self.score_steps(prompts, responses, raw=raw, batch_size=batch_size)
            return torch.stack([s.min() for s in per_step]).float()  # split_steps gives ≥ 1 step
        encoded = [e.ids for e in self.encode(prompts, responses)]
        out = torch.empty(len(encoded), dtype=torch.float32)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # less padding per batch
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            ids, mask = pad_batch([encoded[i] for i in rows], pad_id, "right")
            scores = pooled_scores(self.model, ids.to(self.device), mask.to(self.device), self.pooling)
            out[torch.tensor(rows)] = scores.float().cpu()
        return out if raw else (out - self.mean) / self.std

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
