"""The doctor's reading of a "no signal in the groups" alarm (SPEC B17, D1-D2).

With K samples per prompt, a group whose samples all got the same score gives every group baseline (RLOO, GRPO,
Dr. GRPO) a zero advantage: the rollout spent on it teaches nothing. Which way the groups are flat decides the
cure: none of the samples rewarded (the task is too hard for the policy: easier prompts, SFT first), all of them
(too easy: harder prompts), or every sample of the step alike (the reward does not vary: check it). A larger K
helps the first two: K samples hold a success with probability 1 − (1 − p)^K. The metrics are
``group/solved_fraction`` and ``group/unsolved_fraction`` (docs/metrics.md). Imports only the standard library.
"""

from __future__ import annotations


Prescription = tuple  # (action, config key, suggestion(current)[, done(current)]), as tether.diagnostics.prescriptions.Rx


def _double(current) -> str | None:
    return f"{2 * current}" if isinstance(current, int) and not isinstance(current, bool) else None


def _none(current) -> None:
    return None


FIRST: dict[str, Prescription] = {
    "unsolved": ("no sample of most groups is rewarded: easier prompts, or more SFT first (a group baseline "
                 "learns only where some samples of a prompt succeed)", "data.prompts", _none),
    "solved": ("every sample of most groups is already rewarded: harder prompts (a solved group teaches "
               "nothing more)", "data.prompts", _none),
    "constant": ("every sample of the step got the same score: check that the reward varies (a constant rule, "
                 "or scores clipped flat by reward.clip)", "reward.sources", _none),
}
THEN: list[Prescription] = [
    ("drop the groups with no spread and draw more prompts in their place (DAPO's dynamic sampling, B18)",
     "difficulty.filter_groups", lambda current: "true", lambda current: current is True),
    ("a prompt curriculum: prompts every sample of which passed (or failed) in their recent visits drawn less "
     "often (B18)", "difficulty.curriculum", lambda current: "true", lambda current: current is True),
    ("more samples per prompt: K samples hold a success (or a failure) with probability 1 − (1 − p)^K",
     "samples_per_prompt", _double),
    # no key: reward.process is how a process reward model's scores become rewards, and is set (per_step) whether
    # or not the run scores with one
    ("a denser reward: partial credit, or a process reward model's step rewards (--reward PRM_DIR --prm-reward "
     "per_step)", None, _none),
]


def flat_groups_kind(rows: list[dict], since_step: int = 0) -> str:
    """``unsolved``, ``solved`` or ``constant``: where the flat groups of ``rows`` (metrics.jsonl, from step
    ``since_step`` on) sit. Solved and unsolved are disjoint unless every sample of a step scored alike (then
    each equals the no-spread share). Such a step is read by its score against the run's range of step scores
    (``objective/scores``): at the bottom its groups are unsolved, at the top solved — a 0/1 reward on a task the
    policy rarely solves gives many steps with no right sample at all. Only when no step's score differs from
    another's (or none is recorded) is the reward itself called constant."""
    steps = [r for r in rows if r.get("step", 0) >= since_step and _number(r.get("group/no_spread_fraction"))]
    levels = [r["objective/scores"] for r in steps if _number(r.get("objective/scores"))]
    low, high = (min(levels), max(levels)) if levels else (0.0, 0.0)
    solved = unsolved = alike = 0.0
    for r in steps:
        flat = r["group/no_spread_fraction"]
        s, u = r.get("group/solved_fraction", 0.0), r.get("group/unsolved_fraction", 0.0)
        if not (flat > 0 and s + u > 1.5 * flat):
            solved, unsolved = solved + s, unsolved + u
        elif high > low and _number(r.get("objective/scores")):
            at_top = r["objective/scores"] - low > high - r["objective/scores"]
            solved, unsolved = solved + flat * at_top, unsolved + flat * (not at_top)
        else:
            alike += flat
    if alike > solved + unsolved:
        return "constant"
    return "solved" if solved > unsolved else "unsolved"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def flat_groups_prescriptions(rows: list[dict], since_step: int = 0) -> list[Prescription]:
    """The prescriptions for a "no signal in the groups" alarm, in priority order, the first for its kind."""
    return [FIRST[flat_groups_kind(rows, since_step)], *THEN]
