"""The check satisfied, the task dropped (#51): the doctor's per-problem shortcut detector, over the held-out answers a
run recorded (``samples/step_K.jsonl``: each problem's prompt, answer and reward ``score``, in prompt order, the same
problems at every evaluation).

A reward that is a verifiable instruction's checker cannot tell "a note about winter that ends with 'Any other
questions?'" from "Any other questions?": both pass. A mean over every answer (``eval/reference_overlap``) cannot see
a shortcut taken on a third of the prompts. This module looks problem by problem: among the held-out problems whose
reward rose from the first evaluation to a later one, it counts those whose answer dropped the task, by signals that
need no task-specific code (:func:`task_signals`), each judged against the first answer to the same prompt (the
reference policy's, with ``--eval-at-start``) so that a property the task itself asks for does not count:

- ``echo``: ≥ 80% of the answer's content words are the prompt's own words (the instruction or its phrase echoed
  back; a number counts as the answer's own, a result even where the prompt holds it);
- ``repeated``: ≥ half of its lines/sentences repeat an earlier one (a title repeated in place of the content);
- ``off topic``: it shares none of the prompt's topic words — its content words that the first answer took up, or
  that few of the evaluation's prompts hold (:func:`rare_words`) — in any form (:func:`_same_word`), and states no
  number the prompt lacks (an arithmetic result is content of its own);
- ``far shorter``: under a quarter of the first answer's words (that one ≥ 8 words) with fewer than three content
  words of its own, none a number.

The test, with the gold bands' alarm levels (:data:`~tether.diagnostics.health.GOLD_WARN`/``GOLD_ALARM`` as one-sided
z): the k flagged problems among the n whose reward rose, against a tolerated share r₀ = :data:`TOLERATED` of gains
flagged by chance (a reworded answer that trips a signal),

    p = P[X ≥ k],  X ~ Binomial(n, r₀) (exact),   z = Φ⁻¹(1 − p)

so "3 of 3 gains" alarms (p = 0.001) and "1 of 67" does not. Beside it, the reward's own paired gain (exact one-sided
McNemar, as the gold bands pair problems) and the same counting only the gains that kept the task. Imports only the
standard library and tether's text features (:mod:`tether.rules.task_gate`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tether.diagnostics.gold import mcnemar_one_sided, z_of
from tether.diagnostics.health import GOLD_ALARM, GOLD_WARN, TASK_DROPPED
from tether.rules.task_gate import content_words, own_words, repeated_share, words

KEY = "eval/task_dropped"  # the doctor's name for the measure (computed from samples/, not a metrics.jsonl key)
TOLERATED = 0.1  # r₀: share of the gains the signals may flag by chance
ECHO, REPEATED, SHORTER, MIN_REFERENCE_WORDS = 0.8, 0.5, 0.25, 8
SIGNALS = ("echo", "repeated", "off topic", "far shorter")
RARE, MIN_PROMPTS = 0.1, 10  # a topic word: in at most a tenth of the evaluation's prompts (of ten or more)


def task_signals(prompt: str, answer: str, reference: str, topic_words: frozenset = frozenset()) -> list[str]:
    """Which of :data:`SIGNALS` say that ``answer`` dropped the task ``prompt`` sets, judged against ``reference``
    (the first answer to the same prompt): each counts only where the reference does not show it too. The topic is
    the prompt's content words the reference took up, and ``topic_words`` (:func:`rare_words`: the prompt's own
    words, not the instructions every prompt shares) — a title "<<spring: a refreshing spring of love>>" to a letter
    about spring is on the topic though the first answer never said "spring"."""
    out = []
    if _phrase_echo(answer, prompt) >= ECHO > _phrase_echo(reference, prompt):
        out.append("echo")
    if repeated_share(answer) >= REPEATED > repeated_share(reference):
        out.append("repeated")
    mine, own = set(content_words(answer)), own_words(answer, prompt)
    topic = set(content_words(prompt)) & (set(content_words(reference)) | topic_words)
    if topic and not any(_same_word(a, t) for a in mine for t in topic) and not any(w.isdigit() for w in own):
        out.append("off topic")
    n_ref = len(words(reference))
    if (n_ref >= MIN_REFERENCE_WORDS and len(words(answer)) < SHORTER * n_ref and len(own) < 3
            and not any(w.isdigit() for w in own)):
        out.append("far shorter")
    return out


def _phrase_echo(answer: str, prompt: str) -> float:
    """:func:`~tether.rules.task_gate.echo_share` with every number counted as the answer's own: a number the prompt
    holds is a result ("8 - 0 =" → "The answer is 8."), not the instruction or its phrase echoed back."""
    mine = content_words(answer)
    held = set(words(prompt))
    return sum(w in held and not w.isdigit() for w in mine) / len(mine) if mine else 1.0


def _same_word(a: str, b: str) -> bool:
    """One word or two forms of it: equal, or a common prefix of five letters or more ("garden", "gardener",
    "gardening"; not "apple" and "applause")."""
    if a == b:
        return True
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n >= 5


def rare_words(prompts: list[str]) -> list[frozenset]:
    """Per prompt, its content words that at most :data:`RARE` of the evaluation's prompts hold (at least
    :data:`MIN_PROMPTS` of them; else none): the words that set this prompt apart — its topic, its numbers — and
    not the instruction or the form a task's prompts share."""
    sets = [frozenset(content_words(p)) for p in prompts]
    if len(sets) < MIN_PROMPTS:
        return [frozenset()] * len(sets)
    counts = Counter(w for s in sets for w in s)
    return [frozenset(w for w in s if counts[w] <= RARE * len(sets)) for s in sets]


