"""``tether rlhf``'s results: the held-out gold of every arm at every evaluation, paired against step 0, the doctor on
each PPO arm, one markdown report and one ``results.json``.

Step 0 is the start policy's greedy evaluation (the first PPO arm's step-0 row: every arm starts from it, on the same
held-out problems). Each later evaluation is paired with it problem by problem (``eval/correct``): gained = right
now and wrong at step 0, lost = the reverse, p = McNemar's exact two-sided test
(:func:`tether.core.stats.mcnemar_exact`); accuracies carry Wilson 95% intervals. A refresh round's steps count on
from the round before (round r, step k = step r · steps + k of the arm's whole history).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tether.config import config_to_dict
from tether.core.stats import mcnemar_exact, wilson_interval


def eval_rows(run_dir: Path) -> list[dict]:
    """The evaluation rows of a PPO run's ``metrics.jsonl`` with their per-problem results, in step order."""
    from tether.diagnostics.gold import with_problem_results

    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if path.is_file() else []
    return [r for r in with_problem_results(rows, run_dir) if "eval/accuracy" in r]


def paired_point(step: int, correct: str, base: str | None, reward=None) -> dict:
    """One evaluation: accuracy with its Wilson interval, and against step 0 (``base``) gained, lost and McNemar's p."""
    n, right = len(correct), correct.count("1")
    low, high = wilson_interval(right, n)
    point = {"step": step, "n": n, "accuracy": right / n if n else float("nan"), "low": low, "high": high,
             "correct": correct}
    if reward is not None:
        point["reward"] = reward
    if base is not None and len(base) == n:
        gained = sum(a == "1" and b == "0" for a, b in zip(correct, base))
        lost = sum(a == "0" and b == "1" for a, b in zip(correct, base))
        point.update(gained=gained, lost=lost, p_vs_step0=mcnemar_exact(gained, lost))
    return point


def arm_round(run_dir: Path, base: str | None, offset: int, record: dict) -> dict:
    """A PPO arm's round: its evaluations against step 0, s/step, wall time and the doctor's verdict."""
    from tether.diagnostics.doctor import diagnose_run

    rows = eval_rows(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip()] \
        if metrics.is_file() else []
    seconds = [r["perf/seconds_step"] for r in steps if isinstance(r.get("perf/seconds_step"), (int, float))]
    try:
        d = diagnose_run(run_dir)
        doctor = {"level": d.level, "summary": d.summary(), "failure_mode": d.failure_mode}
    except Exception as e:  # noqa: BLE001 - a run the doctor cannot read is reported, not fatal to the report
        doctor = {"level": "unread", "summary": f"{type(e).__name__}: {e}"}
    return {"dir": str(run_dir), "seconds": record.get("seconds"), "stopped": record.get("stopped"),
            "s_per_step": statistics.median(seconds) if seconds else None, "doctor": doctor,
            "evals": [paired_point(offset + r["step"], r["eval/correct"], base, r.get("eval/reward"))
                      for r in rows if isinstance(r.get("eval/correct"), str)]}


def collect(cfg, out: Path, plan: list, records: dict) -> dict:
    """Everything the report shows, from the stages' records and the arms' folders."""
    ppo = [st for st in plan if st.kind == "ppo"]
    first = eval_rows(out / ppo[0].name) if ppo else []
    base_row = next((r for r in first if r["step"] == 0 and isinstance(r.get("eval/correct"), str)), None)
    base = base_row["eval/correct"] if base_row else None
    arms: dict = {}
    for st in ppo:
        arm, r = st.name[len("ppo_"):].rsplit("_r", 1)
        arms.setdefault(arm, {})[r] = arm_round(out / st.name, base, int(r) * st.arm[4], records.get(st.name, {}))
    dpo = records.get("dpo_r0")
    if dpo and isinstance(dpo.get("eval", {}).get("eval/correct"), str):
        ev = dpo["eval"]
        note = f"not a PPO run (DPO: step = its {dpo.get('steps', 0)} optimiser steps)"
        arms["dpo"] = {"0": {"dir": str(out / "dpo_r0"), "seconds": dpo.get("seconds"), "s_per_step": None,
                             "doctor": {"level": "-", "summary": note},
                             "evals": [paired_point(dpo.get("steps", 0), ev["eval/correct"], base,
                                                    ev.get("eval/reward"))]}}
    return {"config": config_to_dict(cfg),
            "dpo_vs_ppo": dpo_against_ppo(arms),
            "vs_control": against_control(arms),
            "twin_free": twin_free(out / "task", arms, base),
            "step0": paired_point(0, base, None) if base else None,
            "pairs": {k: v for k, v in records.items() if k.startswith("pairs_")},
            "reward_models": {k: v for k, v in records.items() if k.startswith("rm_")},
            "stage_seconds": {k: v.get("seconds") for k, v in records.items()},
            "arms": arms}


