"""Sampling (B1): prompts encoded as the policy sees them (chat template, system turn, template), batched sampling
with a KV cache from exactly softmax(logits / temperature), stopping when every row has ended, and the response
masks (zero after the first EOS) with each row's EOS-or-truncated flag. :func:`generate` makes the
:class:`~tether.rollout.records.Rollout` that every engine returns.

Positions: the query (prompt) has P tokens, left-padded; the response has T tokens, right-padded after its first
EOS.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tether.inputs.conversations import chat_messages, prompt_text
from tether.hf import transformers_model
from tether.rollout.records import Rollout


def prompt_messages(prompt, system_prompt: str = "", template: str = "{prompt}") -> list[dict[str, str]]:
    """The chat messages the policy sees for one prompt: a list of messages as given, an HH transcript its turns
    (the model continues as the assistant instead of reading a transcript inside one user message), anything
    else one user message; ``template`` wraps the last user turn (``{prompt}`` is its text), ``system_prompt``
    when given replaces the template's default system turn (and a system message the prompt brought)."""
    messages = chat_messages(prompt)
    messages[-1] = {"role": "user", "content": template.replace("{prompt}", messages[-1]["content"])}
    if system_prompt and messages[0]["role"] == "system":
        messages = messages[1:]
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int, use_chat_template: bool,
                   system_prompt: str = "", template: str = "{prompt}"):
    """Token ids (B, P) left-padded and their mask. A chat prompt longer than ``max_prompt_length`` tokens
    loses its oldest exchanges first; whatever is still too long keeps its last ``max_prompt_length`` tokens.
    Without a chat template the prompt text (messages as an HH transcript) is ``template`` filled in, tokenised
    as is."""
    rows = []
    for prompt in prompts:
        if use_chat_template:
            messages = prompt_messages(prompt, system_prompt, template)
            ids = _chat_ids(tokenizer, messages)
            first = 1 if messages[0]["role"] == "system" else 0
            # Too long: drop the oldest exchange (a user turn and the reply to it), so that the
            # prompt still starts at a turn boundary with the system turn kept.
            while len(ids) > max_prompt_length and len(messages) - first > 2:
                messages = messages[:first] + messages[first + 2:]
                ids = _chat_ids(tokenizer, messages)
        else:
            ids = tokenizer(template.replace("{prompt}", prompt_text(prompt)), add_special_tokens=True)["input_ids"]
        rows.append(list(ids)[-max_prompt_length:])
    width = max(len(r) for r in rows)
    query = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        query[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return query, mask


def _chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def response_mask_after_eos(response: torch.Tensor, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, T): 1 up to and including the first EOS, ended_with_eos (B,))."""
    is_eos = torch.isin(response, torch.tensor(eos, device=response.device))
    ended = is_eos.any(dim=1)
    # Number of EOS strictly before each position: positions after the first EOS have ≥ 1.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long(), ended


# Every logits processor ``generate`` builds from a non-None field, at its neutral value. A field left None is
# filled from ``model.generation_config`` (transformers 5.24 ``_prepare_generation_config``: the passed config's
# None fields take the model's values, then the global defaults, whose top_k is 50), so the neutral values are
# set here and the fields whose only neutral value is None (min_p, top_h, bad_words_ids, suppress_tokens,
# begin_suppress_tokens, sequence_bias, forced_bos/eos_token_id, exponential_decay_length_penalty,
# watermarking_config, guidance_scale, stop_strings, max_time, prompt_lookup_num_tokens, …) are kept None by
# :func:`checkpoint_defaults_off`.
NEUTRAL_SAMPLING = {"top_k": 0, "top_p": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                    "encoder_no_repeat_ngram_size": 0, "renormalize_logits": False, "remove_invalid_values": False,
                    "num_beams": 1, "num_return_sequences": 1, "min_length": 0, "length_penalty": 1.0}


def sampling_config(tokenizer, model, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                    min_new_tokens: int = 0):
    """The ``GenerationConfig`` of a rollout: plain softmax(logits / temperature) sampling (or greedy), the
    distribution :func:`forward_response` scores (B1), with every processor-relevant field set."""
    from transformers import GenerationConfig

    return GenerationConfig(**NEUTRAL_SAMPLING, do_sample=not greedy, temperature=1.0 if greedy else temperature,
                            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                            eos_token_id=eos_ids(tokenizer, model), pad_token_id=tokenizer.pad_token_id,
                            use_cache=True)


@contextmanager
def checkpoint_defaults_off(model):
    """While inside, the model's own ``generation_config`` (from the checkpoint's generation_config.json) is a
    blank one, so ``generate`` inherits nothing from it: a passed config's None fields would otherwise take
    the checkpoint's repetition_penalty, min_p, suppress_tokens, … (see :data:`NEUTRAL_SAMPLING`). The blank
    goes on the innermost transformers model, which is where ``generate`` reads it (PEFT copies it there)."""
    from transformers import GenerationConfig

    base = transformers_model(model)
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


class SampledLogprobs:
    """A logits processor that records, step by step, the log-prob of each sampled token under the distribution
    it was drawn from: log_softmax(scores / T) of the processed scores (``generate`` applies the temperature after
    the processors it is given, as :class:`TemperatureLogitsWarper` does: scores / T), picked at the next step from
    the token that was sampled. It holds one (B, V) step at a time, where ``output_scores`` keeps (B, V) for every
    position: (B, T, V) floats, 0.6 GB for 64 rows × 48 tokens of a 49k vocabulary."""

    def __init__(self, temperature: float):
        self.temperature, self.last, self.picked = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the token sampled from the previous step's distribution is input_ids' last
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = (scores / self.temperature).float().log_softmax(dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, T): every step's picked log-prob, the last step's from ``last_tokens`` (B,), the final samples."""
        if self.last is not None:
            self.picked.append(self.last.gather(-1, last_tokens[:, None]).squeeze(-1))
        return torch.stack(self.picked, dim=1) if self.picked else last_tokens.new_zeros((len(last_tokens), 0)).float()


