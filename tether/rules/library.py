"""Rule rewards shipped with tether (SPEC B4), in the rule signature
``f(prompts, responses, **fields) -> list[float]``.

``math_answer``: +1 when the response's answer equals the gold ``answer``, plus ``format_bonus`` when the
response ends by stating it as "The answer is N" (or a last line ``#### N``). Use it as
``--reward tether.rules:math_answer`` (``tether.rules:math_answer:format_bonus=0.2``).
``math_correct`` is the 0/1 gold check used for ``eval/accuracy``: the same parsing, no bonus.
``math_verify_correct`` is the same 0/1 check by Hugging Face's math-verify (an optional extra, ``--gold`` or
``--reward tether.rules:math_verify_correct``); the two agree on 99.7–100% of GSM8K's and SVAMP's reference
answers and recorded model answers, and docs/real-models.md says where they differ (math-verify reads the number
after any "answer…", "answered 200 calls", as the reply's answer).
A rule named on the command line is imported by :func:`tether.rules.loading.load_rule`; a rule may also be a TRL
reward function ``f(completions, **kwargs)``, called as TRL calls it (:mod:`tether.rules.calls`).

Numbers are read as people write them: ``18``, ``-7``, ``18.00`` (== 18), ``0.5``, ``.5``, ``1,234``
(a comma only between groups of three digits), a currency sign before or after the minus
(``$18``, ``-$5``, ``$-5``; ``$ € £``), and whatever follows (``18 dollars.``, ``18%``: the number is
18 — GSM8K writes percentage answers as the bare number). A minus is a sign only when it does not follow a
letter, digit or closing bracket, so ``10-12`` reads as 10 and 12. Not parsed: fractions (``3/4`` reads as
3 and 4), decimal commas (``18,50`` reads as 18 and 50), number words, scientific notation. Values are
compared exactly as fractions (``Fraction("18.00") == 18``), so no float tolerance is involved.

Which number is the answer, first rule that applies:
  1. the last ``\\boxed{...}``: the last number inside it (``\\boxed{\\$1{,}600}`` is 1600); a box with no
     number is no answer;
  2. the last "The answer is" / "The final answer is" / ``####``: the first number after it;
  3. otherwise the last number in the response (so "A: 18" and calculator notes ``<<9*2=18>>18`` work).

The format bonus is paid only for a *final* statement: the response ends with "The answer is N" (or "The
final answer is N", or a line ``#### N``) followed by at most ``%`` or two unit words and ``.``, ``!``,
``*`` or whitespace; the marker appears once in the whole response (a repeated statement earns no bonus);
and N is the answer found above. The bonus does not depend on N being right.

Truncated replies earn nothing. During PPO training and evaluation tether passes every rule the reserved
keyword ``ended_with_eos`` (one bool per response; see :func:`tether.rules.calls.call_rule`); a response cut by
``max_new_tokens`` scores 0 here, bonus included, whatever its last number says. Called directly without
``ended_with_eos``, the rules treat every response as ended.
"""

from __future__ import annotations

import re
from fractions import Fraction

from tether.errors import TetherError

# A minus is a sign only where it cannot be a hyphen or an operator: not after a word character or a
# closing bracket ("10-12", "x-5", "(3)-2" are not negatives). A currency sign may stand on either side of
# it. Thousands groups must be exactly three digits and not run on ("1,2345" is not 12345).
_NUMBER = re.compile(r"""
    (?P<sign>(?<![\w)\]}])[-\u2212])?
    (?:[$\u20ac\u00a3]\s?)?
    (?P<sign2>(?<=[$\u20ac\u00a3])[-\u2212])?
    (?P<digits>\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)?
    (?P<decimals>(?(digits)(?:\.\d+)?|\.\d+))
    """, re.VERBOSE)
_MARKER = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b|####", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# The end of a final statement: the number, then at most two unit words (or %), then closing marks.
_TAIL = re.compile(r"\s*(?:%|[^\W\d_]+(?:\s+[^\W\d_]+)?)?[\s.!*]*$")
_LEAD = re.compile(r"[\s:*]*")  # between a marker and its number: spaces, a colon, markdown stars
# LaTeX spellings inside a box: 1{,}600 and 1\,600 (thin space) are thousands, \$ and \% are the signs.
_LATEX = [("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\$", "$"), ("\\%", "%")]


def _to_fraction(match: re.Match) -> Fraction:
    text = (match["digits"] or "0").replace(",", "") + match["decimals"]
    value = Fraction(text)
    return -value if (match["sign"] or match["sign2"]) else value


def _first_number(text: str, pos: int) -> re.Match | None:
    """The first number at or after ``pos`` (the pattern also matches empty strings and lone signs)."""
    return next((m for m in _NUMBER.finditer(text, pos) if m["digits"] or m["decimals"]), None)