def paired(a: str, b: str) -> tuple[int, int, float]:
    """Problems only ``a`` got right, only ``b`` got right (two ``eval/correct`` strings) and McNemar's exact p."""
    only_a = sum(x == "1" and y == "0" for x, y in zip(a, b))
    only_b = sum(x == "0" and y == "1" for x, y in zip(a, b))
    return only_a, only_b, mcnemar_exact(only_a, only_b)


def dpo_against_ppo(arms: dict) -> list[dict]:
    """The DPO arm against each PPO arm's last evaluation, problem by problem: only DPO right, only PPO right and
    McNemar's exact p ([] without a DPO arm)."""
    if "dpo" not in arms:
        return []
    dpo = arms["dpo"]["0"]["evals"][-1]["correct"]
    out = []
    for arm, rounds in arms.items():
        last_round = max(rounds, key=int) if arm != "dpo" else None
        if last_round is None or not rounds[last_round]["evals"]:
            continue
        ppo = rounds[last_round]["evals"][-1]
        if len(ppo["correct"]) != len(dpo):
            continue
        only_dpo, only_ppo, p = paired(dpo, ppo["correct"])
        out.append({"arm": arm, "round": int(last_round), "step": ppo["step"], "only_dpo": only_dpo,
                    "only_ppo": only_ppo, "p": p})
    return out


def against_control(arms: dict) -> list[dict]:
    """Every arm's evaluation at a step the control arm was evaluated at (after step 0) against the control's, problem
    by problem — what the reward model's information adds over training on a reward that says nothing (the DPO arm
    against the control's last evaluation). [] without a control arm."""
    if "control" not in arms:
        return []
    control = {e["step"]: e["correct"] for e in arms["control"]["0"]["evals"] if e["step"] > 0}
    if not control:
        return []
    out = []
    for arm, rounds in arms.items():
        if arm == "control":
            continue
        seen = set()  # a refresh round's step 0 is the round before's last policy: paired once
        for r in sorted(rounds, key=int):
            for e in rounds[r]["evals"]:
                step = max(control) if arm == "dpo" else e["step"]
                if step in control and len(control[step]) == len(e["correct"]) and e["step"] not in seen:
                    seen.add(e["step"])
                    only_arm, only_control, p = paired(e["correct"], control[step])
                    out.append({"arm": arm, "round": int(r), "step": e["step"], "control_step": step,
                                "only_arm": only_arm, "only_control": only_control, "p": p})
    return out


def twin_free(task_dir: Path, arms: dict, base: str | None) -> dict | None:
    """Every arm's last evaluation of each round on the held-out problems with no twin in training
    (:mod:`tether.pipeline.twins`), paired against step 0 on the same problems; None without step 0 or the split."""
    from tether.pipeline.twins import select, twin_flags

    if base is None:
        return None
    try:
        train, held = ([json.loads(x) for x in (task_dir / name).read_text(encoding="utf-8").splitlines() if x.strip()]
                       for name in ("train.jsonl", "heldout.jsonl"))
    except (OSError, ValueError):
        return None
    keep = [not twin for twin in twin_flags(train, held)][:len(base)]
    base_kept = select(base, keep)
    evals = []
    for arm, rounds in arms.items():
        for r in sorted(rounds, key=int):
            e = rounds[r]["evals"][-1] if rounds[r]["evals"] else None
            if e and len(e["correct"]) == len(base):
                evals.append({"arm": arm, "round": int(r), **paired_point(e["step"], select(e["correct"], keep),
                                                                           base_kept)})
    return {"n": len(base), "twins": len(keep) - sum(keep), "step0": paired_point(0, base_kept, None),
            "evals": evals}


def pct(p: dict) -> str:
    return f"{100 * p['accuracy']:.1f}% [{100 * p['low']:.1f}, {100 * p['high']:.1f}]"


