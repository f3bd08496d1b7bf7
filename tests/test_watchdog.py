"""The hang watchdog (tether/watchdog.py): one alert per phase that outlasts the bound, naming rank, phase, step,
since when and how long, with the threads' stacks; a real two-process PPO launch with rank 1 made to stall in its
reward phase (the TETHER_TEST_STALL test hook); and the doctor's verdict on the alerts it wrote."""

import io
import json
import threading
import time
from pathlib import Path

import pytest
from launcher import accelerate_launch

from tether.diagnostics.hangs import format_hang, read_hangs
from tether.errors import ConfigError
from tether.watchdog import (
    Hang,
    Stall,
    Watchdog,
    alert_writer,
    stall_from_env,
    start_watchdog,
    utc,
)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_one_alert_once_the_phase_outlasts_the_bound_and_one_when_it_ends():
    clock, reports = FakeClock(), []
    dog = Watchdog(10.0, rank=1, report=reports.append, clock=clock, wall=lambda: 1_800_000_000.0 + clock.t)
    dog.step_no = 3
    dog.enter("reward")
    clock.t += 9.9
    assert dog.check() is None  # under the bound
    clock.t += 0.2
    hang = dog.check()
    assert hang == Hang(rank=1, phase="reward", step=3, since=1_800_001_000.0, seconds=pytest.approx(10.1), seq=1)
    clock.t += 50
    assert dog.check() is None  # one alert per phase, however long it lasts
    dog.enter("after reward")
    assert len(reports) == 1 and reports[0].ended and reports[0].phase == "reward"
    assert reports[0].seconds == pytest.approx(60.1)
    clock.t += 20
    assert dog.check().phase == "after reward"  # the next phase is a new one: it may alert too
    dog.enter(None)  # idle: not watched
    clock.t += 100
    assert dog.check() is None
    record = hang.record()
    assert record == {"step": 3, "kind": "hang", "rank": 1, "phase": "reward", "since": utc(1_800_001_000.0),
                      "seconds": 10.1, "seq": 1, "alert": hang.line()}
    assert record["since"] == "2027-01-15T08:16:40Z"  # 1_800_001_000 s after the epoch, by `date -u -d @1800001000`
    assert hang.line().startswith("rank 1 in phase 'reward' at step 3 for 10.1 s (since 2027-01-15T08:16:40Z)")


def test_stopping_ends_a_phase_that_alerted():
    """The run's last phase (the export, process 0 writing while the others wait) ends when the watchdog stops."""
    clock, reports = FakeClock(), []
    dog = Watchdog(1.0, rank=0, report=reports.append, clock=clock)
    dog.enter("finish")
    clock.t += 2.5
    reports.append(dog.check())
    dog.stop()
    assert [(h.phase, h.ended, h.seconds) for h in reports] == [("finish", False, 2.5), ("finish", True, 2.5)]


def test_a_real_thread_writes_the_line_the_row_and_the_stacks(tmp_path):
    """Bound 0.5 s, a phase that lasts until the thread has alerted: one stderr line, one alerts.jsonl row, this
    thread's stack (it sleeps in this test function) in hang_stacks_rank0.txt; then the row saying the phase ended."""
    err = io.StringIO()
    dog = Watchdog(0.5, rank=0, report=alert_writer(tmp_path, stream=err)).start()
    try:
        dog.step_no = 2
        start, since = time.monotonic(), time.time()
        dog.enter("generate")
        alerts = tmp_path / "alerts.jsonl"
        while not (alerts.exists() and alerts.read_text().endswith("\n")) and time.monotonic() - start < 30:
            time.sleep(0.05)
        lasted = time.monotonic() - start
        dog.enter("after generate")
    finally:
        dog.stop()
    rows = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["hang", "hang_end"], rows
    hang = rows[0]
    assert (hang["rank"], hang["phase"], hang["step"]) == (0, "generate", 2)
    assert 0.5 <= hang["seconds"] <= lasted + 0.01  # not before the bound; the poll (a quarter of it) and load add a little
    assert abs(_epoch(hang["since"]) - since) <= 1.0  # to the second
    assert rows[1]["seconds"] >= hang["seconds"] and rows[1]["phase"] == "generate"  # the whole phase
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[hang] rank 0 in phase 'generate' at step 2 for ")
    assert "hang_stacks_rank0.txt" in lines[0] and hang["stacks"] == "hang_stacks_rank0.txt"
    stacks = (tmp_path / "hang_stacks_rank0.txt").read_text()
    assert "test_a_real_thread_writes_the_line_the_row_and_the_stacks" in stacks  # the stalled thread's frame
    assert not any(t.name == "tether-watchdog" for t in threading.enumerate())  # stop() ended the thread