@torch.no_grad()
def generate(model, tokenizer, query: torch.Tensor, query_mask: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, greedy: bool = False, min_new_tokens: int = 0,
             sampler_logprobs: bool = False) -> Rollout:
    """Sample responses with ``model.generate`` (KV cache; stops as soon as every row has hit EOS) from exactly
    softmax(logits / temperature): no top-k/top-p (refused, docs/sampling.md), nothing from the checkpoint.
    ``sampler_logprobs``: also the log-probs of the sampled tokens under the distribution they were drawn from
    (:class:`SampledLogprobs`: after every processor), kept as ``Rollout.logprobs_sampler``."""
    from transformers import LogitsProcessorList
    from transformers.utils import logging as hf_logging

    was_training, verbosity = model.training, hf_logging.get_verbosity()
    model.eval()
    # Finished rows keep emitting PAD, which makes transformers warn about padding without a mask; greedy
    # decoding calls the neutral top_k "ignored": both harmless.
    hf_logging.set_verbosity_error()
    config = sampling_config(tokenizer, model, max_new_tokens, temperature, greedy, min_new_tokens)
    recorder = SampledLogprobs(config.temperature) if sampler_logprobs else None
    try:
        with checkpoint_defaults_off(model):
            output = model.generate(input_ids=query, attention_mask=query_mask, generation_config=config,
                                    logits_processor=LogitsProcessorList([recorder]) if recorder else None)
    finally:
        hf_logging.set_verbosity(verbosity)
        model.train(was_training)
    response = output[:, query.shape[1]:]
    response_mask, ended = response_mask_after_eos(response, config.eos_token_id)
    logprobs = None
    if recorder is not None:  # a PAD after EOS may have log-prob −inf: 0 there
        logprobs = torch.where(response_mask.bool(), recorder.finish(response[:, -1]), 0.0)
    response = torch.where(response_mask.bool(), response, torch.full_like(response, tokenizer.pad_token_id))
    return Rollout(query=query, query_mask=query_mask, response=response, response_mask=response_mask,
                   ended_with_eos=ended, eos_ids=tuple(config.eos_token_id), min_new_tokens=min_new_tokens,
                   logprobs_sampler=logprobs)
