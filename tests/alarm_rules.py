"""Rules for the multi-process alarm test: a reward that rises with every call and a gold rule that is
right on its first call only, so that the gold-drop band (reward up, gold down) alarms at the second
evaluation. Evaluation runs on the main process only: only it sees the alarm."""

_calls = {"reward": 0, "gold": 0}


def rising(prompts, responses, **_):
    _calls["reward"] += 1
    return [float(_calls["reward"])] * len(responses)


def right_once(prompts, responses, **_):
    _calls["gold"] += 1
    return [1.0 if _calls["gold"] == 1 else 0.0] * len(responses)
