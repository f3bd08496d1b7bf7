"""A run's processes (SPEC C4), shared by the stages that train (PPO, SFT): the accelerator, this process's rank,
the cross-process reductions the metrics need, and the one place that decides what only the main process does
(``is_main``).

:func:`open_processes` opens them: DDP across processes, or FSDP2 when the launch config asks for it, with the
run's collective timeout; accelerate's own mixed precision is ignored on purpose (C5, see there). PPO adds its
rollout layout on top (:func:`tether.ppo.processes.make_processes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NoReturn

import torch
from torch import nn

from tether.sharding import FsdpSettings, fsdp_settings, set_gradient_sync

if TYPE_CHECKING:
    from accelerate import Accelerator

@dataclass
class Processes:
    """This process among the run's processes. Metrics are reduced over all of them; files, trackers
    and console lines come from the main process only (see :class:`tether.runlog.RunLog`)."""

    accelerator: Accelerator
    device: torch.device
    world_size: int
    rank: int
    fsdp: FsdpSettings | None = None  # the launch config asked for FSDP2 (tether.sharding)
    link: object | None = None  # PPO's disaggregated layout: a tether.rollout.layout.Link to the rollout processes
    closing: list[Callable[[], None]] = field(default_factory=list)  # run by close() while the group still exists

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _reduce(self, x, op) -> float:
        t = torch.as_tensor(x, dtype=torch.float64, device=self.device).detach().clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=op)
        return float(t)

    def global_mean(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.SUM if self.world_size > 1 else None) / self.world_size

    def global_sum(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.SUM if self.world_size > 1 else None)

    def global_max(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.MAX if self.world_size > 1 else None)

    def global_min(self, x) -> float:
        return self._reduce(x, torch.distributed.ReduceOp.MIN if self.world_size > 1 else None)

    def broadcast(self, obj):
        """``obj`` as the main process has it, on every process: a decision (stop, roll back to which
        checkpoint) is made once, so no process waits in a collective another one has left."""
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every process's ``obj``, in rank order, on every process."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) on each process -> (world_size·B, ...) in rank order, on every process."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, models: list[nn.Module], last: bool):
        """Skip DDP's gradient all-reduce (FSDP2's reduce-scatter) on every micro-batch but the last of a
        minibatch."""
        if self.fsdp is not None:
            set_gradient_sync(models, last or self.world_size == 1)
            yield
            return
        with contextlib.ExitStack() as stack:
            if not last and self.world_size > 1:
                for model in models:
                    stack.enter_context(self.accelerator.no_sync(model))
            yield

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """The run's last collective: every process waits for the others, then leaves the process group. A
        process that exits still in the group leaves it to interpreter shutdown, where gloo's worker threads
        can still hold tensors of the last collectives (pytorch/pytorch#179291: SIGABRT at exit). The ``closing``
        hooks (the rollout engine's) run between."""
        self.wait()
        for hook in self.closing:
            hook()
        if self.world_size > 1:
            self.accelerator.state.destroy_process_group()
            self.accelerator.free_memory()  # its references to the prepared models (their memory)


def leave_without_teardown(code: int = 0) -> NoReturn:
    """End this process of a multi-process launch now, with exit status ``code``, skipping the interpreter's
    teardown (#32). Call it once the run is over (:meth:`Processes.close` done, files written and closed).

    Why: under DDP and FSDP2 the gloo group outlives ``destroy_process_group`` (torch 2.13): the C++ group stays
    referenced from the modules' C++ side, and its three threads (``gloo_tcp_loop``, 2 × ``pt_gloo_runloop``) are
    still running after destroy, ``del`` of the model and ``gc.collect()`` — measured, even for a bare
    ``DistributedDataParallel(nn.Linear(4, 4))``; without DDP, destroy stops them. Left running into interpreter
    shutdown and the C++ static destructors, they can abort a process whose run has succeeded (SIGABRT,
    "terminate called without an active exception"), and the launcher then stops the other processes and
    reports the launch as failed. ``os._exit`` skips that teardown; stdio and logging are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def open_processes(output_dir: str, trackers: list[str], model_dtype: str, timeout_minutes: float) -> Processes:
    """The accelerator (DDP across processes, or FSDP2 when the launch config asks for it; the experiment
    ``trackers``, logging under ``output_dir``). On CPU the accelerator runs gloo processes (it would wrap in DDP
    whatever the config says): the FSDP settings are read here and applied by the stage's setup.

    accelerate's mixed precision is ignored on purpose (``mixed_precision="no"``; tether owns precision through
    ``--model-dtype``, C5): it would autocast what ``prepare`` wraps but not the frozen reference (step-1 KL ≠ 0),
    and its fp16 GradScaler would scale the gradients tether clips. Its config file reaches a run only as the
    ``ACCELERATE_MIXED_PRECISION`` that ``accelerate launch`` exports; the explicit argument overrides that."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    # The collective timeout: the others wait while process 0 alone writes a checkpoint or the final model, on
    # a big model or a busy machine longer than torch's default (NCCL 10 min: its watchdog then aborts them).
    # (accelerate passes only a value other than its own default, 10 min; at exactly 10, gloo keeps its 30.)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=trackers or None,
                              project_dir=output_dir, mixed_precision="no",
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False),
                                               InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))])
    note = ignored_mixed_precision_note(os.environ.get("ACCELERATE_MIXED_PRECISION", ""), model_dtype)
    if note and accelerator.is_main_process:
        print(note, file=sys.stderr)
    return Processes(accelerator, accelerator.device, accelerator.num_processes, accelerator.process_index,
                     fsdp=fsdp_settings())


def ignored_mixed_precision_note(setting: str, model_dtype: str) -> str:
    """The one line saying accelerate's mixed-precision ``setting`` is ignored, or "" when it asks for nothing
    ("no", unset) or for what ``--model-dtype`` already is."""
    setting = setting.strip().lower()
    if setting in ("", "no") or setting == model_dtype:
        return ""
    return (f"note: ACCELERATE_MIXED_PRECISION={setting} (accelerate config / --mixed_precision) is ignored: this "
            f"run computes in --dtype {model_dtype}; --dtype bf16 is tether's mixed precision")