def _epoch(stamp: str) -> float:
    from datetime import datetime, timezone

    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def test_the_step_timer_names_each_phase_and_part_to_the_watchdog():
    """PhaseTimer's blocks and splits are the phases the alerts name (tether.ppo.perf), in the order the step
    enters them; without a started watchdog marking does nothing."""
    from tether.ppo.perf import PhaseTimer

    seen = []
    dog = Watchdog(100, rank=0, report=lambda h: None)
    dog.enter = lambda phase: seen.append(phase)  # the marks, in order
    timer = PhaseTimer()
    with timer("generate"):
        pass
    dog.start()
    try:
        with timer("generate"):
            pass
        with timer("score"):
            timer.split("logprobs_old")
            timer.split("reference")
    finally:
        dog.stop()
    with timer("train"):
        pass
    assert seen == ["generate", "after generate", "score", "score (after logprobs_old)", "score (after reference)",
                    "after score", None]  # None: stop() leaves the last phase


def test_the_stall_hook_parses_or_says_what_it_wants():
    assert stall_from_env(None) is None
    assert stall_from_env("rank=1,phase=reward,seconds=5") == Stall(1, "reward", 5.0)
    assert stall_from_env("rank=0,phase=generate,seconds=0.5,step=2") == Stall(0, "generate", 0.5, 2)
    with pytest.raises(ConfigError, match="TETHER_TEST_STALL='rank=1': expected rank=R,phase=NAME"):
        stall_from_env("rank=1")
    assert start_watchdog(0, 0, Path(".")) is None  # --hang-timeout 0: off


def test_the_stall_hook_sleeps_once_on_its_rank_and_phase():
    slept = []
    dog = Watchdog(100, rank=1, report=lambda h: None, stall=Stall(1, "reward", 0.3, step=2))
    for step in (1, 2, 3):
        dog.step_no = step
        start = time.monotonic()
        dog.enter("reward")
        slept.append(time.monotonic() - start)
    assert slept[1] >= 0.3 and slept[0] < 0.1 and slept[2] < 0.1
    other = Watchdog(100, rank=0, report=lambda h: None, stall=Stall(1, "reward", 5.0))
    start = time.monotonic()
    other.enter("reward")
    assert time.monotonic() - start < 0.1  # another rank's stall


def test_hang_timeout_must_be_below_the_collective_timeout():
    from tether.ppo.config import RunConfig

    cfg = RunConfig()
    cfg.model.policy, cfg.data.prompts, cfg.reward.sources = "tiny-gpt2", "p.jsonl", ["tether.rules:char_share"]
    cfg.health.hang_seconds, cfg.collective_timeout_minutes = 600.0, 10.0
    with pytest.raises(ConfigError, match=r"--hang-timeout 600: not below the collective timeout \(10 min = 600 s\)"):
        cfg.validate()


def test_the_default_bound_stays_below_a_short_collective_timeout():
    """Unset, the bound is 300 s, or half the collective timeout when that is shorter (--collective-timeout-minutes
    3 was refused by a fixed 300 s default)."""
    from tether.ppo.checks import hang_seconds
    from tether.ppo.config import RunConfig

    cfg = RunConfig()
    cfg.model.policy, cfg.data.prompts, cfg.reward.sources = "tiny-gpt2", "p.jsonl", ["tether.rules:char_share"]
    assert hang_seconds(cfg) == 300.0
    cfg.collective_timeout_minutes = 3.0
    cfg.validate()
    assert hang_seconds(cfg) == 90.0
    cfg.health.hang_seconds = 20.0
    assert hang_seconds(cfg) == 20.0


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_processes_one_stalled_in_reward_both_alert_and_the_run_finishes(tmp_path, capsys):
    """The issue's done-when: rank 1 sleeps 8 s on entering step 1's reward phase; with --hang-timeout 1 both
    processes write their alert within the bound plus slack — rank 1 in 'reward', rank 0 waiting in a collective of a
    later phase — and the run then finishes its 2 steps. The doctor names rank 1 and 'reward' first."""
    from tiny import make_policy_dir, make_prompts_file

    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    out = tmp_path / "run"
    args = ["-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward",
            "tether.rules:char_share", "--output-dir", str(out), "--steps", "2", "--batch-size", "4",
            "--mini-batches", "2", "--max-new-tokens", "5", "--progress", "false", "--eval-every", "0",
            "--eval-fraction", "0", "--hang-timeout", "1"]
    done = accelerate_launch(args, tmp_path / "logs", timeout=300,
                             env={"TETHER_TEST_STALL": "rank=1,phase=reward,seconds=8,step=1"})
    assert [r["step"] for r in rows_of(out / "metrics.jsonl")] == [1, 2]  # the run went on and finished
    hangs = {}  # the first row of each rank and kind (under load a later phase, e.g. the export, may alert too)
    for r in rows_of(out / "alerts.jsonl"):
        if r.get("kind", "").startswith("hang"):
            hangs.setdefault((r["rank"], r["kind"]), r)
    stalled, waiting = hangs[(1, "hang")], hangs[(0, "hang")]
    assert (stalled["phase"], stalled["step"]) == ("reward", 1), hangs
    assert waiting["step"] == 1 and waiting["phase"] != "reward" and waiting["seq"] > stalled["seq"], hangs
    for r in (stalled, waiting):  # the bound, a poll of 0.25 s, and slack: a 2-core machine at load 17 delays threads
        assert 1.0 <= r["seconds"] < 6.0, hangs
    assert hangs[(1, "hang_end")]["seconds"] >= 8.0  # the stall's whole length, once it ended
    assert "_draw_round" in (out / "hang_stacks_rank1.txt").read_text()  # its stack: in the draw's reward block
    assert "distributed_c10d.py" in (out / "hang_stacks_rank0.txt").read_text()  # rank 0's: in a collective
    logs = done.stderr + "".join(p.read_text() for p in (tmp_path / "logs").glob("**/stderr.log"))
    assert "[hang] rank 1 in phase 'reward' at step 1" in logs and "[hang] rank 0 in phase" in logs

    from tether.cli import main

    main(["doctor", str(out)])  # its exit code is the metrics' verdict: a stall that ended adds nothing to it
    verdict = capsys.readouterr().out.splitlines()
    assert verdict[0].startswith(f"{out}: HANG: rank 1 stalled in 'reward' at step 1 for "), verdict
    assert "then it went on); the other ranks waited in the next collective (rank 0 in '" in verdict[0], verdict
    assert verdict[1] == "prescriptions for the stall:" and "hang_stacks_rank1.txt" in verdict[2], verdict


