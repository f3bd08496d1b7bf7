"""Direct preference optimisation (``tether dpo``), top to bottom: the policy learns from the preference pairs
``train-rm`` reads, with no reward model and no sampling.

``train_dpo(cfg)`` reads in the order it runs:

1. load the pairs (:mod:`tether.inputs.pairs`) and split them by prompt (held-out prompts are never trained on);
2. load the policy as ``tether sft`` does (full fine-tune in fp32 masters, or LoRA on a base in ``--dtype``);
3. tokenise each side as SFT tokenises a row (:mod:`tether.dpo.data`): labels on the reply only;
4. the reference π_ref is the starting policy: its reply log-probs of every pair are computed once, before any
   step (``--precompute-ref-log-probs``, the default: no second model in memory); otherwise a frozen copy — or with
   LoRA the same model with its adapter turned off — scores each batch. The held-out pairs' are always computed once;
5. evaluate on the held-out pairs before the first step (the step-0 row);
6. train on L = DPO or IPO loss (:func:`tether.core.preference.dpo_loss`); one row per optimiser step goes to
   ``metrics.jsonl`` with TRL's names (``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
   ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``grad_norm``, ``learning_rate``); checkpoints and
   ``--resume`` as train-rm's (:class:`tether.rm.resume.TrainingProgress`);
7. evaluate on the held-out pairs (implicit-reward preference accuracy with its Wilson interval) and print it;
8. write DIR atomically: the policy (:func:`tether.export.write_policy`) + ``tether_dpo.json`` + ``eval.json`` +
   ``metrics.jsonl`` + ``config.yaml``.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

from tether.callbacks import Callbacks, TrainResult
from tether.checkpoint import atomic_dir, check_finite, refuse_foreign_dir
from tether.config import check_config, config_to_dict, save_config
from tether.core.preference import dpo_loss
from tether.core.stats import wilson_interval
from tether.dpo.config import DPOConfig
from tether.dpo.data import (
    PairExample,
    encode_pairs,
    forward_logps,
    pair_batch,
    score_pairs,
)
from tether.hf import DTYPES
from tether.precision import Precision
from tether.rm.resume import TrainingProgress, data_digest

METADATA_FILE = "tether_dpo.json"
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def train_dpo(cfg: DPOConfig, pairs=None, callbacks: Callbacks | None = None, resume: bool = False) -> TrainResult:
    """Run ``tether dpo``; returns the :class:`~tether.callbacks.TrainResult` (the policy saved in
    ``cfg.output_dir``, its ``model`` the trained model). ``pairs`` replaces ``cfg.data.files``:
    :class:`~tether.inputs.pairs.PreferencePair` s, a ``datasets.Dataset`` or a list of rows; ``resume``: continue
    from the newest checkpoint in ``cfg.output_dir``."""
    from transformers.utils import logging as hf_logging

    from tether.sft.batches import check_packing, packing_layout
    from tether.sft.setup import Given, load_tokenizer_and_model
    from tether.sft.tokens import text_format

    started = time.perf_counter()
    hf_logging.disable_progress_bar()  # tether shows its own progress
    check_config(given_data(cfg, pairs))
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    progress = TrainingProgress(out_dir, cfg, callbacks, resume)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = Precision(DTYPES[cfg.model.dtype], device.type)
    torch.manual_seed(cfg.seed)  # LoRA's initialisation and dropout

    # 1. data
    train, held_out, data_info = load_and_split(cfg, pairs)
    # 2. the policy
    tokenizer, model, name = load_tokenizer_and_model(cfg, Given())
    model.to(device).train()
    fmt = text_format(cfg.data, tokenizer, model, name)
    packing = packing_layout(model, cfg.data.packing)
    if packing is not None:
        check_packing(model, packing, device)
    # 3. tokens
    train_items, data_info["train_tokens"] = encode_pairs(tokenizer, train, fmt)
    held_items, data_info["held_out_tokens"] = encode_pairs(tokenizer, held_out, fmt)
    t = data_info["train_tokens"]
    print(f"tokens: {t['tokens']} in {2 * t['pairs']} train sequences, {t['trained_tokens']} reply tokens; prompt cut "
          f"from the left in {t['prompt_truncated']}, reply cut in {t['response_truncated']} (--max-length "
          f"{cfg.data.max_length}); {'chat' if fmt.use_chat_template else 'plain'} format, packing {packing or 'off'}")
    # 4. the reference
    scorer = Scorer(cfg, model, tokenizer, packing, device, precision)
    reference = Reference(cfg, scorer, train_items)
    held_ref = scorer.reference(held_items)
    # 5. step-0 evaluation
    start = evaluate(scorer, held_items, held_ref, cfg)
    print(format_evaluation(start, "before training"))
    # 6. train
    history = train_loop(scorer, train_items, reference, cfg, progress, lambda: evaluate(scorer, held_items, held_ref,
                                                                                          cfg))
    # 7. evaluate
    final = evaluate(scorer, held_items, held_ref, cfg)
    print(format_evaluation(final, "after training"))
    progress.callbacks("on_evaluate", final)
    # 8. save
    rows = [{"step": 0, **start}] + history
    if history:
        rows[-1] = {**rows[-1], **final}
    run_info = {"steps": len(history), "seconds": round(time.perf_counter() - started, 2),
                "reference": "precomputed" if cfg.precompute_ref_log_probs else
                "adapter disabled" if cfg.model.lora_r else "frozen copy", "stopped": progress.stopped}
    info = {"training": config_to_dict(cfg), "data": data_info, "evaluation": final, "start_evaluation": start,
            "run": run_info}
    save_policy(model, tokenizer, out_dir, cfg, info, rows)
    progress.callbacks("on_save", out_dir)
    print(f"saved {out_dir} in {run_info['seconds']:.1f} s", file=sys.stderr)
    return TrainResult(run_dir=out_dir, metrics=final, models={"policy": out_dir}, steps=len(history),
                       stopped=progress.stopped, model=model)


class DPOTrainer:
    """``tether dpo`` from Python, the command's code path too: ``DPOTrainer(config, pairs).train()``.

    ``config``: a :class:`~tether.dpo.config.DPOConfig`, a dict of its keys (nested, dotted, or TRL's flat names) or
    a YAML path, checked as the command line checks its flags; ``pairs``: data in memory in place of ``data.files``
    (a ``datasets.Dataset``, a list of rows, :class:`~tether.inputs.pairs.PreferencePair` s) or a file's path;
    ``callbacks``: :mod:`tether.callbacks`; ``resume``: continue the unfinished run in ``output_dir``. TRL's names
    too (:func:`tether.trl_compat.arguments.dpo_arguments`: ``args``, ``model`` as a name or path,
    ``train_dataset``; ``ref_model`` must be None: the reference is the starting policy)."""

    def __init__(self, config=None, pairs=None, callbacks=(), resume: bool = False, *, args=None, model=None,
                 ref_model=None, train_dataset=None, eval_dataset=None):
        from tether.trl_compat.arguments import dpo_arguments

        cfg, pairs = dpo_arguments(DPOConfig, config, args, model, ref_model, pairs, train_dataset, eval_dataset)
        self.cfg = check_config(given_data(cfg, pairs))
        self.pairs, self.callbacks, self.resume = pairs, Callbacks(callbacks), resume

    def train(self) -> TrainResult:
        """Train, evaluate on the held-out pairs and save; the result's ``metrics`` are the final evaluation."""
        return train_dpo(self.cfg, self.pairs, self.callbacks, self.resume)


def given_data(cfg: DPOConfig, pairs) -> DPOConfig:
    """``cfg`` with ``data.files`` naming data handed over from Python, when there is some and no file."""
    if pairs is not None and not cfg.data.files:
        cfg.data.files = ["python:pairs"]
    return cfg


# ---------------------------------------------------------------------------------------------- pieces
def check_output_dir(out_dir: Path) -> None:
    """Refuse to replace a non-empty folder that is not a DPO policy or an unfinished DPO run (only
    ``checkpoints/``): it is the user's data."""
    refuse_foreign_dir(out_dir, METADATA_FILE, "a tether dpo run")


def load_and_split(cfg: DPOConfig, pairs) -> tuple[list, list, dict]:
    """Step 1: the pairs, split by prompt into train and held-out, as train-rm reads and splits them (the same
    prompts held out for the same seed); what was read, for the metadata."""
    from tether.rm.train import read_and_split

    return read_and_split(cfg, pairs)


class Scorer:
    """The policy's and the reference's reply log-probs: sums, or per-token means for IPO. The reference is the
    starting policy: with LoRA the same model with its adapter turned off; a full fine-tune scoring the reference
    during training (``precompute_ref_log_probs`` false) keeps a frozen copy made before the first step."""

    def __init__(self, cfg: DPOConfig, model, tokenizer, packing, device, precision):
        self.model, self.tokenizer, self.packing, self.device, self.precision = model, tokenizer, packing, device, \
            precision
        self.average, self.batch_size, self.lora = cfg.loss.loss_type == "ipo", cfg.eval_batch_size, bool(
            cfg.model.lora_r)
        self.frozen = None
        if not cfg.precompute_ref_log_probs and not self.lora:
            self.frozen = copy.deepcopy(model).requires_grad_(False).eval()

    def policy(self, items: list[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen (P,), rejected (P,))`` under the policy as it is, in eval mode, no gradient."""
        return score_pairs(self.model, items, self.tokenizer, self.packing, self.batch_size, self.device,
                           self.precision, self.average)

    def reference(self, items: list[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen (P,), rejected (P,))`` under π_ref, in eval mode, no gradient."""
        return score_pairs(self.frozen or self.model, items, self.tokenizer, self.packing, self.batch_size,
                           self.device, self.precision, self.average, adapter_off=self.lora)

    def train_batch(self, items: list[PairExample]) -> torch.Tensor:
        """(2B,) the policy's log-probs of a training batch (chosen, then rejected), with gradient."""
        batch, segments = pair_batch(items, self.tokenizer, self.packing)
        return forward_logps(self.model, batch, segments, 2 * len(items), self.device, self.precision, self.average)


class Reference:
    """π_ref's log-probs of the training pairs: computed once now (precomputed), or per batch when asked."""

    def __init__(self, cfg: DPOConfig, scorer: Scorer, items: list[PairExample]):
        self.scorer, self.items = scorer, items
        self.table = scorer.reference(items) if cfg.precompute_ref_log_probs else None

    def __call__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.scorer.device
        if self.table is not None:
            return self.table[0][indices].to(device), self.table[1][indices].to(device)
        chosen, rejected = self.scorer.reference([self.items[i] for i in indices])
        return chosen.to(device), rejected.to(device)


def train_loop(scorer: Scorer, items: list[PairExample], reference: Reference, cfg: DPOConfig,
               progress: TrainingProgress, evaluate_now) -> list[dict]:
    """Step 6: AdamW over shuffled batches of pairs, ``optim.grad_accumulation`` batches per optimiser step;
    ``evaluate_now()``: the held-out figures, added to every ``eval_every``-th row. Returns one row per step."""
    from tether.inputs.splits import shuffled_batches
    from tether.rm.train import optimizer_step
    from tether.runlog import StepProgress
    from tether.sft.setup import make_optimisation

    o, model = cfg.optim, scorer.model
    steps = o.epochs * math.ceil(math.ceil(len(items) / o.batch_size) / o.grad_accumulation)
    params, optimizer, scheduler, scaler = make_optimisation(cfg, model, steps, scorer.precision)
    generator = torch.Generator().manual_seed(cfg.seed)
    history = progress.restore(model, optimizer, scheduler, scaler, generator,
                               data_digest([(p.chosen, p.rejected) for p in items]))
    model.train()
    bar = StepProgress("dpo", steps, len(history), cfg.progress, mininterval=1.0)
    for epoch in range(progress.epoch, o.epochs):
        epoch_generator = generator.get_state()  # a checkpoint in this epoch draws its batches again from here
        batches = shuffled_batches([p.length for p in items], o.batch_size, generator, False)
        for first in range(progress.first_batch(epoch), len(batches), o.grad_accumulation):
            group = batches[first:first + o.grad_accumulation]
            n_pairs = sum(len(b) for b in group)
            sums = dict.fromkeys(("loss", *FIGURES), 0.0)
            for batch in group:
                logps = scorer.train_batch([items[i] for i in batch])  # (2B,)
                loss, stats = dpo_loss(logps[:len(batch)], logps[len(batch):], *reference(batch), cfg.loss.beta,
                                       cfg.loss.loss_type, cfg.loss.label_smoothing)
                # each batch's mean weighted by its share of the step's pairs: the step's gradient is that of the
                # mean over all its pairs however they are cut into batches
                scaler.scale(loss * len(batch) / n_pairs).backward()
                for key, value in (("loss", loss.detach()), *stats.items()):
                    sums[key] += value.item() * len(batch)
            grad_norm, lr = optimizer_step(params, optimizer, scheduler, scaler, o.max_grad_norm or math.inf)
            row = {"step": len(history) + 1, "epoch": epoch + 1, **{k: v / n_pairs for k, v in sums.items()},
                   "grad_norm": grad_norm, "learning_rate": lr}
            if cfg.eval_every and row["step"] % cfg.eval_every == 0 and row["step"] < steps:
                row.update(evaluate_now())  # eval mode, no gradient, no random draws: the run is unchanged by it
            history.append(row)
            bar.update(loss=f"{row['loss']:.4f}", acc=f"{row['rewards/accuracies']:.2f}",
                       margin=f"{row['rewards/margins']:+.3f}")
            if progress.step_done(history, epoch, first + o.grad_accumulation, epoch_generator,
                                  (model, optimizer, scheduler, scaler)):
                break
        if progress.stopped:
            break
    bar.close()
    return history


def evaluate(scorer: Scorer, items: list[PairExample], ref: tuple[torch.Tensor, torch.Tensor], cfg: DPOConfig
             ) -> dict:
    """The held-out figures of the policy as it is (TRL's names under ``eval/``): the loss, the implicit rewards,
    the preference accuracy (chosen reward strictly higher; ties count as wrong) with its Wilson 95% interval."""
    chosen, rejected = scorer.policy(items)
    loss, stats = dpo_loss(chosen, rejected, *ref, cfg.loss.beta, cfg.loss.loss_type, cfg.loss.label_smoothing)
    margins = cfg.loss.beta * ((chosen - ref[0]) - (rejected - ref[1]))  # (P,)
    n, k = len(items), int((margins > 0).sum())
    low, high = wilson_interval(k, n)
    # eval/accuracy: the held-out preference accuracy under the name train-rm's verdict and the pipeline read
    return {"eval/loss": loss.item(), **{f"eval/{key}": v.item() for key, v in stats.items()}, "eval/accuracy": k / n,
            "eval/pairs": n, "eval/ties": int((margins == 0).sum()), "eval/accuracy_low": low,
            "eval/accuracy_high": high}


def format_evaluation(ev: dict, when: str) -> str:
    """One line: the held-out preference accuracy, its interval and verdict, the margin."""
    low, high = ev["eval/accuracy_low"], ev["eval/accuracy_high"]
    verdict = ("every pair a tie: the policy is still the reference" if ev["eval/ties"] == ev["eval/pairs"] else
               "better than chance" if low > 0.5 else "WORSE than chance" if high < 0.5 else
               "not distinguishable from chance")
    return (f"held-out preference accuracy {when}: {ev['eval/rewards/accuracies']:.3f} Wilson 95% [{low:.3f}, "
            f"{high:.3f}] on {ev['eval/pairs']} pairs ({verdict}); margin {ev['eval/rewards/margins']:+.4f}, "
            f"loss {ev['eval/loss']:.4f}" + (f"; {ev['eval/ties']} ties" if ev["eval/ties"] else ""))


def save_policy(model, tokenizer, out_dir: Path, cfg: DPOConfig, info: dict, rows: list[dict]) -> None:
    """Step 8: the policy and the run's files into a temporary folder beside ``out_dir``, swapped in by rename
    (:func:`~tether.checkpoint.atomic_dir`): a crash never leaves a half-written policy (nor its checkpoints gone)."""
    from tether.export import write_policy

    check_finite(model, str(out_dir))  # refused (one line) if a weight is NaN/Inf

    def write(tmp: Path) -> None:
        write_policy(tmp, model, tokenizer, cfg.model.export_lora, cfg.model.dtype)
        save_config(cfg, tmp / "config.yaml")
        (tmp / METADATA_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        (tmp / "eval.json").write_text(json.dumps(info["evaluation"], indent=1) + "\n", encoding="utf-8")
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    atomic_dir(out_dir, write)