def report_markdown(results: dict) -> str:
    """The one table: per arm and round, every evaluation's accuracy [Wilson 95%], gained / lost against step 0 and
    McNemar's p, s/step, the arm's wall time and the doctor; then the pairs and reward models."""
    lines = ["# tether rlhf", ""]
    if results.get("step0"):
        lines += [f"Step 0 (the start policy, greedy): {pct(results['step0'])} on {results['step0']['n']} held-out "
                  "problems. p: McNemar's exact test against step 0 on the same problems.", ""]
    lines += ["| arm | round | step | gold accuracy [Wilson 95%] | gained / lost vs step 0 | p | held-out RM reward "
              "| s/step | wall (s) | doctor |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, rounds in results["arms"].items():
        for r, rr in rounds.items():
            for i, e in enumerate(rr["evals"]):
                last = i == len(rr["evals"]) - 1
                vs = f"+{e['gained']} / −{e['lost']}" if "gained" in e else "–"
                p = f"{e['p_vs_step0']:.3g}" if "p_vs_step0" in e else "–"
                reward = f"{e['reward']:.3f}" if isinstance(e.get("reward"), float) else "–"
                sps = f"{rr['s_per_step']:.1f}" if last and rr.get("s_per_step") else ""
                wall = f"{rr['seconds']:.0f}" if last and rr.get("seconds") is not None else ""
                doctor = rr["doctor"]["summary"] if last else ""
                lines.append(f"| {arm} | {r} | {e['step']} | {pct(e)} | {vs} | {p} | {reward} | {sps} | {wall} | "
                             f"{doctor} |")
    tf = results.get("twin_free")
    if tf and tf["twins"]:
        lines += ["", f"{tf['twins']} of the {tf['n']} held-out problems have a twin in training (the same words in "
                  "another order, the same answer): a memorised answer gets them right. On the other "
                  f"{tf['n'] - tf['twins']} (step 0: {pct(tf['step0'])}):", "",
                  "| arm | round | step | gold accuracy without twins [Wilson 95%] | gained / lost vs step 0 | p |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {e['arm']} | {e['round']} | {e['step']} | {pct(e)} | +{e['gained']} / −{e['lost']} | "
                  f"{e['p_vs_step0']:.3g} |" for e in tf["evals"]]
    if results.get("dpo_vs_ppo"):
        lines += ["", "DPO against each PPO arm's last evaluation, on the same held-out problems:", "",
                  "| PPO arm | round | step | only DPO right | only PPO right | p |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['arm']} | {c['round']} | {c['step']} | {c['only_dpo']} | {c['only_ppo']} | {c['p']:.3g} |"
                  for c in results["dpo_vs_ppo"]]
    if results.get("vs_control"):
        lines += ["", "Each arm against the shuffled-reward control at the same step, on the same held-out problems "
                  "(what the reward model's information adds over a reward that says nothing):", "",
                  "| arm | round | step | control step | only the arm right | only the control right | p |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['arm']} | {c['round']} | {c['step']} | {c['control_step']} | {c['only_arm']} | "
                  f"{c['only_control']} | {c['p']:.3g} |" for c in results["vs_control"]]
    lines += ["", "| stage | pairs | sample accuracy | reward model held-out [Wilson 95%] "
              "| probe: mean AUC, top-1 right | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for name, rec in {**results["pairs"], **results["reward_models"]}.items():
        if name.startswith("pairs_"):
            accuracy = f"{100 * rec['sample_accuracy']:.1f}%"
            lines.append(f"| {name} | {rec['pairs']} | {accuracy} | | | {rec['seconds']:.0f} |")
        else:
            h, pr = rec["held_out"], rec["probe"]
            held = (f"{h['accuracy']:.3f} [{h['wilson_low']:.3f}, {h['wilson_high']:.3f}] on {h['n_pairs']}"
                    if isinstance(h.get("accuracy"), float) else "–")
            probe = f"{pr['mean_auc']:.2f}, {pr['top1_right']:.2f}" if pr.get("mean_auc") is not None else "–"
            lines.append(f"| {name} | | | {held} | {probe} | {rec['seconds']:.0f} |")
    stages = sum(v for v in results.get("stage_seconds", {}).values() if v is not None)
    if "total_seconds" in results:
        lines += ["", f"Stages: {stages:.0f} s in all, each as its own run took it; this invocation "
                  f"{results['total_seconds']:.0f} s (a complete stage is skipped and costs nothing)."]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    from tether.runlog import write_text_atomic

    write_text_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / "report.md", report_markdown(results))
