"""One SFT optimiser step, top to bottom (S1):

1. this process's micro-batches of the step and the step's labelled tokens N over every process
   (:class:`~tether.sft.batches.StepStream`);
2. per micro-batch: the forward under autocast (C5), padded or packed (:mod:`tether.sft.batches`); its mean
   next-token NLL L_b over its n_b labelled tokens (:func:`tether.core.losses.token_nll`), backpropagated as
   L_b · n_b / N · P (P processes: DDP and FSDP2 average gradients over processes), so that the step's gradient is
   that of the mean over all N tokens however they are cut into micro-batches and processes; the gradient
   all-reduce only on the last micro-batch;
3. unscale (fp16), clip the gradient norm, and step — unless the norm is not finite: then the update is skipped
   (counted; ``optim.max_skipped_steps`` in a row stop the run);
4. the metrics: ``sft/loss`` (mean NLL of the step's labelled tokens), ``sft/tokens`` (labelled),
   ``sft/sequences``, ``sft/grad_norm``, ``sft/lr``, ``sft/skipped``, ``sft/epoch``, ``perf/seconds_step``,
   ``perf/tokens_per_second`` (every sequence token, prompts included), ``perf/padding_fraction`` (docs/metrics.md).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from tether.core.losses import token_nll
from tether.sft.batches import make_batch
from tether.sharding import grad_norm_value


def backward_micro_batches(run, micro_batches: list[list[int]], step_tokens: int) -> tuple[float, int, int, int]:
    """Step 2 on this process: forward and backward of each micro-batch. Returns ``(Σ_b L_b · n_b, Σ n_b,
    sequences, positions computed)`` of this process."""
    p, device = run.processes, run.processes.device
    nll_sum, tokens, sequences, positions = 0.0, 0, 0, 0
    for k, indices in enumerate(micro_batches):
        batch = make_batch([run.train[i] for i in indices], run.tokenizer, run.packing)
        with p.no_sync([run.model], last=k == len(micro_batches) - 1):
            with run.precision.autocast():
                logits = run.model(**batch.model_inputs(device)).logits  # (N, L, V)
            loss, n = token_nll(logits, batch.labels.to(device))
            # L_b weighted by its share of the step's tokens (× P: the processes' gradients are averaged)
            run.scaler.scale(loss * (n / step_tokens) * p.world_size).backward()
        nll_sum += loss.item() * n
        tokens, sequences, positions = tokens + n, sequences + len(indices), positions + batch.positions
    return nll_sum, tokens, sequences, positions


def optimizer_step(run, max_grad_norm: float) -> tuple[float, float, bool]:
    """Step 3: unscale, clip (norm over all processes' gradients), step, zero the gradients, advance the schedule.
    Returns ``(grad norm before clipping, the lr this step used, whether the update was applied)``."""
    run.scaler.unscale_(run.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(run.params, max_grad_norm if max_grad_norm > 0 else math.inf)
    grad_norm = grad_norm_value(norm)
    applied = math.isfinite(grad_norm)
    lr = run.scheduler.get_last_lr()[0]
    if applied or run.scaler.is_enabled():  # fp16: the scaler skips the step itself and lowers its scale
        run.scaler.step(run.optimizer)
        run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update: the schedule still advances (torch warns of the order)
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()
    return grad_norm, lr, applied


def sft_step(run, cfg) -> dict:
    """One optimiser step on ``run`` (:class:`~tether.sft.setup.SFTRun`); returns its metrics."""
    p = run.processes
    started = time.perf_counter()
    micro_batches, step_tokens = run.stream.next_step()
    run.model.train()
    nll_sum, tokens, sequences, positions = backward_micro_batches(run, micro_batches, step_tokens)
    grad_norm, lr, applied = optimizer_step(run, cfg.optim.max_grad_norm)
    seconds = time.perf_counter() - started
    nll_sum, sequences, positions = (p.global_sum(x) for x in (nll_sum, sequences, positions))
    sequence_tokens = p.global_sum(sum(len(run.train[i].ids) for micro in micro_batches for i in micro))
    return {"sft/loss": nll_sum / step_tokens, "sft/tokens": step_tokens, "sft/sequences": int(sequences),
            "sft/grad_norm": grad_norm, "sft/lr": lr, "sft/skipped": 0 if applied else 1,
            "sft/epoch": run.stream.epoch + run.stream.step_in_epoch / run.stream.steps_per_epoch,
            "perf/seconds_step": seconds, "perf/tokens_per_second": sequence_tokens / seconds if seconds > 0 else 0.0,
            "perf/padding_fraction": 1.0 - sequence_tokens / positions if positions else 0.0}
