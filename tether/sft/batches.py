"""Batches of SFT sequences (S1, S2): the run's steps in order, and a micro-batch as tensors — padded, or packed.

**Order.** Each epoch draws its micro-batches from one seeded generator (:func:`tether.inputs.splits.shuffled_batches`:
shuffled, or grouped by length). A step is ``grad_accumulation × processes`` consecutive micro-batches; process r
takes its ``grad_accumulation`` of them, so one process with ``grad_accumulation`` G·P sees the same sequences per
step as P processes with G. Under several processes an epoch's last, incomplete step is left out (every process
must run the same number of forwards); one process keeps it. A checkpoint stores the epoch, the step in it and the
generator as the epoch began: the epoch's micro-batches are drawn again, the same ones.

**Padded** micro-batch: right-padded to its longest sequence, with an attention mask (N = batch size rows).

**Packed** micro-batch (padding-free packing, S2): the sequences laid end to end in rows, first-fit by decreasing
length into rows no longer than the longest sequence (``row_length``; None: one row — what varlen attention
kernels want); position ids restart at 0 with every sequence and no attention mask is passed, which transformers
(≥ 5.19, :func:`transformers.masking_utils.find_packed_sequence_indices`) turns into a block-diagonal causal mask:
no sequence attends to, or takes positions from, another. A row's leftover positions are filler, a sequence of
their own. The first token of every sequence is never a label, so no token is predicted across a boundary. Same
tokens, same positions, same attention as padded: the same loss up to float rounding
(``tests/test_sft_packing.py``), with less padding computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.inputs.splits import shuffled_batches
from tether.errors import TetherError
from tether.sft.tokens import IGNORE_INDEX, Example


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the model takes it."""

    input_ids: torch.Tensor                # (N, L) token ids, pad_id where nothing is
    labels: torch.Tensor                   # (N, L) the trained tokens, IGNORE_INDEX elsewhere
    attention_mask: torch.Tensor | None    # (N, L) padded layout: 1 on tokens
    position_ids: torch.Tensor | None      # (N, L) packed layout: 0, 1, … restarting with every sequence

    @property
    def positions(self) -> int:
        """Positions computed, padding included (N·L)."""
        return self.input_ids.numel()

    def model_inputs(self, device) -> dict:
        """The forward's keyword arguments. No KV cache: transformers reads packing from the position ids only
        when there is neither an attention mask nor a cache."""
        inputs = {"input_ids": self.input_ids.to(device), "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask.to(device)
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids.to(device)
        return inputs


def padded_batch(examples: list[Example], pad_id: int) -> Batch:
    """Right-padded to the longest sequence: (N, max length)."""
    width = max(len(e.ids) for e in examples)
    ids = [e.ids + [pad_id] * (width - len(e.ids)) for e in examples]
    labels = [e.labels + [IGNORE_INDEX] * (width - len(e.ids)) for e in examples]
    mask = [[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in examples]
    return Batch(torch.tensor(ids), torch.tensor(labels), torch.tensor(mask), None)


def first_fit_rows(lengths: list[int], row_length: int | None) -> list[list[int]]:
    """Sequences (by index) assigned to rows: first-fit over the sequences longest first (ties by index), a row
    holding at most ``row_length`` tokens (None: all in one row). Deterministic for given lengths."""
    if row_length is None:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        free = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if free is None:
            rows.append([i])
            room.append(row_length - lengths[i])
        else:
            rows[free].append(i)
            room[free] -= lengths[i]
    return rows


def packed_batch(examples: list[Example], pad_id: int, one_row: bool = False) -> Batch:
    """Packed rows (module docstring): no longer than the longest sequence, or everything in one row."""
    lengths = [len(e.ids) for e in examples]
    rows = first_fit_rows(lengths, None if one_row else max(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids, labels, positions = [], [], []
    for row in rows:
        r_ids, r_labels, r_pos = [], [], []
        for i in row:
            e = examples[i]
            r_ids += e.ids
            r_labels += [IGNORE_INDEX] + e.labels[1:]  # a sequence's first token is never predicted from another's
            r_pos += list(range(len(e.ids)))
        fill = width - len(r_ids)
        ids.append(r_ids + [pad_id] * fill)
        labels.append(r_labels + [IGNORE_INDEX] * fill)
        positions.append(r_pos + list(range(fill)))  # the padding: a sequence of its own
    return Batch(torch.tensor(ids), torch.tensor(labels), None, torch.tensor(positions))


def make_batch(examples: list[Example], tokenizer, packing: str | None) -> Batch:
    """A micro-batch: ``packing`` None (padded with the pad token), ``"rows"`` (packed rows) or ``"one_row"``. Packed
    rows end in EOS tokens where they are short: a pad token at a row's end, with no attention mask, would have
    transformers warn that the input may be padded (it is a sequence of its own, never trained, either way)."""
    if packing is None:
        return padded_batch(examples, tokenizer.pad_token_id)
    return packed_batch(examples, tokenizer.eos_token_id, one_row=packing == "one_row")


def packing_layout(model, packing: bool) -> str | None:
    """How to pack for this model's attention: ``one_row`` for the flash-attention kernels (varlen: each
    sequence costs its own length squared), ``rows`` otherwise (a dense block-diagonal mask costs the row's length
    squared, so rows stay as short as the longest sequence); None without packing."""
    if not packing:
        return None
    implementation = str(getattr(model.config, "_attn_implementation", "") or "")
    return "one_row" if "flash" in implementation else "rows"


@torch.no_grad()
def check_packing(model, layout: str, device) -> None:
    """Refuse packing (one line) unless this model keeps packed sequences apart: the logits of three short random
    sequences packed as training packs them must equal those of each sequence alone. Catches a model or attention
    implementation that ignores the position ids (plain causal attention across the whole row)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 3, 2)]
    batch = packed_batch([Example(s, [IGNORE_INDEX] * len(s)) for s in seqs], 0, one_row=layout == "one_row")
    rows = first_fit_rows([len(s) for s in seqs], None if layout == "one_row" else 5)  # as packed_batch lays them
    where = {i: (r, sum(len(seqs[j]) for j in row[:k])) for r, row in enumerate(rows) for k, i in enumerate(row)}
    was_training = model.training
    model.eval()
    try:
        packed = model(**batch.model_inputs(device)).logits.float()  # (rows, L, V)
        worst = 0.0
        for i, s in enumerate(seqs):
            alone = model(input_ids=torch.tensor([s], device=device), use_cache=False).logits.float()[0]  # (len, V)
            r, at = where[i]
            worst = max(worst, float((packed[r, at:at + len(s)] - alone).abs().max()))
    finally:
        model.train(was_training)
    if worst > 1e-3:
        raise TetherError(f"--packing: this model ({type(model).__name__}, attention "
                          f"{getattr(model.config, '_attn_implementation', '?')}) lets packed sequences see each other "
                          f"(logits differ by {worst:.3g} from each sequence alone); train without --packing")


class StepStream:
    """The run's steps in order (module docstring), resumable: ``state_dict`` is the data position."""

    def __init__(self, examples: list[Example], batch_size: int, grad_accumulation: int, seed: int,
                 group_by_length: bool = False, drop_last: bool = False, rank: int = 0, world_size: int = 1):
        self.lengths = [len(e.ids) for e in examples]
        self.trained = [e.trained for e in examples]
        self.batch_size, self.group_by_length, self.drop_last = batch_size, group_by_length, drop_last
        self.per_step, self.per_process, self.rank = grad_accumulation * world_size, grad_accumulation, rank
        self.keep_short_step = world_size == 1
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.step_in_epoch = 0, 0
        self._draw()
        if self.steps_per_epoch == 0:
            raise TetherError(f"--batch-size {batch_size} x --grad-accumulation {grad_accumulation} x {world_size} "
                              f"process(es): {len(examples)} training sequences are too few for one step")

    def _draw(self) -> None:
        """This epoch's steps, drawn from the generator as the epoch begins (its state is kept for a resume)."""
        self.epoch_state = self.generator.get_state()
        micro = shuffled_batches(self.lengths, self.batch_size, self.generator, self.group_by_length)
        if self.drop_last and len(micro[-1]) < self.batch_size:
            micro = micro[:-1]
        cut = len(micro) if self.keep_short_step else len(micro) - len(micro) % self.per_step
        self.steps = [micro[i:i + self.per_step] for i in range(0, cut, self.per_step)]

    @property
    def steps_per_epoch(self) -> int:
        return len(self.steps)

    def next_step(self) -> tuple[list[list[int]], int]:
        """This process's micro-batches of the next step (lists of example indices) and the step's labelled tokens
        over every process (the loss's denominator, known to all without communication)."""
        if self.step_in_epoch == len(self.steps):
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            self._draw()
        step = self.steps[self.step_in_epoch]
        self.step_in_epoch += 1
        mine = step[self.rank * self.per_process:(self.rank + 1) * self.per_process]
        return mine, sum(self.trained[i] for micro in step for i in micro)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "epoch_generator": self.epoch_state}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["epoch_generator"])
        self._draw()
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
