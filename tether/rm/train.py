"""Stage A: train a Bradley–Terry reward model (``tether train-rm``), top to bottom.

``train_reward_model(cfg)`` reads in the order it runs:

1. load preference pairs (A3) and split them by prompt (held-out prompts are never trained on); with
   ``--dev-fraction`` a dev split is carved from the train pairs and evaluated instead of the held-out ones;
2. load the backbone with a one-output head (A1), optionally LoRA with the head fully trained (A6), and
   the pooling (``auto``, ``last_token``, ``mean``, ``model``);
3. tokenise every pair with the reply kept (the prompt is cut from the left when too long);
4. train with L = −mean log σ(r_w − r_l − m) (A2), plus an optional length regulariser or length expert;
   one row per optimiser step goes to ``metrics.jsonl`` (``rm/loss``, ``rm/accuracy``, ``rm/grad_norm``,
   ``rm/lr``), which ``tether report`` plots;
5. merge LoRA, then store mean/std of raw scores on a reference sample (A5);
6. evaluate on the held-out pairs (A4, :mod:`tether.rm.evaluate`) and print the table;
7. write DIR atomically: model + tokenizer + ``tether_reward.json`` + ``config.yaml`` + ``eval.json`` +
   ``metrics.jsonl`` (A7).
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from pathlib import Path

import torch

from tether.checkpoint import atomic_dir
from tether.callbacks import Callbacks
from tether.config import check_config, config_to_dict, save_config
from tether.core.length import fit_length_expert, length_expert_logit, length_penalty, log_length_ratio
from tether.core.losses import bradley_terry_loss
from tether.errors import DataError
from tether.hf import DTYPES
from tether.inputs.conversations import prompt_key
from tether.inputs.pairs import (  # noqa: F401 - PreferencePair: this module's API before the move
    PreferencePair, balance_by_length, balance_by_reply, load_preference_pairs, pairs_from_data, split_pairs)
from tether.inputs.splits import shuffled_batches as pair_batches  # noqa: F401 - this module's API before the move
from tether.rm.config import RewardTrainingConfig
from tether.rm.evaluate import evaluate_pairs, format_evaluation
from tether.rm.resume import TrainingProgress, data_digest


def train_reward_model(cfg: RewardTrainingConfig, pairs=None, callbacks: Callbacks | None = None,
                       resume: bool = False):
    """Run Stage A; returns the trained :class:`~tether.rm.model.RewardModel` (also saved in
    ``cfg.output_dir``). ``pairs`` replaces ``cfg.data.files``: :class:`PreferencePair` s (e.g. the demo's
    generated pairs), a ``datasets.Dataset`` or a list of rows (:func:`tether.inputs.pairs.pairs_from_data`).
    ``resume``: continue from the newest checkpoint in ``cfg.output_dir`` (:mod:`tether.rm.resume`)."""
    from tether.presets import resolve_model_path
    from tether.rm.model import RewardModel

    started = time.perf_counter()
    check_config(given_data(cfg, pairs))
    torch.manual_seed(cfg.seed)  # the new head's initialisation and dropout
    model_path = resolve_model_path(cfg.model, what="reward model")  # fail fast, before reading data
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    progress = TrainingProgress(out_dir, cfg, callbacks, resume)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))

    # 1. data
    train, held_out, data_info = load_and_split(cfg, pairs)
    # 2. model
    model, tokenizer, text_format, pooling = load_model(cfg, model_path, device)
    # 3. tokens
    encoded = encode_pairs(train, tokenizer, text_format, data_info)
    # 4. train
    length_w = None
    if cfg.loss.length_expert:  # fitted once, then frozen: the model learns what length does not explain
        tokens = torch.tensor([[c.n_reply_tokens, r.n_reply_tokens] for c, r in encoded])  # (N, 2)
        length_w = fit_length_expert(log_length_ratio(tokens[:, 0], tokens[:, 1]))
        print(f"length expert: w = {length_w:+.3f} per unit of log length ratio (not in the reward)")
    history = train_loop(model, encoded, cfg, device, tokenizer.pad_token_id, pooling, length_w, progress)

    # 5. a plain model + scale
    if cfg.lora.r > 0:
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
    progress.callbacks("on_evaluate", evaluation)

    # 7. save
    run_info = {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mb": peak_rss_mb(),
                "final_train_loss": history[-1]["rm/loss"] if history else None, "steps": len(history)}
    if length_w is not None:
        run_info["length_expert_w"] = length_w
    if device.type == "cuda":
        run_info["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if progress.stopped:
        run_info["stopped"] = progress.stopped
    rm.metadata.update({"training": config_to_dict(cfg), "data": data_info, "evaluation": evaluation,
                        "run": run_info})
    save_reward_model(rm, out_dir, cfg, evaluation, history)
    progress.callbacks("on_save", out_dir)
    print(f"saved {out_dir} in {run_info['seconds']:.1f} s, peak memory {run_info['peak_rss_mb']:.0f} MB RSS")
    return rm


def given_data(cfg: RewardTrainingConfig, pairs) -> RewardTrainingConfig:
    """``cfg`` with ``data.files`` naming data handed over from Python, when there is some and no file."""
    if pairs is not None and not cfg.data.files:
        cfg.data.files = ["python:pairs"]
    return cfg


# ---------------------------------------------------------------------------------------------- pieces
def check_output_dir(out_dir: Path) -> None:
    """Refuse to replace a non-empty folder that is not a tether reward model or an unfinished training run
    (only ``checkpoints/``): it is the user's data."""
    from tether.checkpoint import refuse_foreign_dir
    from tether.rm.model import METADATA_FILE

    refuse_foreign_dir(out_dir, METADATA_FILE, "a tether reward model")