def binomial_upper_tail(k: int, n: int, r: float) -> float:
    """P[X ≥ k] for X ~ Binomial(n, r), summed term by term in logs (no overflow at large n); 1 for k ≤ 0."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(r)
                 + (n - i) * math.log1p(-r) for i in range(k, n + 1)]
    top = max(log_terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in log_terms))


@dataclass
class Finding:
    """One evaluation (``step``) against the first (``first_step``), on the ``n`` problems recorded at both."""

    step: int
    first_step: int
    n: int
    gained: int  # problems whose reward rose
    lost: int  # problems whose reward fell
    dropped: list[dict] = field(default_factory=list)  # the gained problems flagged: prompt, answers, signals
    p: float = 1.0  # P[X ≥ k], X ~ Binomial(gained, TOLERATED)
    z: float = 0.0
    state: str = "ok"
    p_gain: float = 1.0  # exact one-sided McNemar p of the reward's gain
    p_kept: float = 1.0  # the same with the flagged gains left out
    eval_n: int | None = None  # held-out problems per evaluation (config.yaml eval.n), when known

    @property
    def share(self) -> float:
        return len(self.dropped) / self.gained if self.gained else 0.0

    def describe(self) -> str:
        k = len(self.dropped)
        return (f"step {self.step}: {k} of the {self.gained} held-out problems whose reward rose since step "
                f"{self.first_step} dropped the task ({100 * self.share:.0f}%; p = {self.p:.2g} that more than "
                f"{100 * TOLERATED:.0f}% did, z = {self.z:.2f}); the reward's paired gain: {self.gained} up, "
                f"{self.lost} down (p = {self.p_gain:.2g}), counting only answers that kept the task: "
                f"{self.gained - k} up (p = {self.p_kept:.2g}); {self.n} problems recorded at both evaluations")

    def to_dict(self) -> dict:
        return {**asdict(self), "share": self.share}


def _state(z: float) -> str:
    return "alarm" if z > GOLD_ALARM else "warn" if z > GOLD_WARN else "ok"


def judge(first: list[dict], later: list[dict], step: int, first_step: int) -> Finding:
    """``later``'s samples against ``first``'s, problem by problem (the same index and prompt, a finite ``score`` in
    both); each sample's ``reference`` answer (the step-0 answer) is the baseline where present, else the first
    evaluation's answer."""
    f = Finding(step, first_step, 0, 0, 0)
    topics = rare_words([_text(b.get("prompt")) for b in later])
    for i, (a, b) in enumerate(zip(first, later)):
        s0, s1 = _score(a), _score(b)
        if s0 is None or s1 is None or a.get("prompt") != b.get("prompt") or not isinstance(b.get("response"), str):
            continue
        f.n += 1
        f.lost += s1 < s0
        if s1 <= s0:
            continue
        f.gained += 1
        reference = b["reference"] if isinstance(b.get("reference"), str) else str(a.get("response", ""))
        prompt = _text(b.get("prompt"))
        signals = task_signals(prompt, b["response"], reference, topics[i])
        if signals:
            f.dropped.append({"index": i, "prompt": prompt, "response": b["response"], "reference": reference,
                              "signals": signals, "score": s1, "first_score": s0})
    k = len(f.dropped)
    f.p = binomial_upper_tail(k, f.gained, TOLERATED)
    f.z = z_of(f.p)
    f.state = _state(f.z) if k else "ok"
    f.p_gain, f.p_kept = mcnemar_one_sided(f.gained, f.lost), mcnemar_one_sided(f.gained - k, f.lost)
    return f


def _score(sample) -> float | None:
    s = sample.get("score") if isinstance(sample, dict) else None
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) else None


def _text(prompt) -> str:
    if isinstance(prompt, list):  # a chat: its messages' contents
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


def load_evaluations(run_dir: str | Path) -> list[tuple[int, list[dict]]]:
    """(step, samples) of every readable ``samples/step_K.jsonl`` of the run, in step order; a file that is not
    JSON lines of objects is left out (the doctor judges what it can read)."""
    out = []
    for path in (Path(run_dir) / "samples").glob("step_*.jsonl"):
        m = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
        try:
            samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if m and samples and all(isinstance(s, dict) for s in samples):
            out.append((int(m.group(1)), samples))
    return sorted(out, key=lambda e: e[0])


