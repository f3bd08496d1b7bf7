"""The disaggregated layout's wire (C3, C4): what trainers and rollout processes send each other.

On the trainers the rollout processes are one more engine behind the seam, :class:`RemoteEngine`: the step asks
it to sync and to generate exactly as it asks a local engine, and it scores what comes back itself (B2: the
trainers' forward stays the source of truth; the rollout engine's own log-probs only feed the sampler–trainer
gap metric). The rollout processes' loop is :mod:`tether.rollout.server`.

Protocol (groups and timeouts: :mod:`tether.rollout.layout`):

- **sync** (after every update, before a rollout): trainer 0 sends SYNC to every rollout process, broadcasts the
  manifest (names, shapes, dtypes per block, :func:`tether.rollout.weights.manifest`), then each block as one flat
  buffer per dtype, block by block (a bf16 run's matmul weights in bf16, as autocast computes them); the next block is gathered from the trainers' FSDP2 shards while this one is
  broadcast (:func:`tether.rollout.weights.policy_blocks`). Under FSDP2 every trainer takes part in the gathers; under
  DDP trainer 0 alone sends. The rollout processes load what arrives into their engine as it arrives.
- **generate**: trainer 0 sends GENERATE to every rollout process; each trainer sends its request (a header with
  the sampling settings and a seed drawn from its own RNG, then its left-padded prompt ids and mask) to its rollout
  process (:meth:`~tether.rollout.layout.Layout.rollout_of`), which samples all its trainers' rows in one batch and
  sends each trainer its rows back: response ids and the engine's log-probs of them.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import time
from collections.abc import Iterator

import torch

from tether.errors import TetherError
from tether.rollout.layout import Link
from tether.rollout.records import Rollout
from tether.rollout.sampling import eos_ids, response_mask_after_eos
from tether.rollout.weights import SyncSeconds, manifest, policy_blocks

SYNC, GENERATE, STOP, READY = 1, 2, 3, 4
HEADER = 7  # rows, width, max_new_tokens, min_new_tokens, greedy, temperature, seed (float64, all exact)


def dtype_groups(spec: list[tuple]) -> list[tuple[torch.dtype, list[tuple]]]:
    """A block's manifest entries that travel (tied names do not), grouped by dtype in order of first appearance."""
    groups: dict[str, list[tuple]] = {}
    for entry in spec:
        if not entry[3]:
            groups.setdefault(entry[2], []).append(entry)
    return [(getattr(torch, name), entries) for name, entries in groups.items()]


def broadcast_object(link: Link, obj=None):
    """A picklable object from trainer 0 to the rollout processes over the weights group (size, then bytes)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if obj is not None else None
    device = link.weights_device
    size = link.broadcast(torch.tensor([0 if data is None else len(data)], dtype=torch.long, device=device))
    payload = data.to(device) if data is not None else torch.empty(int(size), dtype=torch.uint8, device=device)
    return pickle.loads(link.broadcast(payload).cpu().numpy().tobytes())  # only ever from trainer 0, our own process


def send_weights(link: Link, model, seconds: SyncSeconds, compute_dtype: torch.dtype | None = None) -> None:
    """Trainer 0: the policy's weights to every rollout process, block by block (see the module docstring), each
    tensor in the dtype the run computes it in (:mod:`tether.rollout.weights`)."""
    plan = manifest(model, compute_dtype)
    broadcast_object(link, plan)
    for spec, block in zip(plan, policy_blocks(model, seconds, compute_dtype)):
        for _, entries in dtype_groups(spec):
            link.broadcast(torch.cat([block[name].reshape(-1) for name, *_ in entries]).to(link.weights_device))


def receive_weights(link: Link) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout process: (checkpoint name, tensor) as the blocks arrive, tied names sharing one tensor. Must be
    consumed to the end (every broadcast of the sync is matched)."""
    for spec in broadcast_object(link):
        tensors: dict[str, torch.Tensor] = {}
        for dtype, entries in dtype_groups(spec):
            sizes = [torch.Size(shape).numel() for _, shape, _, _ in entries]
            flat = link.broadcast(torch.empty(sum(sizes), dtype=dtype, device=link.weights_device))
            for (name, shape, _, _), part in zip(entries, flat.split(sizes)):
                tensors[name] = part.view(shape)
        for name, _, _, tied in spec:
            yield name, tensors[tied or name]