def read_and_split(cfg, pairs) -> tuple[list[PreferencePair], list[PreferencePair], dict]:
    """The pairs of ``cfg.data.files`` (or ``pairs`` handed over from Python), the first ``data.max_pairs``, split
    by prompt into train and held-out; what was read, for the metadata. Step 1 of train-rm and of tether dpo
    (``cfg``: either's config; both name these fields alike)."""
    source = ", ".join(cfg.data.files) if pairs is None else "the given pairs"
    if pairs is None:
        pairs, stats = load_preference_pairs(cfg.data.files, skip_invalid=cfg.data.skip_invalid)
    else:
        pairs, stats = pairs_from_data(pairs, "pairs", skip_invalid=cfg.data.skip_invalid)
    print(f"data: {stats.summary()}")
    if cfg.data.max_pairs:
        pairs = pairs[: cfg.data.max_pairs]
    train, held_out = split_pairs(pairs, cfg.data.eval_fraction, cfg.seed)
    if not held_out or not train:
        raise DataError(f"{source}: {len(pairs)} usable pair(s) over {len({prompt_key(p.prompt) for p in pairs})} "
                        f"prompt(s) are too few to split into train and held-out pairs by prompt (eval fraction "
                        f"{cfg.data.eval_fraction}); give pairs for at least two different prompts")
    info = {"read": stats.summary(), "pairs": len(pairs), "train": len(train), "held_out": len(held_out),
            "held_out_prompts": len({prompt_key(p.prompt) for p in held_out}), "split": "by prompt"}
    print(f"split by prompt (seed {cfg.seed}): {len(train)} train pairs, {len(held_out)} held-out pairs "
          f"({info['held_out_prompts']} held-out prompts, never trained on)")
    return train, held_out, info


