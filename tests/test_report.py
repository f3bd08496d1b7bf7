"""tether report: a self-contained HTML page (no network references, samples escaped), checked in a real
headless browser (no console errors, the plots drawn) when Chromium is installed."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tether.cli import main
from tether.diagnostics.report import _names, write_report

EVIL = '<script>alert("x")</script> & <b>bold</b>'


def make_run(root: Path, name: str, beta: float, n: int = 30) -> Path:
    """A synthetic run directory: metrics (with evals), config and eval samples."""
    run = root / name
    (run / "samples").mkdir(parents=True)
    rows = []
    for s in range(1, n + 1):
        drift = 0.0 if beta > 0 else 0.04 * s  # β = 0: KL and length run away
        row = {"step": s, "objective/scores_raw": 0.02 * s, "objective/kl": 0.01 + 0.002 * s + drift,
               "objective/kl_max": 0.4 + 10 * drift, "objective/kl_coef": beta,
               "policy/clip_fraction": 0.1 + 0.001 * s, "policy/ratio_std": 0.05, "policy/entropy": 1.5 - 0.01 * s,
               "value/loss": 1.0 / s, "value/explained_variance": min(0.8, 0.1 * s),
               "response/length_mean": 10 + (s * 0.5 if beta == 0 else 0), "response/length_min": 5,
               "response/length_max": 20 + s, "perf/seconds_generate": 0.5, "perf/seconds_score": 0.2,
               "perf/seconds_train": 1.0, "perf/seconds_step": 1.8, "perf/rollout_share": 0.28,
               "perf/tokens_per_second": 321.0}
        if s % 10 == 0:
            row.update({"eval/reward": 0.02 * s, "eval/accuracy": 0.5 + (0.01 * s if beta else -0.01 * s)})
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(yaml.safe_dump({"kl": {"coef": beta, "controller": "fixed"},
                                                     "optim": {"lr": 1e-5}, "ppo": {"epochs": 4}}))
    for k in (10, 30):
        samples = [{"prompt": "123+045=", "response": f"168 {name} step {k} #{i}", "score": 0.1 * i,
                    "kl": 0.5 * i, "length": 4, "truncated": False, "correct": i % 2 == 0} for i in range(4)]
        samples.append({"prompt": "1+1=", "response": EVIL, "score": 9.0, "kl": 99.0, "length": 40,
                        "truncated": True, "correct": False})
        (run / "samples" / f"step_{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    runs = [make_run(root, "beta", 0.05), make_run(root, "beta0", 0.0)]
    out = write_report(runs, root / "out" / "report.html", extra_html="<p id=extra>demo summary</p>")
    return out, out.read_text(encoding="utf-8")


def test_report_is_self_contained(report):
    path, page = report
    assert path.name == "report.html"
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", page, re.I)
    assert not re.search(r"<(script|iframe|object|embed)\b", page, re.I)
    srcs = re.findall(r"""src=['"]([^'"]+)['"]""", page)
    assert len(srcs) >= 10 and all(s.startswith("data:image/png;base64,") for s in srcs)
    png = base64.b64decode(srcs[0].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_escapes_samples(report):
    _, page = report
    assert EVIL not in page and "<b>bold</b>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in page
    assert "samples/step_30.jsonl" in page and "beta0 step 30" in page and "beta step 10" not in page


def test_report_content(report):
    _, page = report
    assert page.index("<p id=extra>demo summary</p>") < page.index("<h2>Runs</h2>")
    assert "beta (β = 0.05)" in page and "beta0 (β = 0)" in page
    assert "healthy (30 steps" in page  # the β > 0 run
    assert "UNHEALTHY: KL explosion" in page  # the β = 0 run
    assert "Rollout share of a step: <b>28%</b>" in page


def test_report_shows_the_paired_gold_evidence(tmp_path):
    """Per-problem results read from the samples files of a run made before eval/correct was recorded (the
    doctor's reading): the gold table lists each evaluation against the best before it, the counts by hand."""
    from tether.diagnostics.report import _gold_html, load_run

    run = make_run(tmp_path, "paired", 0.0, n=30)  # evaluations at 10, 20, 30 (5 samples at 10 and 30 only)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    results = {10: "11110", 20: "11100", 30: "00011"}
    for r in rows:
        if r["step"] in results:
            r.update({"eval/n": 5, "eval/accuracy": results[r["step"]].count("1") / 5})
        if r["step"] == 20:
            r["eval/correct"] = results[20]  # recorded in the row
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in (10, 30):  # the samples files hold all 5 problems in prompt order
        (run / "samples" / f"step_{k}.jsonl").write_text(
            "".join(json.dumps({"prompt": str(i), "correct": c == "1"}) + "\n" for i, c in enumerate(results[k])))
    page = _gold_html(load_run(run))
    cells = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)%</td><td>[^<]*</td><td>([^<]*)</td>", page)
    # step 20 against step 10: problem 2 right -> wrong; step 30 against step 10: 0, 1, 2 right -> wrong,
    # 4 wrong -> right
    assert cells == [("10", "80.0", "–"), ("20", "60.0", "1 / 0"), ("30", "40.0", "3 / 1")]
    assert f"<td>{5 / 16:.2g}</td><td>2</td>" in page  # P[X >= 3], X ~ Bin(4, 1/2) = 5/16; 2 candidates


