"""Which launched process does what (SPEC C4), and the dedicated process groups of the disaggregated layout.

Layouts of ``accelerate launch ... -m tether ppo`` with N processes:

- **colocated** (the default; reference 000 §C.5 "hybrid"): every process trains and generates; with
  ``--engine vllm`` each holds its own vLLM engine (or one engine per ``--engine-tp`` processes).
- **disaggregated** (``--rollout-processes R``): the last R ranks only generate, each with its own engine; the
  first N − R train. The trainers form the run's process group (DDP or FSDP2, exactly as a launch of N − R
  processes would: accelerate sees WORLD_SIZE = N − R); a rollout process never joins it. Trainers and rollout
  processes talk over two groups of their own, made on the launcher's rendezvous store (so a 2-node launch, one
  node of trainers and one of rollout processes, works as one machine does):

  * ``messages`` (all N, gloo): control from trainer 0, prompts out and token ids + sampler log-probs back, by
    point-to-point sends;
  * ``weights`` (trainer 0 and the R rollout processes; NCCL when every member is on a GPU of its own, else gloo:
    the members agree on it through the store): the weight broadcast.

Every operation on them waits at most ``collective_timeout_minutes``; a peer that died or stopped answering ends
the run with one line naming it (:meth:`Link.guard`), never a hang.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from tether.errors import ConfigError, TetherError


@dataclass(frozen=True)
class Layout:
    """The launch: ``world`` processes, this one ``rank``, the last ``rollouts`` of them rollout processes."""

    world: int
    rank: int
    rollouts: int = 0

    @property
    def trainers(self) -> int:
        return self.world - self.rollouts

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    def rollout_of(self, trainer: int) -> int:
        """The rollout process (its launch rank) that samples trainer ``trainer``'s prompts: round robin."""
        return self.trainers + trainer % self.rollouts

    def trainers_of(self, rollout: int) -> list[int]:
        """The trainers whose prompts rollout process ``rollout`` (launch rank) samples, in rank order."""
        return [t for t in range(self.trainers) if self.rollout_of(t) == rollout]


