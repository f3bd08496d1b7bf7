"""A rollout process of the disaggregated layout (``--rollout-processes R``): it only generates.

It loads the policy's architecture and tokenizer (the weights arrive from the trainers before the first rollout),
starts its engine (``--engine``: vLLM, or transformers where vLLM is absent), and then does what trainer 0 tells
it, until STOP: take the weights (:func:`tether.rollout.remote.receive_weights`), or sample its trainers' prompts in
one batch and send each its rows back. It writes nothing to the run directory. Between commands it waits as long
as trainer 0 lives (checkpoints, the export and a script's own work take what they take); within a command a trainer
that died or stopped answering ends it with one line (:meth:`tether.rollout.layout.Link.guard`).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from tether.errors import TetherError
from tether.hf import DTYPES, context_positions, transformers_model
from tether.rollout.layout import Layout, Link
from tether.rollout.remote import GENERATE, HEADER, READY, STOP, SYNC, receive_weights

IDLE_WAIT = timedelta(days=365)  # how long a rollout process waits for trainer 0's next command: as long as it lives


def make_rollout_engine(cfg, layout: Layout, device: torch.device):
    """This rollout process's engine on ``device`` (LoRA never: merged weights arrive with every sync). vLLM starts
    from the policy's skeleton (config and generation config, no weights: vLLM's copy is the only one this process
    holds); the transformers engine samples with a copy of the policy loaded from ``--policy``."""
    from tether.hf import causal_lm_skeleton, load_causal_lm, load_tokenizer
    from tether.presets import resolve_model_path
    from tether.rollout.engines import TransformersEngine

    path = resolve_model_path(cfg.model.policy, what="policy")
    tokenizer = load_tokenizer(path)
    if cfg.generation.engine == "vllm":
        from tether.rollout.vllm_engine import VLLMEngine

        model = causal_lm_skeleton(path, cfg.model.dtype, cfg.model.trust_remote_code)
        max_model_len = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
        max_model_len = min(max_model_len, context_positions(transformers_model(model).config) or max_model_len)
        rows = cfg.rows_per_step * len(layout.trainers_of(layout.rank))
        return VLLMEngine(model, tokenizer, max_model_len, rows=rows, seed=cfg.seed, dtype=DTYPES[cfg.model.dtype],
                          sleep=False, device=device)  # the device is the engine's alone
    model = load_causal_lm(path, cfg.model.dtype, cfg.model.trust_remote_code).to(device).eval()
    return TransformersEngine(model, tokenizer, sampler_logprobs=True)


def left_padded(queries: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int):
    """Several left-padded (rows, width_i) prompt batches as one (Σ rows, max width), still left-padded."""
    width = max(q.shape[1] for q in queries)
    query = torch.cat([torch.nn.functional.pad(q, (width - q.shape[1], 0), value=pad_id) for q in queries])
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0), value=0) for m in masks])
    return query, mask


def serve_generate(link: Link, engine, precision, pad_id: int) -> None:
    """One GENERATE: every request of this process's trainers, sampled in one batch, each trainer's rows back. A
    trainer takes its rows when its step needs them (one step off, after training the previous batch): the replies
    wait as long as it lives."""
    layout = link.layout
    trainers = layout.trainers_of(layout.rank)
    requests = []
    for trainer in trainers:
        header = link.recv(torch.zeros(HEADER, dtype=torch.float64), trainer, Link.REQUEST)
        shape = (int(header[0]), int(header[1]))
        query = link.recv(torch.zeros(shape, dtype=torch.long), trainer, Link.REQUEST)
        mask = link.recv(torch.zeros(shape, dtype=torch.long), trainer, Link.REQUEST)
        requests.append((header, query, mask))
    header = requests[0][0]
    query, mask = left_padded([r[1] for r in requests], [r[2] for r in requests], pad_id)
    torch.manual_seed(int(header[6]))  # the first trainer's seed: the same requests sample the same rows again
    with precision.autocast():
        rollout = engine.generate(query.to(link.device), mask.to(link.device), int(header[2]), float(header[5]),
                                  greedy=bool(header[4]), min_new_tokens=int(header[3]))
    start = 0
    for trainer, (_, q, _) in zip(trainers, requests):
        rows = slice(start, start + len(q))
        start += len(q)
        width = max(int(rollout.lengths[rows].max()), 1)  # this trainer's rows' columns only
        with link.guard([trainer], "this process held its samples", timed=False):
            for reply in (torch.tensor([width]), rollout.response[rows, :width],
                          rollout.logprobs_sampler[rows, :width].float()):
                link.send(reply, trainer, Link.REPLY, timeout=IDLE_WAIT)


def serve(cfg) -> Path:
    """Run this process as a rollout process until trainer 0 says STOP; returns the run directory."""
    from tether.precision import Precision
    from tether.rollout.layout import launch_layout

    layout = launch_layout(cfg)
    torch.manual_seed(cfg.seed + layout.rank)
    link = Link(layout, cfg.collective_timeout_minutes)
    engine = None
    try:  # a TetherError (a lost trainer) is the CLI's one line
        engine = make_rollout_engine(cfg, layout, link.device)
        precision = Precision(DTYPES[cfg.model.dtype], link.device.type)
        with link.guard([0], "starting"):
            link.send(torch.tensor([READY]), 0, Link.CONTROL)
        while True:
            # Between commands trainer 0 may be busy for any time (a checkpoint, the final export, a script's own
            # work between steps): wait as long as it lives. A dead trainer closes its sockets, which ends this wait
            # at once; a hung one makes the other trainers' collectives time out, and their launcher stops it.
            with link.guard([0], "this process waited for its next command", timed=False):
                op = int(link.recv(torch.zeros(1, dtype=torch.long), 0, Link.CONTROL, timeout=IDLE_WAIT))
            if op == STOP:
                break
            peers = [0] if op == SYNC else layout.trainers_of(layout.rank)
            with link.guard(peers, "sending the weights" if op == SYNC else "sending prompts"):
                if op == SYNC:
                    weights = receive_weights(link)
                    engine.load_weights(weights)
                    for _ in weights:  # whatever the engine left unread still arrives (every broadcast matched)
                        pass
                elif op == GENERATE:
                    serve_generate(link, engine, precision, engine.tokenizer.pad_token_id)
                else:
                    raise TetherError(f"rollout process {layout.rank}: unknown command {op} from trainer 0")
    finally:
        if engine is not None:
            engine.close()
        link.close()
    return Path(cfg.output_dir)
