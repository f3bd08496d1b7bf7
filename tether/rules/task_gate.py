"""A reward for the task beside its check (#51): a checker's score times a relevance gate.

A reward that is only a verifiable instruction's checker ("finish with this exact phrase …") pays as much for the
phrase alone as for a note about winter that ends with it; GRPO finds the cheaper answer. :func:`task_and_check`
wraps any checker so that it pays only for answers that still do the task:

    score = check(prompt, answer) · gate(prompt, answer),    gate ∈ [0, 1]

The gate needs no task-specific code and no model; it is the product of

- own content: min(1, n_own / min_own), n_own = the answer's distinct content words (not stop words; letters of
  two or more, or numbers) that the prompt does not hold. "Any other questions?" to a prompt that asks for that
  phrase has none: gate 0; the instruction echoed back: none; a real note: many.
- topic: 1 when the answer, outside the runs of three or more words it copies from the prompt (the required
  phrase), shares a content word with the prompt or states a number the prompt lacks (a computed result), else 0
  (an answer about something else with the phrase attached).
- no repetition: 1 − the share of the answer's segments (lines, sentences) that repeat an earlier one
  (a title repeated in place of the content: 1 − (n−1)/n).
- a length floor, only where the prompt rows carry the reference policy's answer in a ``reference`` column:
  min(1, words / (length_floor · reference words)).

The same text features serve the doctor's per-problem shortcut detector (:mod:`tether.diagnostics.shortcut`).
Use from the command line as ``--reward tether.rules.task_gate:gated:check=tether.rules:math_answer,min_own=3``
(the checker a ``module:function`` without arguments of its own), or from Python as ``task_and_check(checker)``.
Imports only the standard library (the checker by :func:`tether.rules.loading.load_rule`).
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache
from typing import Callable

STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just let me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves
""".split())
_TOKEN = re.compile(r"[^\W_]+")  # runs of letters and digits (Unicode)
_SEGMENT = re.compile(r"\n+|(?<=[.!?])\s+")  # lines, and sentences ended by . ! ? and a space


def _singular(w: str) -> str:
    """A plural's crude singular, so that "rivers" in a prompt and "river" in the answer are one word: a trailing
    "s" dropped from words of four or more letters not ending in "ss" (stop words and numbers kept)."""
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") and w not in STOPWORDS else w


def words(text: str) -> list[str]:
    """Every word and number of ``text``, lower-cased, plurals made singular (:func:`_singular`), in order."""
    return [_singular(w) for w in _TOKEN.findall(str(text).lower())]


def content_words(text: str) -> list[str]:
    """The words that carry content, in order: numbers, and words of two or more letters not in :data:`STOPWORDS`."""
    return [w for w in words(text) if w.isdigit() or (len(w) > 1 and w not in STOPWORDS)]


def own_words(answer: str, prompt: str) -> set[str]:
    """The answer's distinct content words that the prompt does not hold: what it adds of its own."""
    return set(content_words(answer)) - set(words(prompt))


def echo_share(answer: str, prompt: str) -> float:
    """Share of the answer's content words (counted with repeats) that are the prompt's own words; 1 for an answer
    with no content word (nothing of its own either)."""
    mine = content_words(answer)
    held = set(words(prompt))
    return sum(w in held for w in mine) / len(mine) if mine else 1.0


def repeated_share(answer: str) -> float:
    """Share of the answer's segments (lines, and sentences ended by . ! ?; compared lower-cased, on their words)
    that repeat an earlier segment: 1 − distinct / segments; 0 with fewer than two segments."""
    segments = [" ".join(words(s)) for s in _SEGMENT.split(str(answer))]
    segments = [s for s in segments if s]
    return 1.0 - len(set(segments)) / len(segments) if len(segments) > 1 else 0.0


def unquoted(answer: str, prompt: str, n: int = 3) -> list[str]:
    """The answer's words outside every run of ``n`` or more words copied in order from the prompt (a required
    phrase, the instruction echoed): what the answer says in its own arrangement."""
    said, asked = words(answer), words(prompt)
    grams = {tuple(asked[i:i + n]) for i in range(len(asked) - n + 1)}
    copied = [False] * len(said)
    for i in range(len(said) - n + 1):
        if tuple(said[i:i + n]) in grams:
            copied[i:i + n] = [True] * n
    return [w for w, c in zip(said, copied) if not c]