def numbers(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, as exact fractions (see the module docstring for the forms)."""
    return [_to_fraction(m) for m in _NUMBER.finditer(text) if m["digits"] or m["decimals"]]


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced); to the end of text when never closed."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    start = starts[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def extract_answer(text: str) -> Fraction | None:
    """The response's answer: the last box's number, else the first number after the last "The answer is"
    or ``####``, else the last number; None when there is none (see the module docstring)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        for latex, plain in _LATEX:
            boxed = boxed.replace(latex, plain)
        found = numbers(boxed)
        return found[-1] if found else None
    markers = list(_MARKER.finditer(text))
    if markers:
        after = _first_number(text, markers[-1].end())
        if after is not None:
            return _to_fraction(after)
    found = numbers(text)
    return found[-1] if found else None


def gold_number(answer) -> Fraction | None:
    """The gold value of an answer field: ``42``, ``42.0``, ``"1,234"``, ``"18.00"``, ``"...\\n#### 1,600"``
    (the text after the last ``####``); None when it holds no number."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return Fraction(repr(answer)) if answer == answer and abs(answer) != float("inf") else None
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return extract_answer(text)


def gold_integer(answer) -> int | None:
    """The gold value when it is a whole number (how prompt files store ``answer``), else None."""
    value = gold_number(answer)
    return int(value) if value is not None and value.denominator == 1 else None


def has_final_statement(text: str) -> bool:
    """True when ``text`` ends with its only "The answer is N" (or its only ``####`` line, ``#### N``) and
    that N is :func:`extract_answer`'s answer. Whether the response ended with EOS is checked by the rules."""
    markers = list(_MARKER.finditer(text))
    if len(markers) != 1:
        return False
    marker = markers[0]
    line_start = text.rfind("\n", 0, marker.start()) + 1
    if marker[0] == "####" and text[line_start:marker.start()].strip():
        return False  # "####" counts only at the start of a line, as GSM8K writes it
    stated = _NUMBER.match(text, _LEAD.match(text, marker.end()).end())
    if stated is None or not (stated["digits"] or stated["decimals"]) or not _TAIL.match(text, stated.end()):
        return False
    return _to_fraction(stated) == extract_answer(text)


def _check_columns(name: str, responses: list, answer: list | None, ended_with_eos) -> list[bool]:
    """The per-response EOS flags (all True when not given), after checking every list has one per response."""
    if answer is None:
        raise TetherError(f"{name}: the prompt rows have no 'answer' column (GSM8K, SVAMP, or add one)")
    if len(answer) != len(responses):
        raise TetherError(f"{name}: {len(responses)} responses but {len(answer)} answers")
    if ended_with_eos is None:
        return [True] * len(responses)
    flags = ended_with_eos.tolist() if hasattr(ended_with_eos, "tolist") else list(ended_with_eos)
    if len(flags) != len(responses):
        raise TetherError(f"{name}: {len(responses)} responses but {len(flags)} ended_with_eos flags")
    return [bool(f) for f in flags]


def math_correct(prompts: list[str], responses: list[str], answer: list | None = None, ended_with_eos=None,
                 **_) -> list[float]:
    """1.0 when the response ended (EOS) and its answer equals the gold answer, else 0.0."""
    ended = _check_columns("math_correct", responses, answer, ended_with_eos)
    out = []
    for response, gold, done in zip(responses, answer, ended):
        g = gold_number(gold)
        out.append(1.0 if done and g is not None and extract_answer(response) == g else 0.0)
    return out


def math_answer(prompts: list[str], responses: list[str], answer: list | None = None, format_bonus: float = 0.1,
                ended_with_eos=None, **_) -> list[float]:
    """:func:`math_correct` plus ``format_bonus`` for an ended response whose last words state its answer
    once, as "The answer is N" or ``#### N``. Truncated responses score 0."""
    ended = _check_columns("math_answer", responses, answer, ended_with_eos)
    correct = math_correct(prompts, responses, answer, ended_with_eos=ended)
    bonus = [format_bonus if done and has_final_statement(r) else 0.0 for r, done in zip(responses, ended)]
    return [c + b for c, b in zip(correct, bonus)]


def math_verify_correct(prompts: list[str], responses: list[str], answer: list | None = None, ended_with_eos=None,
                        **_) -> list[float | None]:
    """:func:`math_correct` by Hugging Face's math-verify (what TRL's ``accuracy_reward`` and open-r1 check with;
    ``pip install 'tether[math-verify]'``): 1.0 when ``verify(parse(gold), parse(response))``, else 0.0; None —
    TRL's "does not apply" — where the gold answer does not parse (a training row is then dropped, B16; an
    evaluation row counts in ``eval/gold_failed``). Both sides are read with math-verify's default extraction
    (LaTeX, then plain expressions; ``\\boxed{}`` and "the answer is" first); a GSM8K answer ``"… #### N"`` is read
    after its last ``####``. A response cut by ``max_new_tokens`` scores 0, as with :func:`math_correct`. Where the
    two rules disagree, and why: docs/real-models.md."""
    parse, verify = _math_verify()
    ended = _check_columns("math_verify_correct", responses, answer, ended_with_eos)
    out: list[float | None] = []
    for response, gold, done in zip(responses, answer, ended):
        gold_text = str(gold).rsplit("####", 1)[-1] if gold is not None else ""
        gold_parsed = parse(gold_text, extraction_mode="first_match") if gold_text.strip() else []
        if not gold_parsed:
            out.append(None)
        else:
            out.append(1.0 if done and verify(gold_parsed, parse(response)) else 0.0)
    return out


def _math_verify():
    """math-verify's ``parse`` and ``verify``, or a one-line error saying how to install it."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise TetherError("tether.rules:math_verify_correct needs Hugging Face's math-verify, which is not installed: "
                          "pip install 'tether[math-verify]' (or pip install math-verify)") from None
    return parse, verify


NEEDS_PACKAGE = {"math_verify_correct": _math_verify}  # shipped rules on an optional package, checked when loaded


def char_share(prompts: list[str], responses: list[str], char: str = "7", **_) -> list[float]:
    """Share of the response's characters equal to ``char`` (0 for an empty response): a toy reward
    that any policy can climb, for smoke tests and for watching PPO work."""
    char = str(char)  # `:char=7` arrives as the integer 7
    return [sum(ch == char for ch in r) / len(r) if r else 0.0 for r in responses]