def launch_layout(cfg) -> Layout:
    """This launch's layout, from the launcher's ``WORLD_SIZE``/``RANK`` and ``--rollout-processes``."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    rollouts = cfg.generation.rollout_processes
    if rollouts and rollouts >= world:
        raise ConfigError(f"--rollout-processes {rollouts}: this launch has {world} process(es) and at least one "
                          "must train (accelerate launch --num_processes N with N > R)")
    if rollouts > world - rollouts:  # round robin: rollout process r serves trainers r, r + R, ...
        raise ConfigError(f"--rollout-processes {rollouts}: this launch has {world} processes, so {world - rollouts} "
                          f"train and {2 * rollouts - world} rollout process(es) would serve no trainer; use at most "
                          f"{world // 2} (R <= N - R)")
    return Layout(world, rank, rollouts)


def trainers_world(layout: Layout) -> None:
    """Make the trainers' process group the first N − R ranks: accelerate (and torch's env:// rendezvous) read
    the world size from ``WORLD_SIZE``. Called on trainers before the accelerator is made."""
    if layout.rollouts:
        os.environ["WORLD_SIZE"] = str(layout.trainers)


# What gloo and NCCL say when the other side died (its sockets closed) or stopped answering (the timeout).
LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "closed by peer",
             "connection refused")


def lost_peer(error: RuntimeError) -> bool:
    """Whether ``error`` from an operation on the link says the peer is gone or silent."""
    return isinstance(error, torch.distributed.DistError) or any(k in str(error).lower() for k in LOST_PEER)


def _backend(weights: bool) -> str:
    """What this process can do: NCCL for the weights between GPUs; gloo for the messages, on CPU processes, and
    when several processes share a GPU (NCCL refuses two ranks on one device; a one-GPU machine rehearses the
    layout so). The weights group uses what all its members can (:func:`agreed_backend`)."""
    if not (weights and torch.cuda.is_available()):
        return "gloo"
    return "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count() else "gloo"


def agreed_backend(store, prefix: str, member: int, members: int, mine: str) -> str:
    """The backend every member of a group will build it with: NCCL only when every member can (each publishes
    what it can under ``prefix`` on the launch's store, then reads the others'), else gloo. Chosen alone, a node
    with fewer GPUs than processes would build gloo while the other built NCCL: a group that never forms."""
    store.set(f"{prefix}/{member}", mine)
    votes = [store.get(f"{prefix}/{m}").decode() for m in range(members)]  # waits for each (the store's timeout)
    return "nccl" if all(v == "nccl" for v in votes) else "gloo"


class Link:
    """The disaggregated layout's two groups on this process (see the module docstring)."""

    CONTROL, REQUEST, REPLY = 1, 2, 3  # point-to-point tags

    def __init__(self, layout: Layout, timeout_minutes: float):
        self.layout, self.timeout = layout, timedelta(minutes=timeout_minutes)
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise TetherError("--rollout-processes: needs a launch by accelerate launch (or torchrun): MASTER_ADDR "
                              "and MASTER_PORT are not set")
        # The launcher's rendezvous store (torchrun's agent hosts it on MASTER_ADDR:MASTER_PORT); keys under a
        # prefix of their own, per restart of the launch.
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=self.timeout)
        prefix = f"tether-rollout/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.messages = self._group(store, f"{prefix}/messages", layout.rank, layout.world, "gloo")
        members = [0, *range(layout.trainers, layout.world)]
        self.weights, self.weights_backend = None, "gloo"
        if layout.rank in members:
            member = members.index(layout.rank)
            self.weights_backend = agreed_backend(store, f"{prefix}/weights-backend", member, len(members),
                                                  _backend(weights=True))
            self.weights = self._group(store, f"{prefix}/weights", member, len(members), self.weights_backend)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % gpus}" if gpus else "cpu")
        self.weights_device = self.device if self.weights_backend == "nccl" else torch.device("cpu")

    def _group(self, store, prefix: str, rank: int, size: int, backend: str):
        prefixed = torch.distributed.PrefixStore(prefix, store)
        if backend == "nccl":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
        return torch.distributed.ProcessGroupGloo(prefixed, rank, size, self.timeout)

    # ------------------------------------------------------------------ messages (CPU tensors, point to point)
    def send(self, tensor: torch.Tensor, to: int, tag: int, timeout: timedelta | None = None) -> None:
        """``timeout``: as :meth:`recv`'s (a send completes when the peer receives it)."""
        work = self.messages.send([tensor.cpu().contiguous()], to, tag)
        work.wait(timeout) if timeout is not None else work.wait()

    def recv(self, tensor: torch.Tensor, source: int, tag: int, timeout: timedelta | None = None) -> torch.Tensor:
        """``timeout``: this wait's own limit instead of the group's (gloo fails it at once all the same when the
        peer's sockets close: a dead peer is never waited for)."""
        work = self.messages.recv([tensor], source, tag)
        work.wait(timeout) if timeout is not None else work.wait()
        return tensor

    # ------------------------------------------------------------------ weights (trainer 0 is the root)
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on ``weights_device``) from trainer 0 to every rollout process (in place on the receivers)."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.weights.broadcast([tensor], options).wait()
        if tensor.is_cuda:  # NCCL's wait only orders the streams: the sync's seconds are the transfer's, not its enqueue
            torch.cuda.current_stream(tensor.device).synchronize()
        return tensor

    @contextlib.contextmanager
    def guard(self, peers: list[int], doing: str, timed: bool = True):
        """Turn a failed or timed-out operation with ``peers`` (launch ranks) into one line naming them; ``timed``
        False: the operation waits without the collective timeout, so only a dead peer ends it."""
        try:
            yield
        except RuntimeError as e:  # gloo/NCCL errors and timeouts (DistBackendError is a RuntimeError)
            if not lost_peer(e):
                raise  # an error of this process's own (a bug), not a peer's: its traceback, not a verdict
            who = ", ".join(map(str, peers))
            kind = "rollout process" if all(p >= self.layout.trainers for p in peers) else "process"
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            me = f"{'rollout process' if self.layout.is_rollout else 'trainer'} {self.layout.rank}"
            within = (f"stopped answering while {doing}, or died, within the {self.timeout.total_seconds():.0f} s "
                      f"timeout (collective_timeout_minutes)" if timed else f"died while {doing}")
            raise TetherError(f"{me}: {kind}{'es' if len(peers) > 1 else ''} of rank {who} (of {self.layout.world}; "
                              f"--rollout-processes {self.layout.rollouts}) {within}: {reason}; the run stops") from None

    def close(self) -> None:
        for group in (self.messages, self.weights):
            if group is not None and hasattr(group, "shutdown"):
                with contextlib.suppress(RuntimeError):
                    group.shutdown()
