"""Tiny models and files for tests: a character tokenizer, a random GPT-2 policy saved with
``save_pretrained``, prompt files, and PPO configs that run in about a second a step."""

from __future__ import annotations

import json
from pathlib import Path

from tether.ppo.config import RunConfig


def make_policy_dir(root: Path, seed: int = 0, n_layer: int = 2, n_embd: int = 32, n_head: int = 2) -> Path:
    from tether.demo.task import build_policy, build_tokenizer

    path = Path(root) / "policy"
    tokenizer = build_tokenizer(path)
    build_policy(tokenizer, seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head).save_pretrained(path)
    return path


def make_prompts_file(root: Path, n: int = 32, seed: int = 1, name: str = "prompts.jsonl") -> Path:
    from tether.demo.task import make_problems

    path = Path(root) / name
    path.write_text("".join(json.dumps(p) + "\n" for p in make_problems(n, seed=seed)), encoding="utf-8")
    return path


def tiny_config(root: Path, policy: Path, prompts: Path, **overrides) -> RunConfig:
    """A PPO config for the tiny models; ``overrides`` are dotted keys (``kl__coef`` for ``kl.coef``)."""
    cfg = RunConfig()
    cfg.output_dir = str(Path(root) / "run")
    cfg.model.policy = str(policy)
    cfg.data.prompts = str(prompts)
    cfg.reward.sources = ["tether.rules:char_share:char=7"]
    cfg.reward.gold = "none"
    cfg.steps, cfg.batch_size, cfg.ppo.mini_batches = 2, 8, 2
    cfg.generation.max_new_tokens = 6
    cfg.optim.lr, cfg.optim.critic_lr = 1e-3, 1e-3
    cfg.progress = False
    # no held-out evaluation unless a test asks (tether's default holds out 0.1 and evaluates from step 0: #49)
    cfg.data.eval_fraction, cfg.eval.at_start = 0.0, False
    for key, value in overrides.items():
        obj = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            obj = getattr(obj, p)
        setattr(obj, parts[-1], value)
    cfg.validate()
    return cfg


# A Llama-3-style chat layout written in the character tokenizer's alphabet (its [EOS] doubles as BOS).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} = {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def make_llama_chat_dir(root: Path, seed: int = 0, name: str = "llama", hidden: int = 64, layers: int = 2,
                        heads: int = 2, kv_heads: int = 1, positions: int = 512) -> Path:
    """A random Llama-shaped causal LM (RMSNorm, rotary, SwiGLU, grouped-query attention, tied embeddings, as
    SmolLM2 and Llama 3.2 are) over the character tokenizer, saved with a Jinja chat template. Heads are
    ``hidden // heads`` = 32 wide by default, a width vLLM's CPU kernels take."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tether.demo.task import build_tokenizer

    path = Path(root) / name
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    return path
