"""``tether train-rm --process``: train a process reward model (A9), top to bottom.

1. load step-labelled rows (:mod:`tether.rm.steps`) and split them by prompt (held-out prompts are never
   trained on);
2. load the backbone with a one-output head, as for an outcome RM (LoRA too);
3. tokenise ``prompt + Σ (step + separator)`` with the read-out position of every step
   (:func:`tether.rm.process.encode_steps`);
4. train with per-step binary cross-entropy (:func:`tether.core.steps.step_bce_loss`); one row per
   optimiser step to ``metrics.jsonl`` (``rm/loss``, ``rm/accuracy`` = step accuracy, ``rm/grad_norm``,
   ``rm/lr``);
5. evaluate on the held-out rows: step accuracy with its Wilson interval, accuracy on good and bad steps,
   first-error accuracy, within-prompt accuracy (all-good responses ranked over flawed ones to the same
   prompt) (:func:`tether.rm.process.evaluate_steps`);
6. write DIR atomically, loadable by ``ProcessRewardModel.from_pretrained`` (``score_steps``), with
   ``"kind": "process"`` and the separator in ``tether_reward.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tether.callbacks import Callbacks
from tether.config import check_config, config_to_dict
from tether.core.steps import step_bce_loss
from tether.inputs.pairs import split_pairs
from tether.inputs.records import python_records
from tether.errors import DataError
from tether.hf import DTYPES
from tether.rm.config import RewardTrainingConfig
from tether.rm.process import (ProcessRewardModel, batch_tensors, encode_steps, evaluate_steps,
                               format_step_evaluation, step_logits)
from tether.rm.resume import TrainingProgress, data_digest
from tether.rm.steps import StepExample, example_from_record, load_step_examples
from tether.rm.train import (check_output_dir, given_data, load_model, optimisation, optimizer_step, pair_batches,
                             peak_rss_mb, save_reward_model)


def train_process_reward_model(cfg: RewardTrainingConfig, examples=None, callbacks: Callbacks | None = None,
                               resume: bool = False):
    """Run ``train-rm --process``; returns the trained :class:`~tether.rm.process.ProcessRewardModel` (also
    saved in ``cfg.output_dir``). ``examples`` replaces ``cfg.data.files``: :class:`StepExample` s (e.g. the step
    task's labelled samples), or rows in memory (a ``datasets.Dataset``, a list of dicts) in the files' shapes.
    ``resume``: continue from the newest checkpoint in ``cfg.output_dir`` (:mod:`tether.rm.resume`)."""
    from tether.presets import resolve_model_path
    from tether.rm.model import RewardModel

    started = time.perf_counter()
    check_config(given_data(cfg, examples))
    torch.manual_seed(cfg.seed)
    model_path = resolve_model_path(cfg.model, what="reward model")
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    progress = TrainingProgress(out_dir, cfg, callbacks, resume)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    separator = cfg.step_separator

    # 1. data, split by prompt
    source = ", ".join(cfg.data.files) if examples is None else "the given examples"
    if examples is not None and not all(isinstance(e, StepExample) for e in examples):
        examples = [example_from_record(r, f"pairs: row {n}", separator) for n, r in python_records(examples, "pairs")]
    if examples is None:
        examples, counts = load_step_examples(cfg.data.files, separator, skip_invalid=cfg.data.skip_invalid)
        print(f"data: {counts['examples']} step-labelled responses ({counts['steps']} steps, {counts['good_steps']} "
              f"good) from {counts['rows']} rows, {counts['invalid']} invalid skipped")
    if cfg.data.max_pairs:
        examples = examples[: cfg.data.max_pairs]
    train, held_out = split_pairs(examples, cfg.data.eval_fraction, cfg.seed)
    if not train or not held_out:
        raise DataError(f"{source}: {len(examples)} response(s) over {len({e.prompt for e in examples})} prompt(s) "
                        f"are too few to split into train and held-out rows by prompt")
    print(f"split by prompt (seed {cfg.seed}): {len(train)} train responses, {len(held_out)} held-out responses")
    # 2. model
    model, tokenizer, text_format, pooling = load_model(cfg, model_path, device)
    if pooling != "last_token":
        raise DataError(f"{model_path}: --process needs a model with a linear 'score' head on a decoder "
                        f"(got {pooling} pooling)")
    # 3. tokens
    encoded = [encode_steps(tokenizer, e.prompt, e.steps, separator, text_format.separator, text_format.max_length)
               for e in train]
    cut = sum(pos is None for e in encoded for pos in e.positions)
    print(f"truncation: {sum(e.prompt_truncated for e in encoded)} of {len(encoded)} train texts had the prompt "
          f"cut; {cut} steps past max_length {text_format.max_length} left out of the loss")
    # 4. train
    history = train_steps_loop(model, encoded, [e.labels for e in train], cfg, device, tokenizer.pad_token_id,
                               progress)
    if cfg.lora.r > 0:
        model = model.merge_and_unload()
    model.to(DTYPES[cfg.dtype]).eval()
    rm = ProcessRewardModel(RewardModel(model, tokenizer, text_format, pooling, metadata={
        "kind": "process", "step_separator": separator, "aggregation": "min"}))
    # 5. evaluate
    probs = rm.score_step_lists([e.prompt for e in held_out], [e.steps for e in held_out],
                                batch_size=cfg.eval_batch_size)
    evaluation = evaluate_steps(probs, [e.labels for e in held_out], [e.prompt for e in held_out])
    print(format_step_evaluation(evaluation))
    progress.callbacks("on_evaluate", evaluation)
    # 6. save
    run_info = {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mb": peak_rss_mb(),
                "final_train_loss": history[-1]["rm/loss"] if history else None, "steps": len(history),
                **({"stopped": progress.stopped} if progress.stopped else {})}
    rm.metadata.update({"training": config_to_dict(cfg), "evaluation": evaluation, "run": run_info,
                        "data": {"train": len(train), "held_out": len(held_out), "split": "by prompt"}})
    save_reward_model(rm, out_dir, cfg, evaluation, history)
    progress.callbacks("on_save", out_dir)
    print(f"saved {out_dir} in {run_info['seconds']:.1f} s, peak memory {run_info['peak_rss_mb']:.0f} MB RSS")
    return rm


def train_steps_loop(model, encoded, labels: list[list[int]], cfg: RewardTrainingConfig, device: torch.device,
                     pad_id: int, progress: TrainingProgress | None = None) -> list[dict]:
    """AdamW over shuffled batches of responses with the per-step BCE loss, linear warm-up then decay;
    ``optim.grad_accumulation`` batches per optimiser step, each weighted by its share of the step's labelled
    steps (so the update is that of the mean over all of them); ``progress``: checkpoints, resume and callbacks
    (:class:`~tether.rm.resume.TrainingProgress`). Returns one metrics row per optimiser step."""
    from tether.runlog import StepProgress

    o = cfg.optim
    params, optimizer, scheduler, autocast, scaler, steps = optimisation(model, cfg, len(encoded), device)
    generator = torch.Generator().manual_seed(cfg.seed)
    progress = progress or TrainingProgress(None, cfg)
    history = progress.restore(model, optimizer, scheduler, scaler, generator, data_digest([(e,) for e in encoded]))
    model.train()
    bar = StepProgress("train-prm", steps, len(history), mininterval=1.0)
    for epoch in range(progress.epoch, o.epochs):
        epoch_generator = generator.get_state()
        batches = pair_batches([len(e.ids) for e in encoded], o.batch_size, generator, o.group_by_length)
        for first in range(progress.first_batch(epoch), len(batches), o.grad_accumulation):
            group = batches[first:first + o.grad_accumulation]
            tensors = []
            for batch in group:
                ids, mask, positions, step_mask = batch_tensors([encoded[i] for i in batch], pad_id)
                y = torch.zeros(step_mask.shape)
                for b, i in enumerate(batch):
                    y[b, :len(labels[i])] = torch.tensor(labels[i], dtype=torch.float32)
                tensors.append((ids, mask, positions, step_mask, y))
            n_steps = sum(int(t[3].sum()) for t in tensors)
            loss_sum = correct = 0.0
            for ids, mask, positions, step_mask, y in tensors:
                if not step_mask.any():
                    continue
                with torch.autocast(**autocast):
                    logits = step_logits(model, ids.to(device), mask.to(device), positions.to(device))
                loss = step_bce_loss(logits, y.to(device), step_mask.to(device))
                share = int(step_mask.sum()) / n_steps
                scaler.scale(loss * share).backward()
                loss_sum += loss.item() * share
                correct += (((logits.detach().cpu() >= 0) == y.bool()) & step_mask).sum().item()
            grad_norm, lr = optimizer_step(params, optimizer, scheduler, scaler, o.max_grad_norm)
            history.append({"step": len(history) + 1, "epoch": epoch + 1, "rm/loss": loss_sum,
                            "rm/accuracy": correct / max(1, n_steps), "rm/grad_norm": float(grad_norm), "rm/lr": lr})
            bar.update(loss=f"{loss_sum:.4f}", acc=f"{history[-1]['rm/accuracy']:.2f}")
            if progress.step_done(history, epoch, first + o.grad_accumulation, epoch_generator,
                                  (model, optimizer, scheduler, scaler)):
                break
        if progress.stopped:
            break
    bar.close()
    return history