def on_topic(answer: str, prompt: str) -> bool:
    """Outside what it copies from the prompt (:func:`unquoted`), the answer shares a content word with the prompt
    or states a number the prompt lacks (a result computed from it); True for a prompt without content words."""
    topic = set(content_words(prompt))
    if not topic:
        return True
    mine = content_words(" ".join(unquoted(answer, prompt)))
    return any(w in topic for w in mine) or any(w.isdigit() for w in set(mine) - set(words(prompt)))


def relevance_gate(prompt: str, answer: str, *, min_own: int = 3, reference: str | None = None,
                   length_floor: float = 0.5) -> float:
    """The gate of the module docstring, in [0, 1]: own content × topic × (1 − repetition) × length floor (the
    floor only with a ``reference`` answer and ``length_floor`` > 0)."""
    gate = min(1.0, len(own_words(answer, prompt)) / min_own) if min_own > 0 else 1.0
    gate *= float(on_topic(answer, prompt)) * (1.0 - repeated_share(answer))
    if reference is not None and length_floor > 0 and words(reference):
        gate *= min(1.0, len(words(answer)) / (length_floor * len(words(reference))))
    return gate


def _text(item) -> str:
    """A prompt or completion as text: a string as it is; a chat (a list of ``{"role", "content"}`` messages, TRL's
    conversational form) as its messages' contents joined by newlines."""
    if isinstance(item, str):
        return item
    if isinstance(item, (list, tuple)):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in item)
    return str(item)


def _call_check(check: Callable, prompts: list, responses: list, fields: dict) -> list:
    """The checker's scores, called as a tether rule ``f(prompts, responses, **fields)`` or, when its signature
    names ``completions`` and not ``responses``, as a TRL reward function (``prompts=``, ``completions=``); only the
    keywords it accepts unless it takes ``**kwargs``."""
    try:
        params = inspect.signature(check).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    if "completions" in params and "responses" not in params:
        return list(check(prompts=prompts, completions=responses, **fields))
    return list(check(prompts, responses, **fields))


def task_and_check(check: Callable, *, min_own: int = 3, length_floor: float = 0.5) -> Callable:
    """A reward rule: ``check``'s score of each answer times :func:`relevance_gate` (module docstring). The rule
    takes ``(prompts, responses, **fields)`` as tether calls rules, or TRL's ``prompts=``/``completions=``
    keywords; a ``reference`` column (the reference policy's answers) turns on the length floor. A row the checker
    does not judge (None) stays None; a checker result of the wrong length is its own error."""
    def score(prompts=None, responses=None, completions=None, **fields) -> list:
        responses = completions if responses is None else responses
        if prompts is None or responses is None:
            raise TypeError("task_and_check: needs prompts and responses (or completions=)")
        checked = _call_check(check, prompts, responses, fields)
        if len(checked) != len(responses):
            return checked  # the caller's one-line error names the wrong length
        references = fields.get("reference") or [None] * len(responses)
        return [None if c is None else float(c) * relevance_gate(
            _text(p), _text(r), min_own=min_own, length_floor=length_floor,
            reference=None if ref is None else _text(ref)) for p, r, c, ref in zip(prompts, responses, checked,
                                                                                   references)]

    score.__name__ = f"task_and_check({getattr(check, '__name__', 'check')})"
    return score


@lru_cache(maxsize=16)
def _loaded(spec: str) -> Callable:
    from tether.rules.loading import load_rule

    return load_rule(spec, flag="tether.rules.task_gate:gated check=")


def gated(prompts=None, responses=None, check: str = "", min_own: int = 3, length_floor: float = 0.5,
          completions=None, **fields) -> list:
    """:func:`task_and_check` for a rule spec:
    ``--reward tether.rules.task_gate:gated:check=MODULE:FUNCTION[,min_own=N,length_floor=F]``; the checker is loaded
    once. Called positionally or with TRL's ``completions=``."""
    if not check:
        from tether.errors import TetherError

        raise TetherError("tether.rules.task_gate:gated: needs check=MODULE:FUNCTION (the checker it gates)")
    return task_and_check(_loaded(str(check)), min_own=int(min_own), length_floor=float(length_floor))(
        prompts, responses, completions, **fields)