def load_and_split(cfg: RewardTrainingConfig, pairs: list[PreferencePair] | None
                   ) -> tuple[list[PreferencePair], list[PreferencePair], dict]:
    """Step 1: the pairs, split by prompt into train and held-out (or dev); what was done, for the metadata."""
    source = ", ".join(cfg.data.files) if pairs is None else "the given pairs"
    train, held_out, data_info = read_and_split(cfg, pairs)
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
        if not train:  # every pair's chosen is longer (or every one's shorter): nothing is left to train on
            raise DataError(f"{source}: --balance-length kept no pair: the chosen reply is longer in all {n_before} "
                            "train pairs or shorter in all of them, and none has equal lengths; use --length-expert "
                            "or --length-reg to control length instead")
    if cfg.data.balance_replies:
        n_before = len(train)
        train = balance_by_reply(train, cfg.seed)
        data_info["reply_balanced_train"] = len(train)
        print(f"balance-replies: kept {len(train)} of {n_before} train pairs over "
              f"{len({prompt_key(p.prompt) for p in train})} prompts (each reply text chosen as often as rejected)")
        if not train:
            raise DataError(f"{source}: --balance-replies kept no pair: no reply text is both chosen and rejected")
    return train, held_out, data_info


def load_model(cfg: RewardTrainingConfig, model_path: Path, device: torch.device):
    """Step 2: backbone + one-output head (LoRA with the head fully trained when ``lora.r`` > 0), its
    tokenizer, the text format and the pooling. Returns ``(model, tokenizer, text_format, pooling)``."""
    from tether.hf import apply_lora, disable_dropout, ensure_pad_token, load_tokenizer
    from tether.rm.backbone import check_pooling, head_modules, load_sequence_classifier
    from tether.rm.model import choose_format

    tokenizer = load_tokenizer(model_path, need_pad=False, need_fast=True)
    lora = cfg.lora.r > 0
    model, head_is_new = load_sequence_classifier(
        model_path, dtype=DTYPES[cfg.dtype] if lora else torch.float32, new_head=True)
    ensure_pad_token(tokenizer, model)
    if cfg.disable_dropout:  # the backbone's dropout; a LoRA adapter's own (--lora-dropout) is added after, as set
        disable_dropout(model)
    if lora:
        model = apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules,
                           task_type="SEQ_CLS", modules_to_save=head_modules(model))
    pooling = check_pooling(model, cfg.pooling)
    model.to(device)
    max_length = clamp_max_length(cfg.data.max_length, model)
    # a PRM's text is plain (prompt + separator + steps): its read-out tokens are the steps' separators
    text_format = choose_format(tokenizer, "plain" if cfg.process else cfg.data.format, cfg.data.separator,
                                max_length)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {model_path} ({type(model).__name__ if not lora else 'LoRA r=' + str(cfg.lora.r)}), "
          f"{n_trainable:,} trainable parameters, head {'new (random init)' if head_is_new else 'from checkpoint'}, "
          f"{text_format.kind} format, max_length {max_length}, {pooling} pooling, device {device}")
    return model, tokenizer, text_format, pooling


def encode_pairs(train: list[PreferencePair], tokenizer, text_format, data_info: dict) -> list[tuple]:
    """Step 3: ``(Encoded chosen, Encoded rejected)`` per train pair; truncation counts go to ``data_info``."""
    encoded = [(text_format.encode(tokenizer, p.prompt, p.chosen), text_format.encode(tokenizer, p.prompt, p.rejected))
               for p in train]
    texts = [e for pair in encoded for e in pair]
    data_info["prompt_truncated"] = sum(e.prompt_truncated for e in texts)
    data_info["reply_truncated"] = sum(e.reply_truncated for e in texts)
    print(f"truncation: {data_info['prompt_truncated']} of {len(texts)} train texts had the prompt cut from the "
          f"left, {data_info['reply_truncated']} the reply cut; no pair dropped")
    return encoded


def clamp_max_length(max_length: int, model) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < max_length:
        print(f"note: max_length {max_length} > the model's {limit} positions; using {limit}")
        return limit
    return max_length


