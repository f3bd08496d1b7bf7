"""What ``tether doctor`` reads in the hang watchdog's rows (:mod:`tether.watchdog`): which rank stalled, in which
phase and step, for how long, what the other ranks were doing meanwhile, and what to do about it.

Each process of a multi-process run writes its own ``kind: hang`` row in ``alerts.jsonl`` when one phase outlasts
``health.hang_seconds``, and a ``hang_end`` row when that phase ends. In lock-step processes a stall in one shows
in the others as a wait in a collective of a later phase: of the rows of one episode (alerts whose stretches
overlap) the stalled rank is the one furthest behind — the lowest step, then the fewest phases entered (``seq``).
The doctor prints this first, above the metrics' verdict. Imports only the standard library.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

# What to look at first, per phase the stalled rank was in (the phases of tether.ppo.perf.PhaseTimer and the trainer).
BY_PHASE = {
    "reward": "the reward sources on that rank blocked or ran long (a remote call, a lock, a slow rule on one row): "
              "give the reward function a timeout of its own",
    "generate": "sampling on that rank ran long or got stuck (responses up to --max-new-tokens, an engine that does "
                "not return): bound it with --max-new-tokens, check the engine",
    "weight_sync": "the weight transfer to the rollout engine stalled on that rank: check the engine's process",
    "eval": "the held-out evaluation runs on the main process while the others wait: fewer prompts (--eval-n) or a "
            "--hang-timeout above its length",
    "checkpoint": "process 0 writes the checkpoint alone while the others wait: a slow disk or a big model; a "
                  "--hang-timeout above the save time, or a faster disk",
    "finish": "process 0 writes the final policy alone while the others wait: a slow disk or a big model",
}
DEFAULT = ("a forward or an update ran long on that rank alone (longer responses on that rank, a device that stopped "
           "answering): read its stacks")


def _epoch(stamp) -> float | None:
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def _rows(run_dir: Path) -> list[dict]:
    """The watchdog's rows of ``alerts.jsonl`` (other rows and unreadable lines skipped: the file is read for them
    alone here)."""
    path = Path(run_dir) / "alerts.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("kind") in ("hang", "hang_end") and _epoch(row.get("since")) is not None:
            rows.append(row)
    return rows


def read_hangs(run_dir: str | Path) -> dict:
    """The first stall of the run (``{}`` when the watchdog wrote nothing): ``stalled`` (rank, phase, step, since,
    seconds — the whole stall when it ended, else how long it had lasted at the alert — ``ended``, ``stacks``),
    ``waiting`` (the other ranks' alerts of the same episode) and ``episodes`` (stalls in the run)."""
    rows = _rows(Path(run_dir))
    alerts = sorted((r for r in rows if r["kind"] == "hang"), key=lambda r: _epoch(r["since"]) + r.get("seconds", 0))
    if not alerts:
        return {}
    ends = {(r.get("rank"), r.get("phase"), r.get("seq")): r for r in rows if r["kind"] == "hang_end"}

    def stretch(r: dict) -> tuple[float, float]:
        end = ends.get((r.get("rank"), r.get("phase"), r.get("seq")))
        return _epoch(r["since"]), _epoch(r["since"]) + (end["seconds"] if end else float("inf"))

    def overlapping(rows: list[dict], r0: dict) -> list[dict]:
        """The first row of each rank whose stretch overlaps ``r0``'s."""
        lo, hi = stretch(r0)
        firsts: dict = {}
        for r in rows:
            if stretch(r)[0] <= hi and stretch(r)[1] >= lo:
                firsts.setdefault(r.get("rank"), r)
        return list(firsts.values())

    episodes, left = [], list(alerts)
    while left:  # an episode: the rank behind among the first alerts, and the others' alerts during its stall
        candidates = overlapping(left, left[0])
        behind = min(candidates, key=lambda r: (r.get("step", 0), r.get("seq", 0)))
        episode = [behind] + [r for r in overlapping(left, behind) if r.get("rank") != behind.get("rank")]
        episodes.append(episode)
        left = [r for r in left if r not in episode]
    episode = episodes[0]
    behind = episode[0]
    end = ends.get((behind.get("rank"), behind.get("phase"), behind.get("seq")))
    stalled = {k: behind.get(k) for k in ("rank", "phase", "step", "since", "stacks")}
    stalled.update(seconds=end["seconds"] if end else behind.get("seconds"), ended=end is not None)
    waiting = [{k: r.get(k) for k in ("rank", "phase", "step", "seconds")}
               for r in sorted(episode, key=lambda r: r.get("rank", 0)) if r is not behind]
    return {"stalled": stalled, "waiting": waiting, "episodes": len(episodes),
            "prescriptions": hang_prescriptions(stalled)}


def hang_prescriptions(stalled: dict) -> list[str]:
    """What to do, first things first: the stacks, the phase's usual cause, the bound."""
    phase = str(stalled.get("phase") or "")
    name = phase.removeprefix("after ").split(" (")[0]
    out = []
    if stalled.get("stacks"):
        out.append(f"read rank {stalled['rank']}'s thread stacks in {stalled['stacks']} (the frame it was in)")
    out.append(BY_PHASE.get(name, DEFAULT))
    out.append("if that phase is only slow at this scale, not stuck: raise --hang-timeout (health.hang_seconds); a "
               "process that never comes back fails the run at --collective-timeout-minutes")
    return out


def format_hang(hang: dict, run_dir: str | Path = "") -> str:
    """The doctor's first lines: the stall, named by rank, phase and step; the others' waits; the prescriptions."""
    if not hang:
        return ""
    s, head = hang["stalled"], f"{run_dir}: " if run_dir else ""
    how = (f"for {s['seconds']:.1f} s (from {s['since']}; then it went on)" if s["ended"] else
           f"for at least {s['seconds']:.1f} s (from {s['since']}; no end recorded: it never left it, or the run "
           "was stopped there)")
    others = ("; the other ranks waited in the next collective (" + ", ".join(
        f"rank {w['rank']} in '{w['phase']}'" + (f" of step {w['step']}" if w["step"] != s["step"] else "")
        for w in hang["waiting"]) + ")") if hang["waiting"] else "; no other rank wrote an alert"
    more = f" [{hang['episodes']} stalls in the run; the first shown]" if hang["episodes"] > 1 else ""
    lines = [f"{head}HANG: rank {s['rank']} stalled in '{s['phase']}' at step {s['step']} {how}{others}{more}",
             "prescriptions for the stall:"]
    lines += [f"  {i}. {p}" for i, p in enumerate(hang["prescriptions"], 1)]
    return "\n".join(lines)