class RemoteEngine:
    """The rollout processes, as the trainers' engine (disaggregated layout). ``generate`` is :meth:`submit` then
    :meth:`collect`; one-step-off rollout (C7) submits a batch and collects it a step later, with at most one
    request in flight."""

    name = "remote"
    syncs_weights = True
    collective = True  # every trainer calls generate together: evaluation runs on every trainer

    def __init__(self, link: Link, model, tokenizer, sharded: bool, dtype: torch.dtype = torch.float32):
        """``dtype``: the run's compute dtype (``--model-dtype``): what the matmul weights travel in."""
        self.link, self.tokenizer, self.sharded, self.dtype = link, tokenizer, sharded, dtype
        self.eos = eos_ids(tokenizer, model)
        self.sync_seconds = SyncSeconds()
        self.pending: tuple | None = None  # (query, query_mask, min_new_tokens) of the request not yet collected
        self.closed = False
        if link.layout.rank == 0:  # wait for the engines to start, so that no step's timing includes that
            with link.guard(self._rollouts, "starting its engine"):
                for rank in self._rollouts:
                    link.recv(torch.zeros(1, dtype=torch.long), rank, Link.CONTROL)
        # A script that ends without finishing the run (PPOTrainer.step() and exit) still lets the rollout processes
        # go: collect what is in flight, then STOP (from trainer 0), as its interpreter exits.
        atexit.register(self.close_quietly)

    @property
    def _rollouts(self) -> list[int]:
        layout = self.link.layout
        return list(range(layout.trainers, layout.world))

    def _command(self, op: int) -> None:
        for rank in self._rollouts:
            self.link.send(torch.tensor([op], dtype=torch.long), rank, Link.CONTROL)

    def sync_weights(self, model) -> None:
        if self.pending is not None:
            raise TetherError("rollout processes: weight sync with a batch still in flight (collect it first)")
        start = time.perf_counter()
        self.sync_seconds = SyncSeconds()
        with self.link.guard(self._rollouts, "taking the weights"):
            if self.link.layout.rank == 0:
                self._command(SYNC)
                send_weights(self.link, model, self.sync_seconds, self.dtype)
            elif self.sharded:  # the other trainers take part in the all-gathers of the shards
                for _ in policy_blocks(model, self.sync_seconds, self.dtype):
                    pass
        self.sync_seconds.transfer = time.perf_counter() - start - self.sync_seconds.gather

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout:
        self.submit(query, query_mask, max_new_tokens, temperature, greedy, min_new_tokens)
        return self.collect()

    def submit(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
               temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> None:
        """Send this trainer's prompts to its rollout process (trainer 0 first tells every rollout process to
        GENERATE; every trainer submits together) with the sampling settings and a seed drawn from this trainer's
        RNG (a resumed run asks for the same samples). The rollout process samples them with the weights of the last
        sync while this trainer goes on; :meth:`collect` receives them."""
        if self.pending is not None:
            raise TetherError("rollout processes: a second request with one still in flight (collect it first)")
        rollout = self.link.layout.rollout_of(self.link.layout.rank)
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        header = torch.tensor([*query.shape, max_new_tokens, min_new_tokens, float(greedy), temperature, seed],
                              dtype=torch.float64)
        with self.link.guard([rollout], "sampling"):
            if self.link.layout.rank == 0:
                self._command(GENERATE)
            for tensor in (header, query, query_mask.long()):
                self.link.send(tensor, rollout, Link.REQUEST)
        self.pending = (query, query_mask, min_new_tokens)

    @torch.no_grad()
    def collect(self) -> Rollout:
        """The rollout of the request in flight: response ids and the engine's log-probs of them (B19)."""
        if self.pending is None:
            raise TetherError("rollout processes: nothing in flight to collect")
        query, query_mask, min_new_tokens = self.pending
        self.pending = None  # whatever happens next, this request is answered or the run ends
        rollout = self.link.layout.rollout_of(self.link.layout.rank)
        with self.link.guard([rollout], "sampling"):
            width = int(self.link.recv(torch.zeros(1, dtype=torch.long), rollout, Link.REPLY))
            response = self.link.recv(torch.zeros((len(query), width), dtype=torch.long), rollout, Link.REPLY)
            logprobs = self.link.recv(torch.zeros((len(query), width)), rollout, Link.REPLY)
        response, logprobs = response.to(query.device), logprobs.to(query.device)
        response_mask, ended = response_mask_after_eos(response, self.eos)
        return Rollout(query=query, query_mask=query_mask, response=response, response_mask=response_mask,
                       ended_with_eos=ended, eos_ids=tuple(self.eos), min_new_tokens=min_new_tokens,
                       logprobs_sampler=logprobs * response_mask)

    def close(self) -> None:
        """The end of the run: a batch still in flight is collected (every message matched), trainer 0 tells the
        rollout processes to stop; every trainer leaves the groups. Once only."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close_quietly)
        if self.pending is not None:
            self.collect()
        if self.link.layout.rank == 0:
            with self.link.guard(self._rollouts, "stopping"):
                self._command(STOP)
        self.link.close()

    def close_quietly(self) -> None:
        """:meth:`close` at interpreter exit: a peer already gone has nothing left to stop."""
        with contextlib.suppress(Exception):
            self.close()