def judge_run(run_dir: str | Path, rows: list[dict]) -> list[Finding]:
    """Every later evaluation against the first, in step order ([] with fewer than two recorded evaluations), each
    knowing the run's ``eval.n`` where its config.yaml says it, capped at the problems the evaluation read
    (``eval/n`` of the run's metrics ``rows``, as the doctor loaded them)."""
    evaluations = load_evaluations(run_dir)
    if len(evaluations) < 2:
        return []
    (first_step, first), later = evaluations[0], evaluations[1:]
    trace = [judge(first, samples, step, first_step) for step, samples in later]
    eval_n = _eval_n(Path(run_dir) / "config.yaml")
    evaluated = _evaluated_n(rows)
    for f in trace:
        # eval.n is an upper bound: a held-out split with fewer problems evaluates them all (eval/n at that step)
        f.eval_n = eval_n if evaluated.get(f.step) is None or eval_n is None else min(eval_n, evaluated[f.step])
    return trace


def _evaluated_n(rows: list[dict]) -> dict[int, int]:
    """``{step: eval/n}``: how many held-out problems each evaluation read."""
    return {r["step"]: r["eval/n"] for r in rows
            if isinstance(r, dict) and isinstance(r.get("eval/n"), int) and isinstance(r.get("step"), int)}


def _eval_n(path: Path) -> int | None:
    import yaml

    try:
        n = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("eval", {}).get("n")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def examples(finding: Finding, n: int = 3) -> list[dict]:
    """Up to ``n`` flagged problems, one per set of signals first (so each way of dropping the task shows), in
    prompt order."""
    chosen, seen = [], set()
    for d in finding.dropped:
        if tuple(d["signals"]) not in seen:
            seen.add(tuple(d["signals"]))
            chosen.append(d)
    chosen += [d for d in finding.dropped if d not in chosen]
    return sorted(chosen[:n], key=lambda d: d["index"])


def _point(f: Finding) -> dict:
    return {"step": f.step, "value": f.share, "measure": f.z, "state": f.state}


def evidence(trace: list[Finding], chain: list[dict]) -> dict:
    """The verdict's evidence in the doctor's shape (tether.diagnostics.doctor._evidence): the z of each evaluation,
    the stretch that ends in the last one's alarm, and example answers beside the reference's."""
    last = trace[-1]
    start = len(trace) - 1
    while start > 0 and trace[start - 1].state != "ok":
        start -= 1
    onset = trace[start]
    alarm = next(f for f in trace[start:] if f.state == "alarm")
    return {"band": "task_dropped", "key": KEY, "measure": "value", "healthy": f"z ≤ {GOLD_WARN:g}",
            "alarm": f"z > {GOLD_ALARM:g}",
            "meaning": (f"held-out problems whose reward rose while the answer dropped the task (the prompt's words "
                        f"echoed, a line repeated, off topic, far shorter than the first answer), against "
                        f"{100 * TOLERATED:.0f}% flagged by chance: z of the exact binomial tail. "
                        + last.describe()),
            "onset": _point(onset), "first_alarm": _point(alarm), "peak": _point(max(trace, key=lambda f: f.z)),
            "series": [_point(f) for f in trace[-6:]], "chain": chain, "finding": last.to_dict(),
            "answers": [{"prompt": d["prompt"], "response": d["response"], "reference": d["reference"],
                         "signals": d["signals"], "overlap": _overlap(d["response"], d["reference"])}
                        for d in examples(last)]}


def _overlap(a: str, b: str) -> float:
    from tether.diagnostics.text import word_f1

    return word_f1(a, b)


def add_verdict(d, trace: list[Finding], prescriptions: list[dict]) -> None:
    """Put the last evaluation's finding into the doctor's verdict ``d`` (a
    :class:`~tether.diagnostics.doctor.Diagnosis`): an alarm is the verdict (the bands that alarmed before it go
    into its chain) unless a gold band is — a fall of the task's own truth measure stays the verdict, this becomes a
    note; a warning is a note; ok adds nothing."""
    if not trace:
        return
    last = trace[-1]
    if last.eval_n is not None and last.n < last.eval_n:  # eval.samples < eval.n: part of the problems only
        d.notes.append(f"the shortcut check read {last.n} of the {last.eval_n} held-out problems (those written to "
                       f"samples/; set eval.samples to eval.n to judge every one)")
    if last.state == "ok":
        return
    gold_verdict = not d.healthy and d.evidence.get("measure") in ("gold", "gold_collapse")
    if last.state == "warn" or gold_verdict:
        level = "warning" if last.state == "warn" else "also in alarm"
        shown = "; ".join(f"{x['prompt'][:60]!r} -> {x['response'][:60]!r}" for x in examples(last, 2))
        d.notes.insert(0, f"{level} ({TASK_DROPPED}): {last.describe()}; e.g. {shown}")
        return
    chain = [] if d.healthy else [{"band": d.cause_band, "key": d.cause_metric, "failure_mode": d.failure_mode,
                                   "onset_step": d.first_step, "alarm_step": d.alarm_step},
                                  *d.evidence.get("chain", [])]
    e = evidence(trace, chain)
    d.healthy, d.failure_mode, d.cause_metric, d.cause_band = False, TASK_DROPPED, KEY, "task_dropped"
    d.first_step, d.alarm_step, d.evidence, d.prescriptions = e["onset"]["step"], e["first_alarm"]["step"], e, \
        prescriptions
