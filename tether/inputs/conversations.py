"""Prompts as chat messages: TRL's conversational format, next to the HH transcripts tether reads as text.

A prompt is either text (an HH transcript ``"\\n\\nHuman: …\\n\\nAssistant:"`` becomes its turns, any other text
one user message) or a list of messages ``[{"role": "system"|"user"|"assistant", "content": str}, …]``.
:func:`chat_messages` gives the messages a chat template renders for either; :func:`prompt_text` the text a
model without a chat template reads (messages become an HH transcript, the layout such models were trained on).

A preference record in the conversational form has ``chosen``/``rejected`` as message lists: the prompt is the
explicit ``prompt`` (messages or text), or else the messages the two sides share from the start (TRL's implicit
prompt); each reply is then one assistant message (:func:`conversational_pair`).
"""

from __future__ import annotations

import json
import re

from tether.errors import DataError

ASSISTANT = "\n\nAssistant:"
_TURN = re.compile(r"\n\n(Human|Assistant):")
ROLES = ("system", "user", "assistant")
_SPEAKERS = {"system": "System", "user": "Human", "assistant": "Assistant"}


def transcript_messages(prompt: str) -> list[dict[str, str]] | None:
    """Chat messages of an HH-style prompt (``"\\n\\nHuman: …\\n\\nAssistant: …\\n\\nHuman: …\\n\\nAssistant:"``):
    ``[{"role": "user", …}, {"role": "assistant", …}, …, {"role": "user", …}]`` with stripped contents;
    ``None`` when the text is not such a transcript (then it is one user message)."""
    if not prompt.startswith("\n\nHuman:") or not prompt.endswith(ASSISTANT):
        return None
    parts = _TURN.split(prompt)  # ['', 'Human', ' hi', 'Assistant', ' hello', ..., 'Assistant', '']
    roles = {"Human": "user", "Assistant": "assistant"}
    messages = [{"role": roles[who], "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2])]
    return messages[:-1]  # the last one is the empty assistant turn being scored


def split_transcript(text: str) -> tuple[str, str] | None:
    """``(prompt, reply)`` of an HH-style transcript: the prompt runs up to and including the last
    ``"\\n\\nAssistant:"``; ``None`` when there is no such marker."""
    cut = text.rfind(ASSISTANT)
    if cut < 0:
        return None
    cut += len(ASSISTANT)
    return text[:cut], text[cut:]


def check_messages(value, where: str, key: str, last_role: str | None = None) -> list[dict[str, str]]:
    """``value`` as a list of ``{"role", "content"}`` messages (other keys dropped), or a one-line DataError
    naming the field and the message. ``last_role``: the role the last message must have."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: field '{key}' must be text or a non-empty list of messages")
    messages = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: field '{key}' message {i}: expected {{'role': ..., 'content': ...}}, "
                            f"got {str(m)[:60]}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: field '{key}' message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: field '{key}' message {i}: content must be text, "
                            f"got {type(m['content']).__name__}")
        messages.append({"role": m["role"], "content": m["content"]})
    if last_role and messages[-1]["role"] != last_role:
        raise DataError(f"{where}: field '{key}': the last message must be the {last_role}'s, "
                        f"got {messages[-1]['role']!r}")
    return messages


def chat_messages(prompt) -> list[dict[str, str]]:
    """The messages a chat template renders for ``prompt`` (text or messages), as a new list."""
    if isinstance(prompt, (list, tuple)):
        return [dict(m) for m in prompt]
    return transcript_messages(prompt) or [{"role": "user", "content": prompt}]


def prompt_text(prompt) -> str:
    """``prompt`` as text for a model without a chat template: text as it is, messages as an HH transcript that
    ends with ``"\\n\\nAssistant:"``, where the reply follows."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"\n\n{_SPEAKERS[m['role']]}: {m['content']}" for m in prompt) + ASSISTANT


def prompt_key(prompt) -> str:
    """A string that identifies ``prompt`` (text or messages): for grouping and sorting by prompt."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _one_reply(messages: list[dict], where: str, key: str) -> str:
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(m["role"] for m in messages) or "none"
        raise DataError(f"{where}: field '{key}': the reply after the prompt must be one assistant message, "
                        f"got {len(messages)} ({roles})")
    if not messages[0]["content"].strip():
        raise DataError(f"{where}: field '{key}': the reply is empty")
    return messages[0]["content"]


def conversational_pair(record: dict, where: str) -> tuple[list[dict], str, str] | str:
    """``(prompt messages, chosen reply, rejected reply)`` of a record whose ``chosen``/``rejected`` (or
    ``prompt``) are message lists, or why it carries no preference (``"identical"``, ``"no_shared_prompt"``).
    With no ``prompt``, the prompt is the longest run of messages both sides start with."""
    sides = {}
    for key in ("chosen", "rejected"):
        if key not in record or record[key] is None:
            raise DataError(f"{where}: missing field '{key}' (found: {', '.join(map(str, record)) or 'none'})")
        value = record[key]
        sides[key] = value if isinstance(value, str) else check_messages(value, where, key)
    prompt = record.get("prompt")
    if prompt is not None:
        messages = check_messages(prompt, where, "prompt") if not isinstance(prompt, str) else chat_messages(prompt)
        chosen, rejected = (v if isinstance(v, str) else _one_reply(v, where, k) for k, v in sides.items())
    else:
        text = [k for k, v in sides.items() if isinstance(v, str)]
        if text:
            raise DataError(f"{where}: 'chosen' and 'rejected' must both be message lists when there is no "
                            f"'prompt' field ('{text[0]}' is text)")
        c, r = sides["chosen"], sides["rejected"]
        shared = next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
        if c == r:
            return "identical"
        if shared == 0:
            return "no_shared_prompt"
        messages = c[:shared]
        chosen, rejected = _one_reply(c[shared:], where, "chosen"), _one_reply(r[shared:], where, "rejected")
    if chosen == rejected:
        return "identical"
    return messages, chosen, rejected
