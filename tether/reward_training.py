"""Stage A: train a Bradley–Terry reward model (``tether train-rm``), top to bottom.

``train_reward_model(cfg)`` reads in the order it runs:

1. load preference pairs (A3) and split them by prompt (held-out prompts are never trained on); with
   ``--dev-fraction`` a dev split is carved from the train pairs and evaluated instead of the held-out ones;
2. load the backbone with a one-output head (A1), optionally LoRA with the head fully trained (A6), and
   the pooling (``auto``, ``last_token``, ``mean``, ``model``);
3. tokenise every pair with the reply kept (the prompt is cut from the left when too long);
4. train with L = −mean log σ(r_w − r_l − m) (A2), plus an optional length regulariser;
5. merge LoRA, then store mean/std of raw scores on a reference sample (A5);
6. evaluate on the held-out pairs (A4) and print the table;
7. write DIR atomically: model + tokenizer + ``tether_reward.json`` + ``config.yaml`` + ``eval.json`` (A7).

``evaluate_pairs(scorer, pairs)`` is reusable with any object that has ``score(prompts, responses, raw=)``.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tether.config import add_config_flags, config_to_dict, option, resolve_config, save_config
from tether.data import PreferencePair, balance_by_length, load_preference_pairs, split_pairs
from tether.errors import ConfigError, TetherError
from tether.losses import bradley_terry_loss
from tether.stats import wilson_interval

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------------------ config
@dataclass
class DataOptions:
    files: list[str] = option([], "preference data file (JSONL, CSV, Parquet, dataset folder); repeatable",
                              flag="--data", repeat=True)
    eval_fraction: float = option(0.2, "share of pairs held out for evaluation (split by prompt)",
                                  low=0.0, low_open=True, high=0.9, flag="--eval-fraction")
    max_length: int = option(512, "max tokens per text; the prompt is cut from the left first", low=4,
                             flag="--max-length")
    format: str = option("auto", "text format: chat template if the tokenizer has one (auto), or forced",
                         choices=("auto", "chat", "plain"), flag="--format")
    separator: str = option("", "text between prompt and reply in the plain format", flag="--separator")
    balance_length: bool = option(False, "train on a subset where chosen-longer and chosen-shorter pairs "
                                  "are equally frequent", flag="--balance-length")
    dev_fraction: float = option(0.0, "carve a dev split (by prompt) of this share from the train pairs, train on "
                                 "the rest and evaluate on it instead of the held-out pairs (to choose settings "
                                 "without looking at the held-out pairs); 0 = off", low=0.0, high=0.9,
                                 flag="--dev-fraction")
    max_pairs: int = option(0, "use only the first N usable pairs (0 = all)", low=0, flag="--max-pairs")
    skip_invalid: bool = option(False, "skip (and count) bad data rows instead of stopping",
                                flag="--skip-invalid")


@dataclass
class OptimOptions:
    lr: float = option(2e-5, "AdamW learning rate", low=0.0, low_open=True, flag="--lr")
    epochs: int = option(1, "passes over the training pairs", low=1, flag="--epochs")
    batch_size: int = option(8, "pairs per forward pass", low=1, flag="--batch-size")
    grad_accum: int = option(1, "forward passes per optimiser step", low=1, flag="--grad-accum")
    weight_decay: float = option(0.0, "AdamW weight decay", low=0.0, flag="--weight-decay")
    warmup_ratio: float = option(0.05, "share of steps with linear warm-up (then linear decay to 0)",
                                 low=0.0, high=1.0, flag="--warmup-ratio")
    max_grad_norm: float = option(1.0, "gradient-norm clip", low=0.0, low_open=True, flag="--max-grad-norm")
    group_by_length: bool = option(False, "batch pairs of similar token length (less padding, same pairs; the "
                                   "batch order stays shuffled)", flag="--group-by-length")


@dataclass
class LoraOptions:
    r: int = option(0, "LoRA rank; 0 = full fine-tune", low=0, flag="--lora-r")
    alpha: float = option(16.0, "LoRA alpha (scale alpha/r)", low=0.0, low_open=True, flag="--lora-alpha")
    dropout: float = option(0.0, "LoRA dropout", low=0.0, high=0.9, flag="--lora-dropout")
    target_modules: str = option("", "comma list of modules, 'all-linear', or empty for peft's default",
                                 flag="--lora-target-modules")


@dataclass
class LossOptions:
    margin: float = option(0.0, "BT margin m in -log sigmoid(r_w - r_l - m)", low=0.0, flag="--margin")
    length_reg: float = option(0.0, "weight of corr(score, reply length)^2 per batch", low=0.0,
                               flag="--length-reg")
    length_expert: bool = option(False, "train on P(chosen) = sigmoid(r_c - r_r + w * (log len_c - log len_r)), "
                                 "w fitted on length alone first and frozen; scores are r alone: the "
                                 "length-controlled preference (keeps every pair, unlike --balance-length)",
                                 flag="--length-expert")


@dataclass
class RewardTrainingConfig:
    """``tether train-rm``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    model: str = option("", "backbone: a local Hugging Face model directory (causal LM or encoder)",
                        flag="--model")
    output_dir: str = option("", "where the reward model is written (atomically)", flag="--output-dir")
    seed: int = option(0, "seed for the split, the head init and the batch order", flag="--seed")
    device: str = option("auto", "auto (cuda if available), cpu, cuda, cuda:N", flag="--device")
    dtype: str = option("float32", "dtype of frozen weights and compute; trainable weights stay fp32",
                        choices=tuple(DTYPES), flag="--dtype")
    pooling: str = option("auto", "text -> one vector for the head: auto (last token for causal LMs, the model's "
                          "own head for encoders), last_token, mean (masked mean of the last hidden states, "
                          "what sentence encoders such as MiniLM were trained for), model",
                          choices=("auto", "last_token", "mean", "model"), flag="--pooling")
    disable_dropout: bool = option(False, "set every dropout probability to 0 during training (as TRL does), so "
                                   "chosen and rejected see the same network", flag="--disable-dropout")
    norm_sample: int = option(1000, "train pairs added to the held-out ones for the score mean/std", low=0,
                              flag="--norm-sample")
    eval_batch_size: int = option(32, "texts per forward pass when scoring", low=1, flag="--eval-batch-size")
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    loss: LossOptions = field(default_factory=LossOptions)

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (a local Hugging Face model directory)")
        if not self.data.files:
            raise ConfigError("--data is required (a preference data file; repeatable)")
        if not self.output_dir:
            raise ConfigError("--output-dir is required")
        try:
            torch.device("cuda" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ConfigError(f"--device: {self.device!r} is not a device (auto, cpu, cuda, cuda:N)") from None


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    add_config_flags(parser, RewardTrainingConfig)


def run(args) -> int:
    cfg = resolve_config(RewardTrainingConfig, args, args.config)
    train_reward_model(cfg)
    return 0


# ------------------------------------------------------------------------------------------------- stage
def train_reward_model(cfg: RewardTrainingConfig, pairs: list[PreferencePair] | None = None):
    """Run Stage A; returns the trained :class:`~tether.reward_model.RewardModel` (also saved in
    ``cfg.output_dir``). ``pairs`` replaces ``cfg.data.files`` (e.g. the demo's generated pairs)."""
    from tether.models import disable_dropout
    from tether.presets import resolve_model_path
    from tether.reward_model import RewardModel, add_lora, check_pooling, choose_format, ensure_pad_token, \
        load_sequence_classifier, load_tokenizer

    started = time.perf_counter()
    torch.manual_seed(cfg.seed)  # the new head's initialisation and dropout
    model_path = resolve_model_path(cfg.model, what="reward model")  # fail fast, before reading data
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))

    # 1. data
    if pairs is None:
        pairs, stats = load_preference_pairs(cfg.data.files, skip_invalid=cfg.data.skip_invalid)
        print(f"data: {stats.summary()}")
    if cfg.data.max_pairs:
        pairs = pairs[: cfg.data.max_pairs]
    train, held_out = split_pairs(pairs, cfg.data.eval_fraction, cfg.seed)
    data_info = {"pairs": len(pairs), "train": len(train), "held_out": len(held_out), "split": "by prompt",
                 "held_out_prompts": len({p.prompt for p in held_out})}
    print(f"split by prompt (seed {cfg.seed}): {len(train)} train pairs, {len(held_out)} held-out pairs "
          f"({data_info['held_out_prompts']} held-out prompts, never trained on)")
    data_info["evaluated_on"] = "held_out"
    if cfg.data.dev_fraction:
        # The held-out pairs are set aside untouched; settings are compared on prompts carved from train.
        train, held_out = split_pairs(train, cfg.data.dev_fraction, cfg.seed)
        data_info.update(evaluated_on="dev", train=len(train), dev=len(held_out))
        print(f"dev split: training on {len(train)} pairs, evaluating on {len(held_out)} dev pairs carved from "
              f"the train side; the {data_info['held_out']} held-out pairs are not used")
    if cfg.data.balance_length:
        n_before = len(train)
        train = balance_by_length(train, cfg.seed)
        data_info["balanced_train"] = len(train)
        print(f"balance-length: kept {len(train)} of {n_before} train pairs (chosen longer = chosen shorter)")

    # 2. model
    tokenizer = load_tokenizer(model_path)
    lora = cfg.lora.r > 0
    model, head_is_new = load_sequence_classifier(
        model_path, dtype=DTYPES[cfg.dtype] if lora else torch.float32, new_head=True)
    ensure_pad_token(tokenizer, model)
    if lora:
        model = add_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    pooling = check_pooling(model, cfg.pooling)
    if cfg.disable_dropout:
        disable_dropout(model)
    model.to(device)
    max_length = clamp_max_length(cfg.data.max_length, model)
    text_format = choose_format(tokenizer, cfg.data.format, cfg.data.separator, max_length)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {model_path} ({type(model).__name__ if not lora else 'LoRA r=' + str(cfg.lora.r)}), "
          f"{n_trainable:,} trainable parameters, head {'new (random init)' if head_is_new else 'from checkpoint'}, "
          f"{text_format.kind} format, max_length {max_length}, {pooling} pooling, device {device}")

    # 3. tokens
    encoded = [(text_format.encode(tokenizer, p.prompt, p.chosen), text_format.encode(tokenizer, p.prompt, p.rejected))
               for p in train]
    texts = [e for pair in encoded for e in pair]
    data_info["prompt_truncated"] = sum(e.prompt_truncated for e in texts)
    data_info["reply_truncated"] = sum(e.reply_truncated for e in texts)
    print(f"truncation: {data_info['prompt_truncated']} of {len(texts)} train texts had the prompt cut from the "
          f"left, {data_info['reply_truncated']} the reply cut; no pair dropped")

    # 4. train
    length_w = None
    if cfg.loss.length_expert:  # fitted once, then frozen: the model learns what length does not explain
        tokens = torch.tensor([[c.n_reply_tokens, r.n_reply_tokens] for c, r in encoded])  # (N, 2)
        length_w = fit_length_expert(log_length_ratio(tokens[:, 0], tokens[:, 1]))
        print(f"length expert: w = {length_w:+.3f} per unit of log length ratio (not in the reward)")
    history = train_loop(model, encoded, cfg, device, tokenizer.pad_token_id, pooling, length_w)

    # 5. a plain model + scale
    if lora:
        model = model.merge_and_unload()
    model.to(DTYPES[cfg.dtype]).eval()
    rm = RewardModel(model, tokenizer, text_format, pooling)
    sample = reference_sample(train, held_out, cfg.norm_sample, cfg.seed)
    raw = rm.score([p for p, _ in sample], [r for _, r in sample], raw=True, batch_size=cfg.eval_batch_size)
    rm.set_normalization(raw, f"chosen and rejected replies of all {len(held_out)} held-out pairs and "
                              f"{len(sample) // 2 - len(held_out)} train pairs")
    print(f"score scale: mean {rm.mean:.4f}, std {rm.std:.4f} on {raw.numel()} reference replies")

    # 6. evaluate
    evaluation = evaluate_pairs(rm, held_out, batch_size=cfg.eval_batch_size)
    evaluation["split"] = data_info["evaluated_on"]
    print(format_evaluation(evaluation))

    # 7. save
    run_info = {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mb": peak_rss_mb(),
                "final_train_loss": history[-1]["loss"] if history else None}
    if length_w is not None:
        run_info["length_expert_w"] = length_w
    if device.type == "cuda":
        run_info["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    rm.metadata.update({"training": config_to_dict(cfg), "data": data_info, "evaluation": evaluation,
                        "run": run_info})
    save_atomically(rm, out_dir, cfg, evaluation)
    print(f"saved {out_dir} in {run_info['seconds']:.1f} s, peak memory {run_info['peak_rss_mb']:.0f} MB RSS")
    return rm


