"""SFT rows as tokens and the loss mask (S1): which tokens are trained, as the policy will later be prompted.

With a chat template, a row is the conversation ``prompt_messages(prompt) + [assistant: completion]`` (the system
turn and ``--prompt-template`` applied as ``tether ppo`` applies them, :func:`tether.rollout.sampling.prompt_messages`),
rendered once. Assistant turn k is located by rendering the conversation up to it with the generation prompt
(``render(m[:k], add_generation_prompt=True)``) and up to its end (``render(m[:k+1])``): its tokens are those
between, and the trained ones run up to and including its first stop token (EOS or one of the model's generation
EOS ids) — template glue after it (SmolLM2's newline after ``<|im_end|>``) is context, never generated. A template
that ends the last turn with no stop token gets EOS appended (and trained), so the policy learns to stop. A
prompt/completion row trains its completion; a ``messages`` row every assistant turn. A template that does not
render the conversation turn by turn as a prefix of the whole is refused, naming the row.

Without a chat template, a row is ``prompt_template`` filled with the prompt text (messages as an HH transcript),
tokenised with the tokenizer's special tokens as ``tether ppo`` encodes prompts, then the completion (no special
tokens) and EOS; the completion and EOS are trained.

A ``text`` row (TRL's language-modelling form) is neither: its text is tokenised as it is, with the tokenizer's
special tokens, EOS appended unless the tokens already end with it, and every token is trained (``labels = ids``;
the first token, having nothing before it, is never a target) — chat template or not, as TRL trains such rows.

Labels are aligned with the tokens: ``labels[t]`` is ``ids[t]`` where token t is trained, else -100; the loss
predicts ``labels[t + 1]`` from position t (:func:`tether.core.losses.token_nll`). A sequence longer than
``max_length`` loses prompt tokens from the left first (one context token always stays before the first trained
one), then trained tokens from the right; both are counted, never silent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.inputs.conversations import prompt_text
from tether.errors import DataError, TetherError
from tether.rollout.sampling import eos_ids, prompt_messages
from tether.sft.data import SFTRow

IGNORE_INDEX = -100  # the label of a position the loss leaves out (PyTorch's cross_entropy default)


@dataclass(frozen=True)
class Example:
    """One training sequence."""

    ids: list[int]            # (T,) token ids
    labels: list[int]         # (T,) ids[t] where trained, IGNORE_INDEX elsewhere
    prompt_cut: bool = False  # context tokens were dropped from the left (max_length)
    response_cut: bool = False  # trained tokens were dropped from the right (max_length)

    @property
    def trained(self) -> int:
        """Tokens that enter the loss."""
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass(frozen=True)
class TextFormat:
    """How rows become tokens: the chat template or plain text, PPO's prompt shaping, the stop tokens."""

    use_chat_template: bool
    system_prompt: str
    prompt_template: str
    stop_ids: frozenset[int]  # tokens that end an assistant turn: EOS and the model's generation EOS ids
    eos_id: int
    max_length: int


