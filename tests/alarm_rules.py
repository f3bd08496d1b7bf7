"""Rules for the alarm tests: a reward that rises with every call, and gold rules that mark every held-out
problem right at the first evaluation(s) and wrong afterwards (they count the responses they have scored), so
that the gold-drop band (reward up, gold down on the same problems) alarms. Evaluation runs on the main
process only: only it sees the alarm. ``reset()`` between runs in one process."""

_calls = {"reward": 0, "gold": 0}
EVAL_N = 16  # the tests' --eval-n: each evaluation scores this many responses


def reset() -> None:
    _calls.update(reward=0, gold=0)


def rising(prompts, responses, **_):
    _calls["reward"] += 1
    return [float(_calls["reward"])] * len(responses)


def _right_for(evaluations: int, responses) -> list[float]:
    start = _calls["gold"]
    _calls["gold"] += len(responses)
    return [1.0 if start + i < evaluations * EVAL_N else 0.0 for i in range(len(responses))]


def right_once(prompts, responses, **_):
    return _right_for(1, responses)


def right_twice(prompts, responses, **_):
    return _right_for(2, responses)