# ---------------------------------------------------------------------------------------------- pieces
def check_output_dir(out_dir: Path) -> None:
    """Refuse to replace a non-empty folder that is not a tether reward model (it is the user's data)."""
    from tether.reward_model import METADATA_FILE

    ours = (out_dir / METADATA_FILE).is_file()
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not ours)):
        raise ConfigError(f"--output-dir {out_dir}: exists and is not a tether reward model; refusing to replace it")


def clamp_max_length(max_length: int, model) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < max_length:
        print(f"note: max_length {max_length} > the model's {limit} positions; using {limit}")
        return limit
    return max_length


def length_penalty(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """corr(s, ℓ)² over the batch's replies: scores (N,), reply lengths in tokens (N,). Zero when no
    length varies; pushes the scores to carry no linear trace of length."""
    s, l = scores - scores.mean(), lengths.float() - lengths.float().mean()
    denom = torch.sqrt((s * s).sum() * (l * l).sum()) + 1e-8
    return ((s * l).sum() / denom) ** 2


def fit_length_expert(log_ratio: torch.Tensor, ridge: float = 1e-3, iterations: int = 50) -> float:
    """The length-only Bradley-Terry model: w = argmax_w sum_i log sigmoid(w * d_i) - ridge/2 * w^2, with
    d_i = log l_chosen - log l_rejected of train pair i (Newton's method; the problem is 1-D and concave;
    the ridge keeps w finite when length separates the pairs)."""
    d = log_ratio.double()
    w = torch.zeros((), dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(-w * d)  # d/dw log sigmoid(w d) = d * sigmoid(-w d)
        grad = (d * p).sum() - ridge * w
        hess = -(d * d * p * (1 - p)).sum() - ridge
        w = w - grad / hess
    return float(w)


def log_length_ratio(reply_tokens_chosen: torch.Tensor, reply_tokens_rejected: torch.Tensor) -> torch.Tensor:
    """log l_c - log l_r per pair, reply lengths in tokens clamped to >= 1 (an empty reply counts as one)."""
    return reply_tokens_chosen.clamp(min=1).float().log() - reply_tokens_rejected.clamp(min=1).float().log()


def length_expert_logit(weight: float, reply_tokens_chosen: torch.Tensor,
                        reply_tokens_rejected: torch.Tensor) -> torch.Tensor:
    """The length expert's share of the pair's logit, w * (log l_c - log l_r). Added to r_c - r_r in
    training only (a product of experts, Shen et al. 2023, with a
    one-parameter expert fitted beforehand by :func:`fit_length_expert`): the length-explained part of a
    preference is carried by w, so the reward model learns the residual, and scoring with r alone is the
    length-controlled preference."""
    return weight * log_length_ratio(reply_tokens_chosen, reply_tokens_rejected)


def pair_batches(lengths: list[int], batch_size: int, generator: torch.Generator, group_by_length: bool
                 ) -> list[list[int]]:
    """One epoch of batches (lists of pair indices), every pair exactly once, in shuffled order.

    ``group_by_length``: shuffle, cut into chunks of 50 batches, sort each chunk by ``lengths`` (the pair's
    longer text, in tokens), cut into batches and shuffle the batches: padding shrinks to the spread
    inside a batch while which pairs meet stays random (Hugging Face's group_by_length does the same).
    """
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    chunk = 50 * batch_size
    order = [i for lo in range(0, len(order), chunk)
             for i in sorted(order[lo:lo + chunk], key=lambda j: -lengths[j])]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]


def train_loop(model, encoded, cfg: RewardTrainingConfig, device: torch.device, pad_id: int,
               pooling: str | None = None, length_w: float | None = None) -> list[dict]:
    """AdamW over shuffled batches of pairs; chosen and rejected of a batch share one forward pass.
    ``encoded``: list of ``(Encoded chosen, Encoded rejected)``; ``length_w``: the frozen length expert's
    weight (:func:`fit_length_expert`), None = plain BT. Returns per-step ``{"loss", "accuracy"}``."""
    from tqdm.auto import tqdm

    from tether.reward_model import pad_batch, pooled_scores, pooling_of

    pooling = pooling or pooling_of(model)
    opt_cfg = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    batches_per_epoch = math.ceil(len(encoded) / opt_cfg.batch_size)
    steps = opt_cfg.epochs * math.ceil(batches_per_epoch / opt_cfg.grad_accum)
    warmup = int(opt_cfg.warmup_ratio * steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: (k + 1) / (warmup + 1) if k < warmup else max(0.0, (steps - k) / max(1, steps - warmup)))
    compute = DTYPES[cfg.dtype]
    autocast = dict(device_type=device.type, dtype=compute, enabled=compute != torch.float32)
    scaler = torch.amp.GradScaler(device.type, enabled=compute == torch.float16)
    generator = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    model.train()
    bar = tqdm(total=steps, desc="train-rm", unit="step", mininterval=1.0)
    pair_tokens = [max(len(c.ids), len(r.ids)) for c, r in encoded]
    for _ in range(opt_cfg.epochs):
        batches = pair_batches(pair_tokens, opt_cfg.batch_size, generator, opt_cfg.group_by_length)
        for first in range(0, len(batches), opt_cfg.grad_accum):
            group = batches[first:first + opt_cfg.grad_accum]
            n_pairs = sum(len(b) for b in group)
            loss_sum = correct = 0.0
            for batch in group:
                chosen, rejected = [encoded[i][0] for i in batch], [encoded[i][1] for i in batch]
                ids, mask = pad_batch([e.ids for e in chosen + rejected], pad_id, "right")  # (2B, T)
                with torch.autocast(**autocast):
                    scores = pooled_scores(model, ids.to(device), mask.to(device), pooling)  # (2B,)
                s_w, s_l = scores[: len(batch)], scores[len(batch):]
                reply_tokens = torch.tensor([e.n_reply_tokens for e in chosen + rejected], device=device)  # (2B,)
                expert = 0.0 if length_w is None else length_expert_logit(
                    length_w, reply_tokens[: len(batch)], reply_tokens[len(batch):])
                loss = bradley_terry_loss(s_w + expert, s_l, cfg.loss.margin or None)
                if cfg.loss.length_reg:
                    loss = loss + cfg.loss.length_reg * length_penalty(scores, reply_tokens)
                # weight by batch size so that accumulation equals one big batch
                scaler.scale(loss * len(batch) / n_pairs).backward()
                loss_sum += loss.item() * len(batch)
                correct += (s_w > s_l).sum().item()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, opt_cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            history.append({"loss": loss_sum / n_pairs, "accuracy": correct / n_pairs})
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", acc=f"{history[-1]['accuracy']:.2f}", refresh=False)
    bar.close()
    return history


def reference_sample(train: list[PreferencePair], held_out: list[PreferencePair], n_train: int, seed: int
                     ) -> list[tuple[str, str]]:
    """(prompt, reply) for the score scale (A5): both replies of every held-out pair and of up to
    ``n_train`` train pairs drawn with ``seed`` — the replies the RM will judge, good and bad alike."""
    chosen_train = random.Random(seed).sample(train, min(n_train, len(train)))
    return [(p.prompt, reply) for p in held_out + chosen_train for reply in (p.chosen, p.rejected)]


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux reports KiB


def save_atomically(rm, out_dir: Path, cfg: RewardTrainingConfig, evaluation: dict) -> None:
    """Write everything into a temporary folder beside ``out_dir``, then swap it in with renames, so a
    crash never leaves a half-written model where a good one was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should look like any folder
    try:
        rm.save_pretrained(tmp)
        save_config(cfg, tmp / "config.yaml")
        (tmp / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n", encoding="utf-8")
        for f in tmp.iterdir():  # some writers create private files; make them like any other file
            os.chmod(f, 0o666 & ~umask)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------- evaluation
def _group(correct: torch.Tensor) -> dict:
    n, k = int(correct.numel()), int(correct.sum())
    low, high = wilson_interval(k, n)
    return {"n": n, "accuracy": k / n if n else None, "wilson_low": low, "wilson_high": high}


def evaluate_pairs(scorer, pairs: list[PreferencePair], batch_size: int = 64) -> dict:
    """Pairwise evaluation (A4) of ``scorer`` (anything with ``score(prompts, responses, raw=)``).

    accuracy = share of pairs with r(chosen) > r(rejected) (ties count as wrong), its Wilson 95% interval
    and whether it excludes 0.5; mean margin E[r_w − r_l] in raw units (σ(margin) is the model's
    P(chosen ≻ rejected)); accuracy when the chosen reply is the longer / the shorter one (characters);
    the share of unequal-length pairs where the model prefers the longer reply, beside the accuracy of
    "always prefer the longer one"; the length-balanced accuracy (the mean of the chosen-longer and
    chosen-shorter accuracies: any rule that looks only at length scores 0.5 on it); accuracy per quartile of
    the longer reply's length.
    """
    if not pairs:
        raise TetherError("no held-out pairs to evaluate")
    prompts = [p.prompt for p in pairs]
    s_w = scorer.score(prompts, [p.chosen for p in pairs], raw=True, batch_size=batch_size)  # (N,)
    s_l = scorer.score(prompts, [p.rejected for p in pairs], raw=True, batch_size=batch_size)  # (N,)
    margin = s_w - s_l
    correct = margin > 0
    len_w = torch.tensor([len(p.chosen) for p in pairs])
    len_l = torch.tensor([len(p.rejected) for p in pairs])
    overall = _group(correct)
    differ = len_w != len_l
    picks_longer = (margin > 0) == (len_w > len_l)
    longest = torch.maximum(len_w, len_l).float()
    edges = torch.quantile(longest, torch.tensor([0.25, 0.5, 0.75])).unique()
    bucket = torch.bucketize(longest, edges, right=False)
    bounds = [float(longest.min()), *edges.tolist(), float(longest.max())]
    result = {
        "n_pairs": overall["n"], "n_correct": int(correct.sum()), "accuracy": overall["accuracy"],
        "wilson_low": overall["wilson_low"], "wilson_high": overall["wilson_high"],
        "excludes_chance": overall["wilson_low"] > 0.5 or overall["wilson_high"] < 0.5,
        "mean_margin": margin.mean().item(), "n_ties": int((margin == 0).sum()),
        "chosen_longer": _group(correct[len_w > len_l]), "chosen_shorter": _group(correct[len_w < len_l]),
        "same_length": _group(correct[~differ]),
        "length_balanced_accuracy": None,
        "prefers_longer": picks_longer[differ].float().mean().item() if differ.any() else None,
        "longer_wins_baseline": (len_w > len_l)[differ].float().mean().item() if differ.any() else None,
        "by_length": [{"chars": [bounds[b], bounds[b + 1]], **_group(correct[bucket == b])}
                      for b in range(len(bounds) - 1) if (bucket == b).any()],
    }
    halves = (result["chosen_longer"]["accuracy"], result["chosen_shorter"]["accuracy"])
    if None not in halves:  # "always longer" and "always shorter" both score exactly 0.5 here
        result["length_balanced_accuracy"] = sum(halves) / 2
    if getattr(scorer, "std", None):
        result["mean_margin_standardised"] = result["mean_margin"] / scorer.std
    return result


def format_evaluation(ev: dict) -> str:
    """The evaluation as a small text table."""
    verdict = ("includes 0.5: not distinguishable from chance" if not ev["excludes_chance"] else
               "excludes 0.5: better than chance" if ev["wilson_low"] > 0.5 else "excludes 0.5: WORSE than chance")

    def row(name: str, g: dict) -> str:
        acc = "   -  " if g["accuracy"] is None else f"{g['accuracy']:.3f}"
        return f"  {name:<22} n={g['n']:<6} accuracy {acc}  [{g['wilson_low']:.3f}, {g['wilson_high']:.3f}]"

    lines = [f"{'dev' if ev.get('split') == 'dev' else 'held-out'} evaluation ({ev['n_pairs']} pairs)",
             f"  accuracy               {ev['accuracy']:.3f}  Wilson 95% [{ev['wilson_low']:.3f}, "
             f"{ev['wilson_high']:.3f}]  interval {verdict}",
             f"  mean margin            {ev['mean_margin']:+.4f} (raw score units)",
             row("chosen is longer", ev["chosen_longer"]), row("chosen is shorter", ev["chosen_shorter"]),
             row("same length", ev["same_length"])]
    if ev.get("length_balanced_accuracy") is not None:
        lines.append(f"  length-balanced        {ev['length_balanced_accuracy']:.3f} (mean of the longer/shorter rows; "
                     f"length alone scores 0.500)")
    if ev["prefers_longer"] is not None:
        lines.append(f"  prefers longer reply   {ev['prefers_longer']:.3f} of unequal-length pairs "
                     f"('always longer' would score {ev['longer_wins_baseline']:.3f})")
    lines.append("  by length of the longer reply (characters):")
    lines += [row(f"  {b['chars'][0]:.0f}-{b['chars'][1]:.0f}", b) for b in ev["by_length"]]
    return "\n".join(lines)