def text_format(data_cfg, tokenizer, model, model_name: str = "") -> TextFormat:
    """The :class:`TextFormat` of ``data_cfg`` (``SFTConfig.data``) for this tokenizer and model, checked as
    ``tether ppo`` checks its chat-template settings."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if data_cfg.chat_template == "on" and not has_template:
        raise TetherError(f"--model {model_name}: data.chat_template=on but the tokenizer has no chat template "
                          "(give one with --chat-template-file)")
    use = data_cfg.chat_template == "on" or (data_cfg.chat_template == "auto" and has_template)
    if data_cfg.system_prompt and not use:
        raise TetherError(f"--system-prompt: the model {model_name} is not prompted through a chat template "
                          "(data.chat_template); put the instruction in --prompt-template instead")
    if tokenizer.eos_token_id is None:
        raise TetherError(f"--model {model_name}: the tokenizer has no EOS token; SFT teaches the policy to end "
                          "its replies with one")
    return TextFormat(use, data_cfg.system_prompt, data_cfg.prompt_template,
                      frozenset(eos_ids(tokenizer, model)), tokenizer.eos_token_id, data_cfg.max_length)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """The chat template's tokens for ``messages`` (with the assistant's generation prompt when asked)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_example(tokenizer, row: SFTRow, fmt: TextFormat) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of a row through the chat template (module docstring)."""
    messages = prompt_messages(row.prompt, fmt.system_prompt, fmt.prompt_template)
    messages.append({"role": "assistant", "content": row.completion})
    ids = chat_ids(tokenizer, messages, False)
    labels = [IGNORE_INDEX] * len(ids)
    last = len(messages) - 1
    # every assistant turn that answers a user (a greeting before any user turn is context), or the completion
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and
             any(x["role"] == "user" for x in messages[:k])] if row.all_turns else [last]
    stopped = True
    for k in turns:
        before = chat_ids(tokenizer, messages[:k], True)
        upto = ids if k == last else chat_ids(tokenizer, messages[:k + 1], False)
        if upto[:len(before)] != before or ids[:len(upto)] != upto or len(upto) == len(before):
            raise DataError(f"{row.source}: the chat template does not render this conversation turn by turn "
                            f"(assistant turn {turns.index(k) + 1} is not a suffix of the conversation up to it); "
                            f"its assistant tokens cannot be located")
        end = next((j + 1 for j in range(len(before), len(upto)) if ids[j] in fmt.stop_ids), len(upto))
        labels[len(before):end] = ids[len(before):end]
        stopped = ids[end - 1] in fmt.stop_ids
    if not stopped:  # the template ends the last turn with no stop token: the policy must still learn to stop
        ids, labels = ids + [fmt.eos_id], labels + [fmt.eos_id]
    return ids, labels


def plain_examples(tokenizer, rows: list[SFTRow], fmt: TextFormat) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of rows as plain text: the filled prompt template with special tokens, then completion
    + EOS (one batched tokenizer call each)."""
    prompts = [fmt.prompt_template.replace("{prompt}", prompt_text(r.prompt)) for r in rows]
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    reply_ids = tokenizer([r.completion for r in rows], add_special_tokens=False)["input_ids"]
    out = []
    for row, p, c in zip(rows, prompt_ids, reply_ids):
        if not p:
            raise DataError(f"{row.source}: the prompt has no tokens")
        reply = list(c) + [fmt.eos_id]
        out.append((list(p) + reply, [IGNORE_INDEX] * len(p) + reply))
    return out


def text_examples(tokenizer, rows: list[SFTRow], fmt: TextFormat) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of ``text`` rows: the text with the tokenizer's special tokens, then EOS unless it already
    ends so; every token trained (module docstring)."""
    out = []
    for row, ids in zip(rows, tokenizer([r.prompt for r in rows], add_special_tokens=True)["input_ids"]):
        ids = list(ids) if ids and ids[-1] == fmt.eos_id else list(ids) + [fmt.eos_id]
        if len(ids) < 2:
            raise DataError(f"{row.source}: field 'text' has no tokens")
        out.append((ids, list(ids)))
    return out


def truncated(ids: list[int], labels: list[int], max_length: int) -> Example:
    """The :class:`Example` of ``(ids, labels)`` cut to ``max_length``: context tokens from the left first (one
    stays before the first trained token), then trained tokens from the right."""
    excess = len(ids) - max_length
    if excess <= 0:
        return Example(ids, labels)
    first = next(t for t, label in enumerate(labels) if label != IGNORE_INDEX)
    left = max(0, min(excess, first - 1))
    right = excess - left
    end = len(ids) - right
    return Example(ids[left:end], labels[left:end], prompt_cut=left > 0, response_cut=right > 0)


def encode_rows(tokenizer, rows: list[SFTRow], fmt: TextFormat) -> tuple[list[Example], dict]:
    """Every row as an :class:`Example`, and the counts a run reports (rows, tokens, trained tokens, prompts cut,
    responses cut)."""
    texts = [i for i, row in enumerate(rows) if row.whole_text]
    others = [i for i, row in enumerate(rows) if not row.whole_text]
    pairs: list = [None] * len(rows)
    for i, pair in zip(texts, text_examples(tokenizer, [rows[i] for i in texts], fmt) if texts else []):
        pairs[i] = pair
    if fmt.use_chat_template:
        done = [chat_example(tokenizer, rows[i], fmt) for i in others]
    else:
        done = plain_examples(tokenizer, [rows[i] for i in others], fmt) if others else []
    for i, pair in zip(others, done):
        pairs[i] = pair
    examples = [truncated(ids, labels, fmt.max_length) for ids, labels in pairs]
    info = {"rows": len(examples), "tokens": sum(len(e.ids) for e in examples),
            "trained_tokens": sum(e.trained for e in examples),
            "prompt_truncated": sum(e.prompt_cut for e in examples),
            "response_truncated": sum(e.response_cut for e in examples)}
    return examples, info