def test_report_shows_the_three_levels(tmp_path):
    """The headline's levels on the page: the β > 0 run healthy (green), the same run with its last evaluation's gold
    (of 100 problems) a point below its first a WARNING (amber badge naming it, "warning (...)" in the verdicts, "WARNING: gold fell" in
    the diagnosis), the β = 0 run UNHEALTHY (red)."""
    fell = make_run(tmp_path, "fell", 0.05)
    rows = [json.loads(line) for line in (fell / "metrics.jsonl").read_text().splitlines()]
    for r in rows[9::10]:
        r["eval/n"] = 100
    rows[-1]["eval/accuracy"] = 0.59  # 60% at the first evaluation (step 10), 70% at step 20: no significant fall
    (fell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [make_run(tmp_path, "fine", 0.05), fell, make_run(tmp_path, "broken", 0.0)]
    page = write_report(runs, tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.count("<span class='badge ok'>healthy</span>") == 1
    assert page.count("<span class='badge warn'>warning: gold fell</span>") == 1
    assert page.count("<span class='badge bad'>") == 1
    assert "healthy (30 steps, no band in alarm)" in page and "warning (30 steps, no band in alarm; gold fell)" in page
    assert "WARNING: gold fell (below); no band reached its alarm in 30 steps" in page


def test_phase_table_splits_scoring(tmp_path):
    """A run with the split scoring phase: one row per phase in step order, no 'score' row counted on top,
    no 'other' row when the phases add up to the step; a run from before the split keeps its 'score' row."""
    from tether.diagnostics.report import _phase_html, load_run

    split = make_run(tmp_path, "split", 0.05, n=3)
    times = {"perf/seconds_generate": 0.5, "perf/seconds_weight_sync": 0.0, "perf/seconds_logprobs_old": 0.05,
             "perf/seconds_reference": 0.05, "perf/seconds_values": 0.025, "perf/seconds_reward": 0.075,
             "perf/seconds_score": 0.2, "perf/seconds_train": 1.0, "perf/seconds_step": 1.7, "perf/rollout_share": 0.5 / 1.7}
    rows = [{**json.loads(line), **times} for line in (split / "metrics.jsonl").read_text().splitlines()]
    (split / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = _phase_html(load_run(split))
    names = re.findall(r"</span>([^<]+)</td>", page)
    assert names == ["generate", "weight sync", "old log-probs", "reference", "values", "reward", "train"]
    assert "<td>0.05</td><td>3%</td>" in page  # old log-probs: 0.05 of 1.7 s
    old = _phase_html(load_run(make_run(tmp_path, "old", 0.05, n=3)))
    assert re.findall(r"</span>([^<]+)</td>", old) == ["generate", "score", "train", "other"]


def test_report_cli_output_and_errors(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path, "one", 0.1, n=5)
    assert main(["report", str(run), "-o", str(tmp_path / "x" / "r.html"), "--title", "T<1>"]) == 0
    assert "<title>T&lt;1&gt;</title>" in (tmp_path / "x" / "r.html").read_text()
    assert "r.html" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    calls = []  # the default output path, without drawing the page a second time
    monkeypatch.setattr("tether.diagnostics.report.write_report", lambda dirs, out, title=None: calls.append((dirs, out)))
    assert main(["report", str(run), str(tmp_path / "two")]) == 0
    assert calls == [([str(run), str(tmp_path / "two")], run / "report.html")]


def test_run_names_disambiguated():
    assert _names(["runs/a", "runs/b"]) == ["a", "b"]
    assert _names(["x/normal/run", "x/beta0/run"]) == ["normal/run", "beta0/run"]


def test_report_without_evals_samples_or_timing(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "objective/kl": 0.02}) + "\n"
                                               for s in range(1, 6)))
    page = write_report([run], tmp_path / "r.html").read_text()
    assert "No evaluation samples" in page and "No timing metrics" in page and "No data in any run for" in page


# ---------------------------------------------------------------- a real browser

CHROMIUM = "/usr/bin/chromium"
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--enable-logging=stderr", "--v=0", "--hide-scrollbars", "--window-size=1280,2000"]


def chromium_screenshot(page: Path, shot: Path, tmp: Path) -> str:
    """Open ``page`` in headless Chromium, screenshot it; return its stderr log (console messages)."""
    proc = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp / 'profile'}",
                           f"--screenshot={shot}", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file(), f"chromium wrote no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stderr


def console_errors(log: str) -> list[str]:
    # Chromium logs page console messages as "...:CONSOLE(line)] "message", source: ..."; uncaught
    # exceptions and failed loads appear there too.
    return [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.mark.slow
def test_report_in_headless_chromium(report, tmp_path):
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} not installed (bash .ci/install-browser.sh installs Debian's chromium)")
    import matplotlib.image as mpimg

    # The check can fail: a page with a console error is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><link rel='icon' href='data:,'></head><body>x"
                   "<script>console.error('tether-test-error'); nosuch();</script></body></html>")
    errors = console_errors(chromium_screenshot(bad, tmp_path / "bad.png", tmp_path))
    assert any("tether-test-error" in e for e in errors), "console errors are not captured"

    path, _ = report
    shot = tmp_path / "report.png"
    log = chromium_screenshot(path, shot, tmp_path)
    assert console_errors(log) == []
    img = mpimg.imread(shot)[..., :3]  # (H, W, 3) floats in [0, 1]
    assert img.shape[:2] == (2000, 1280)
    assert img.std() > 0.1  # not blank
    # Coloured pixels: plot lines, healthy bands, badges (text and frames are grey).
    saturation = img.max(axis=-1) - img.min(axis=-1)
    assert (saturation > 0.3).mean() > 0.005
    shutil.copy(shot, Path(path).with_suffix(".png"))  # kept beside the report for a human look