def write_alerts(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    other = {"step": 1, "alert": "[a band's alert]"}  # the health monitor's rows are skipped by the hang reader
    (run_dir / "alerts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [other, *rows]))


def hang_row(rank, phase, step, since, seconds, seq, kind="hang"):
    return {"step": step, "kind": kind, "rank": rank, "phase": phase, "since": utc(since), "seconds": seconds,
            "seq": seq, "alert": "..."}


def test_the_doctor_names_the_rank_behind_not_the_first_to_alert(tmp_path):
    """Rank 2 waited in a collective from before rank 0's stall began (it was ahead), so it alerted first; rank 0 is
    the one behind (lowest step, then fewest phases entered) and is named. A later, separate stall is counted."""
    t = 1_800_000_000
    write_alerts(tmp_path, [
        hang_row(2, "after reward", 4, t, 300.0, 41),
        hang_row(0, "checkpoint", 3, t + 20, 300.0, 37),
        hang_row(1, "generate", 4, t + 21, 300.0, 30),
        hang_row(0, "checkpoint", 3, t + 20, 310.0, 37, kind="hang_end"),
        hang_row(1, "generate", 9, t + 5000, 300.0, 80),
    ])
    hang = read_hangs(tmp_path)
    assert hang["stalled"] == {"rank": 0, "phase": "checkpoint", "step": 3, "since": utc(t + 20), "stacks": None,
                               "seconds": 310.0, "ended": True}
    assert [w["rank"] for w in hang["waiting"]] == [1, 2] and hang["episodes"] == 2
    text = format_hang(hang).splitlines()
    assert text[0] == (f"HANG: rank 0 stalled in 'checkpoint' at step 3 for 310.0 s (from {utc(t + 20)}; then it went "
                       "on); the other ranks waited in the next collective (rank 1 in 'generate' of step 4, rank 2 in "
                       "'after reward' of step 4) [2 stalls in the run; the first shown]")
    assert "process 0 writes the checkpoint alone" in text[2]


def test_doctor_on_a_run_stalled_before_its_first_row_names_the_stall_and_exits_1(tmp_path, capsys):
    from tether.cli import main

    write_alerts(tmp_path, [hang_row(1, "reward", 1, 1_800_000_000, 301.5, 3),
                            hang_row(0, "after reward", 1, 1_800_000_001, 300.4, 4)])
    assert main(["doctor", str(tmp_path)]) == 1  # no metrics.jsonl: the stall is the whole verdict
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{tmp_path}: HANG: rank 1 stalled in 'reward' at step 1 for at least 301.5 s")
    assert "no end recorded" in out[0] and "(rank 0 in 'after reward')" in out[0]
    assert main(["doctor", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["hang"]["stalled"]["phase"] == "reward"
    (tmp_path / "alerts.jsonl").unlink()
    assert main(["doctor", str(tmp_path)]) == 2  # no stall and no metrics: the usual one-line error