def pair_loss(model, chosen: list, rejected: list, cfg: RewardTrainingConfig, device: torch.device, pad_id: int,
              pooling: str, length_w: float | None, autocast: dict, packed: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """BT loss of one batch of pairs (A2; plus the length regulariser or expert when configured); chosen
    and rejected share one forward pass (``packed``: one packed unit a pair). Returns ``(loss, margins (B,)
    detached)``."""
    from tether.rm.backbone import pad_batch, pooled_scores
    from tether.rm.packing import packed_pair_scores

    n = len(chosen)
    with torch.autocast(**autocast):
        if packed:  # each pair's prompt once (tether.rm.packing): the same scores
            scores = packed_pair_scores(model, [e.ids for e in chosen], [e.ids for e in rejected], pad_id)  # (2B,)
        else:
            ids, mask = pad_batch([e.ids for e in chosen + rejected], pad_id, "right")  # (2B, T)
            scores = pooled_scores(model, ids.to(device), mask.to(device), pooling)  # (2B,)
    s_w, s_l = scores[:n], scores[n:]
    reply_tokens = torch.tensor([e.n_reply_tokens for e in chosen + rejected], device=device)  # (2B,)
    expert = 0.0 if length_w is None else length_expert_logit(length_w, reply_tokens[:n], reply_tokens[n:])
    loss = bradley_terry_loss(s_w + expert, s_l, cfg.loss.margin or None)
    if cfg.loss.length_reg:
        loss = loss + cfg.loss.length_reg * length_penalty(scores, reply_tokens)
    return loss, (s_w - s_l).detach()


def optimisation(model, cfg: RewardTrainingConfig, n_items: int, device: torch.device) -> tuple:
    """``(params, optimizer, scheduler, autocast kwargs, scaler, steps)`` for ``n_items`` training items: AdamW
    on the trainable parameters, linear warm-up over ``optim.warmup_ratio`` of the steps then linear decay
    to 0, autocast in ``cfg.dtype`` (a loss scaler for fp16)."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    steps = o.epochs * math.ceil(math.ceil(n_items / o.batch_size) / o.grad_accumulation)
    warmup = int(o.warmup_ratio * steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: (k + 1) / (warmup + 1) if k < warmup else max(0.0, (steps - k) / max(1, steps - warmup)))
    compute = DTYPES[cfg.dtype]
    autocast = {"device_type": device.type, "dtype": compute, "enabled": compute != torch.float32}
    scaler = torch.amp.GradScaler(device.type, enabled=compute == torch.float16)
    return params, optimizer, scheduler, autocast, scaler, steps


def optimizer_step(params, optimizer, scheduler, scaler, max_grad_norm: float) -> tuple[float, float]:
    """Unscale, clip the gradient norm, step (skipped by the fp16 scaler on inf/NaN), zero the gradients and
    advance the schedule. Returns ``(grad_norm before clipping, the lr this step used)``."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return float(grad_norm), lr


def train_loop(model, encoded, cfg: RewardTrainingConfig, device: torch.device, pad_id: int,
               pooling: str | None = None, length_w: float | None = None,
               progress: TrainingProgress | None = None) -> list[dict]:
    """AdamW over shuffled batches of pairs, ``optim.grad_accumulation`` batches per optimiser step.
    ``encoded``: list of ``(Encoded chosen, Encoded rejected)``; ``length_w``: the frozen length expert's
    weight (:func:`~tether.core.length.fit_length_expert`), None = plain BT; ``progress``: checkpoints,
    resume and callbacks (:class:`~tether.rm.resume.TrainingProgress`). Returns one metrics row per
    optimiser step (``step``, ``epoch``, ``rm/loss``, ``rm/accuracy``, ``rm/grad_norm``, ``rm/lr``)."""
    from tether.runlog import StepProgress

    from tether.rm.backbone import pooling_of

    pooling = pooling or pooling_of(model)
    opt_cfg = cfg.optim
    params, optimizer, scheduler, autocast, scaler, steps = optimisation(model, cfg, len(encoded), device)
    generator = torch.Generator().manual_seed(cfg.seed)
    progress = progress or TrainingProgress(None, cfg)
    history = progress.restore(model, optimizer, scheduler, scaler, generator, data_digest(encoded))
    packed = cfg.data.packing and packing_on(model, encoded, pad_id, pooling)
    model.train()
    bar = StepProgress("train-rm", steps, len(history), mininterval=1.0)
    pair_tokens = [max(len(c.ids), len(r.ids)) for c, r in encoded]
    for epoch in range(progress.epoch, opt_cfg.epochs):
        epoch_generator = generator.get_state()  # a checkpoint in this epoch draws its batches again from here
        batches = pair_batches(pair_tokens, opt_cfg.batch_size, generator, opt_cfg.group_by_length)
        for first in range(progress.first_batch(epoch), len(batches), opt_cfg.grad_accumulation):
            group = batches[first:first + opt_cfg.grad_accumulation]
            n_pairs = sum(len(b) for b in group)
            loss_sum = correct = 0.0
            for batch in group:
                loss, margins = pair_loss(model, [encoded[i][0] for i in batch], [encoded[i][1] for i in batch],
                                          cfg, device, pad_id, pooling, length_w, autocast, packed)
                # Each batch's mean loss weighted by its share of the step's pairs: the accumulated gradient
                # is that of the mean over all the step's pairs, however they are cut into batches.
                scaler.scale(loss * len(batch) / n_pairs).backward()
                loss_sum += loss.item() * len(batch)
                correct += (margins > 0).sum().item()
            grad_norm, lr = optimizer_step(params, optimizer, scheduler, scaler, opt_cfg.max_grad_norm)
            history.append({"step": len(history) + 1, "epoch": epoch + 1, "rm/loss": loss_sum / n_pairs,
                            "rm/accuracy": correct / n_pairs, "rm/grad_norm": float(grad_norm), "rm/lr": lr})
            bar.update(loss=f"{history[-1]['rm/loss']:.4f}", acc=f"{history[-1]['rm/accuracy']:.2f}")
            if progress.step_done(history, epoch, first + opt_cfg.grad_accumulation, epoch_generator,
                                  (model, optimizer, scheduler, scaler)):
                break
        if progress.stopped:
            break
    bar.close()
    return history


def packing_on(model, encoded, pad_id: int, pooling: str) -> bool:
    """Whether packed pairs give this model's padded scores (:func:`tether.rm.packing.packing_fallback`), with one
    line either way."""
    from tether.rm.packing import packing_fallback

    why_not = packing_fallback(model, [[c.ids, r.ids] for c, r in encoded[:4]], pad_id, pooling) if encoded \
        else "no pairs"
    print("packing: each pair's prompt once (checked against padded scores)" if not why_not
          else f"packing off: {why_not}; padded rows")
    return not why_not


def reference_sample(train: list[PreferencePair], held_out: list[PreferencePair], n_train: int, seed: int
                     ) -> list[tuple[str, str]]:
    """(prompt, reply) for the score scale (A5): both replies of every held-out pair and of up to
    ``n_train`` train pairs drawn with ``seed`` — the replies the RM will judge, good and bad alike."""
    chosen_train = random.Random(seed).sample(train, min(n_train, len(train)))
    return [(p.prompt, reply) for p in held_out + chosen_train for reply in (p.chosen, p.rejected)]


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux reports KiB


def save_reward_model(rm, out_dir: Path, cfg: RewardTrainingConfig, evaluation: dict, history: list[dict]) -> None:
    """Step 7: everything into a temporary folder beside ``out_dir``, swapped in by rename
    (:func:`~tether.checkpoint.atomic_dir`), so a crash never leaves a half-written model where a good one was."""

    def write(tmp: Path) -> None:
        rm.save_pretrained(tmp)
        save_config(cfg, tmp / "config.yaml")
        (tmp / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n", encoding="utf-8")
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history), encoding="utf-8")

    atomic_dir(out_dir, write)
