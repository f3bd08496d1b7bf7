"""``tether report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page about one or more PPO runs (D4), or
reward-model runs (``tether train-rm`` output: its ``metrics.jsonl`` of training loss and batch accuracy).

The page holds the curves (reward, gold metric with its paired intervals, KL mean and max, β, clip fraction,
ratio std, value loss, explained variance, entropy, length) with every run on shared axes and the health
bands shaded, the doctor's verdict per run with its paired gold evidence, the phase-time breakdown with the
rollout share, and sample responses from the last evaluation. Plots are PNGs from matplotlib's Agg backend embedded as base64; nothing on the
page refers to the network, and every string from a run (samples, names) is HTML-escaped.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tether.diagnostics.doctor import (
    PHASES,  # noqa: F401  the phase table's rows, shared with the doctor; kept importable from here
    Diagnosis,
    config_value,
    diagnose,
    format_diagnosis,
    health_config_from_run,
    load_metrics,
    load_run_config,
    phase_seconds,
    rollout_layout,
)
from tether.diagnostics.gold import with_problem_results
from tether.diagnostics.health import HealthConfig, resolve_bands
from tether.errors import TetherError

GOLD_TITLE = "Gold accuracy (bars: paired 95% vs best so far)"
# (title, [(metric key, line style)], band name for shading or None, y log scale)
PANELS = [
    ("Reward (mean sequence score; dots: eval)", [("objective/scores_raw", "-"), ("eval/reward", "o")], None, False),
    (GOLD_TITLE, [("eval/accuracy", "o-")], None, False),
    ("KL to reference, mean per token", [("objective/kl", "-")], "kl_mean", False),
    ("KL to reference, max per token", [("objective/kl_max", "-")], "kl_max", True),
    ("β (KL coefficient)", [("objective/kl_coef", "-")], None, False),
    ("Clip fraction", [("policy/clip_fraction", "-")], "clip_fraction", False),
    ("Ratio std (π/π_old)", [("policy/ratio_std", "-")], "ratio_std", False),
    ("Value loss", [("value/loss", "-")], None, True),
    ("Explained variance", [("value/explained_variance", "-")], "explained_variance", False),
    ("Groups of K samples with no score spread (share; dashed: none rewarded)",
     [("group/no_spread_fraction", "-"), ("group/unsolved_fraction", "--")], "no_spread", False),
    ("Group score spread (mean within-group std)", [("group/reward_spread", "-")], None, False),
    ("Policy entropy", [("policy/entropy", "-")], None, False),
    ("Response length (mean; one run: min–max shaded)", [("response/length_mean", "-")], None, False),
    ("Model FLOPs utilisation (step; dashed: train phase)", [("perf/mfu", "-"), ("perf/mfu_train", "--")], None,
     False),
    ("Reward model: training loss (−log σ(r_w − r_l))", [("rm/loss", "-")], None, False),
    ("Reward model: batch accuracy (r_w > r_l)", [("rm/accuracy", "-")], None, False),
    ("SFT: loss per labelled token (dots: held-out)", [("sft/loss", "-"), ("eval/loss", "o")], None, False),
]
PHASE_COLORS = {"generate": "#1f77b4", "weight sync": "#17becf", "score": "#ff7f0e", "old log-probs": "#ff7f0e",
                "reference": "#e377c2", "values": "#8c564b", "reward": "#bcbd22", "train": "#2ca02c", "other": "#999"}
SUMMARY_KEYS = ["advantage.estimator", "samples_per_prompt", "kl.penalty_in", "kl.coef", "kl.controller",
                "kl.target", "optim.lr", "optim.critic_lr", "ppo.epochs", "ppo.clip_range"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


@dataclass
class Run:
    """Everything the page shows about one run directory."""

    path: Path
    label: str
    rows: list[dict]
    config: dict
    diagnosis: Diagnosis
    samples: list[dict]
    samples_file: str | None


def _read_samples(run_dir: Path) -> tuple[list[dict], str | None]:
    """The rows of the last ``samples/step_K.jsonl`` (largest K)."""
    files = [(int(m.group(1)), p) for p in (run_dir / "samples").glob("step_*.jsonl")
             if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name))]
    if not files:
        return [], None
    _, path = max(files)
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TetherError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
            if isinstance(row, dict):
                rows.append(row)
    return rows, f"samples/{path.name}"


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read one run directory; ``name`` (default: the folder's name) starts its label."""
    run_dir = Path(run_dir)
    rows = with_problem_results(load_metrics(run_dir), run_dir)
    config = load_run_config(run_dir)
    samples, samples_file = _read_samples(run_dir)
    beta, estimator = config_value(config, "kl.coef"), config_value(config, "advantage.estimator")
    label = (name or run_dir.resolve().name) + (f" (β = {beta:g})" if isinstance(beta, (int, float)) else "")
    if estimator not in (None, "gae"):
        label += f" {estimator}, K = {config_value(config, 'samples_per_prompt')}"
    diagnosis = diagnose(rows, health_config_from_run(config), run_config=config)
    return Run(run_dir, label, rows, config, diagnosis, samples, samples_file)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(row["step"])
            ys.append(float(v))
    return xs, ys


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(runs: list[Run], config: HealthConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """One PNG (base64) per panel with data; and the titles of panels no run has data for."""
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    bands = {b.name: b for b in resolve_bands(config)}
    images, empty = [], []
    for title, lines, band_name, log in PANELS:
        data = [(i, run, key, style, *_series(run.rows, key)) for i, run in enumerate(runs)
                for key, style in lines]
        if not any(xs for *_, xs, _ in data):
            empty.append(title)
            continue
        fig, ax = plt.subplots(figsize=(4.6, 3.0))
        for i, run, key, style, xs, ys in data:
            if not xs:
                continue
            color = COLORS[i % len(COLORS)]
            ax.plot(xs, ys, style, color=color, lw=1.4, ms=3.5, label=run.label if style != "o" else None)
            if key == "eval/accuracy":
                _paired_bars(ax, run.diagnosis.gold, color)
            if key == "response/length_mean" and len(runs) == 1:  # several min–max bands only blur
                lo, hi = _series(run.rows, "response/length_min"), _series(run.rows, "response/length_max")
                if lo[0] and lo[0] == hi[0]:
                    ax.fill_between(lo[0], lo[1], hi[1], color=color, alpha=0.12, lw=0)
        if any(key.endswith("accuracy") for _, _, key, *_ in data):  # accuracies read as percentages
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        if log and all(y > 0 for *_, ys in data for y in ys):
            ax.set_yscale("log")
        band = bands.get(band_name)
        if band is not None:
            _shade_band(ax, band, [y for *_, ys in data for y in ys])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (PPO step, or optimiser step of a reward model)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        images.append((title, _png(fig)))
        plt.close(fig)
    return images, empty


def _paired_bars(ax, gold: list[dict], color: str) -> None:
    """The gold curve's paired intervals: at each evaluation its accuracy ± the 95% half-width of its
    difference from the best earlier evaluation on the same problems (paired Wald, the discordant problems
    carry the variance), and the best so far dotted. A bar whose top stays under the dotted line is a fall
    past noise before the correction for choosing the best (the doctor's z has it)."""
    paired = [p for p in gold if p.get("interval")]
    if paired:
        half = [(p["interval"][2] - p["interval"][1]) / 2 for p in paired]
        ax.errorbar([p["step"] for p in paired], [p["accuracy"] for p in paired], yerr=half, fmt="none",
                    ecolor=color, elinewidth=1, capsize=2.5, alpha=0.8)
    if gold:
        best = [max(p["accuracy"] for p in gold[:i + 1]) for i in range(len(gold))]
        ax.step([p["step"] for p in gold], best, where="post", ls=":", color=color, lw=1)


def _gold_html(run: Run) -> str:
    """Each evaluation against the best before it (the doctor's paired evidence, docs/diagnostics.md)."""
    gold = run.diagnosis.gold
    if not gold:
        return "<p>No gold evaluations (eval/accuracy with eval/n) in this run.</p>"
    head = ("<tr><th>step</th><th>accuracy</th><th>best so far</th><th>right → wrong / wrong → right</th>"
            "<th>p (one-sided)</th><th>× earlier</th><th>z</th><th>trend z</th><th>reward held</th></tr>")
    cells = []
    for p in gold:
        best = "–" if p["best_step"] is None else f"{100 * p['best_accuracy']:.1f}% (step {p['best_step']})"
        changed = f"{p['worse']} / {p['better']}" if p["paired"] else ("unpaired" if p["best_step"] is not None else "–")
        trend = "–" if p["trend_z"] is None else f"{p['trend_z']:.2f}"
        cells.append(f"<tr><td>{p['step']}</td><td>{100 * p['accuracy']:.1f}%</td><td>{best}</td><td>{changed}</td>"
                     f"<td>{p['p']:.2g}</td><td>{p['candidates']}</td><td>{p['z']:.2f}</td><td>{trend}</td>"
                     f"<td>{'yes' if p['reward_held'] else 'no'}</td></tr>")
    return f"<table>{head}{''.join(cells)}</table>"


def _shade_band(ax, band, ys: list[float]) -> None:
    """Shade the healthy range; draw the alarm threshold only when the data leave the healthy range
    (otherwise a far-away alarm line would squash the curves)."""
    low, high = band.healthy
    outside = any((low is not None and y < low) or (high is not None and y > high) for y in ys)
    marks = [v for v in (low, high) if v is not None]
    if outside:
        marks += [v for v in (band.alarm_low, band.alarm_high) if v is not None]
    if ax.get_yscale() == "log":
        marks = [m for m in marks if m > 0]
    y0, y1 = ax.get_ylim()
    y0, y1 = min([y0, *marks]), max([y1, *marks])
    pad = 0.0 if ax.get_yscale() == "log" else 0.05 * (y1 - y0)
    y0, y1 = (y0 * 0.8, y1 * 1.25) if ax.get_yscale() == "log" else (y0 - pad, y1 + pad)
    ax.axhspan(low if low is not None else y0, high if high is not None else y1, color="#2ca02c",
               alpha=0.12, lw=0, label="healthy")
    if outside:
        for alarm in (band.alarm_low, band.alarm_high):
            if alarm is not None and y0 <= alarm <= y1:
                ax.axhline(alarm, color="#d62728", ls="--", lw=1, label="alarm")
    ax.set_ylim(y0, y1)


def _mean(rows: list[dict], key: str) -> float | None:
    _, ys = _series(rows, key)
    return sum(ys) / len(ys) if ys else None


def _fmt(x) -> str:
    if x is None:
        return "–"
    return f"{x:.4g}" if isinstance(x, float) else html.escape(str(x))


def _phase_html(run: Run) -> str:
    """Mean seconds per phase (:data:`PHASES`) as a table and a stacked bar; the rollout share (C2: healthy
    ≤ 40% with a fast engine). Runs from before the scoring split show one "score" row."""
    means = list(phase_seconds(run.rows).items())
    step = _mean(run.rows, "perf/seconds_step")
    known = sum(m for _, m in means)
    if step is not None and step > known * (1 + 1e-9):
        means.append(("other", step - known))
    total = step or known
    share, layout = _mean(run.rows, "perf/rollout_share"), rollout_layout(run.config)
    if share is None and total:
        share = dict(means).get("generate", 0.0) / total
    if not total:
        return "<p>No timing metrics (perf/…) in this run.</p>"
    bar = "".join(f'<div style="width:{100 * m / total:.1f}%;background:{PHASE_COLORS[n]}" title="{n}"></div>'
                  for n, m in means if m)
    cells = "".join(f"<tr><td><span class=chip style='background:{PHASE_COLORS[n]}'></span>{n}</td>"
                    f"<td>{_fmt(m)}</td><td>{100 * (m or 0) / total:.0f}%</td></tr>" for n, m in means)
    verdict = "" if share is None else (
        f"<p>Rollout share of a step{f' ({html.escape(layout)})' if layout else ''}: <b>{100 * share:.0f}%</b> "
        f"({'healthy, ≤ 40%' if share <= 0.4 else 'above the 40% a fast rollout engine allows'}); "
        f"tokens/s: {_fmt(_mean(run.rows, 'perf/tokens_per_second'))}.</p>")
    mfu, padding = _mean(run.rows, "perf/mfu"), _mean(run.rows, "perf/padding_fraction")
    if mfu is not None:
        verdict += (f"<p>Model FLOPs utilisation: {100 * mfu:.1f}% of the device's peak (train phase "
                    f"{100 * (_mean(run.rows, 'perf/mfu_train') or 0):.1f}%); padding: "
                    f"{100 * (padding or 0):.0f}% of computed positions.</p>")
    return (f"<div class=bar>{bar}</div><table><tr><th>phase</th><th>s / step (mean)</th><th>share</th></tr>"
            f"{cells}<tr><td>step</td><td>{_fmt(total)}</td><td></td></tr></table>{verdict}")


def _samples_html(run: Run, n: int = 6) -> str:
    if not run.samples:
        return "<p>No evaluation samples (samples/step_K.jsonl) in this run.</p>"
    # highest-KL responses first: where the policy has moved furthest from the reference
    rows = sorted(run.samples, key=lambda r: -r["kl"] if isinstance(r.get("kl"), (int, float)) else 0)[:n]
    out = [f"<p>From <code>{html.escape(run.samples_file)}</code> ({len(run.samples)} samples), "
           f"the {len(rows)} with the highest KL.</p>"]
    for r in rows:
        facts = " · ".join(f"{k} {_fmt(r.get(k))}" for k in ("score", "kl", "length", "truncated", "correct")
                           if k in r)
        response = str(r.get("response", ""))
        response = response[:600] + (" …" if len(response) > 600 else "")
        out.append(f"<div class=sample><div class=facts>{facts}</div>"
                   f"<div class=prompt>{html.escape(str(r.get('prompt', '')))}</div>"
                   f"<pre>{html.escape(response)}</pre></div>")
    return "".join(out)


def _summary_table(runs: list[Run]) -> str:
    head = "".join(f"<th><span class=chip style='background:{COLORS[i % len(COLORS)]}'></span>"
                   f"{html.escape(r.label)}</th>" for i, r in enumerate(runs))
    body = []
    for key in SUMMARY_KEYS:
        body.append(f"<tr><td><code>{key}</code></td>" +
                    "".join(f"<td>{_fmt(config_value(r.config, key))}</td>" for r in runs) + "</tr>")
    for name, key in [("steps", None), ("last reward", "objective/scores_raw"),
                      ("last eval reward", "eval/reward"), ("last gold accuracy", "eval/accuracy"),
                      ("last KL mean", "objective/kl")]:
        vals = [sum(int(x["step"]) > 0 for x in r.rows) if key is None  # step 0's evaluation row is not a step
                else (_series(r.rows, key)[1] or [None])[-1] for r in runs]
        shown = [f"{100 * v:.1f}%" if key == "eval/accuracy" and isinstance(v, float) else _fmt(v) for v in vals]
        body.append(f"<tr><td>{name}</td>" + "".join(f"<td>{v}</td>" for v in shown) + "</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(body)}</table>"


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:8px}
.grid img{width:100%;border:1px solid #eee}
.cols{display:grid;gap:16px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:6px;font-size:12px;margin:4px 0}
.badge{display:inline-block;padding:2px 8px;border-radius:4px;color:#fff;font-weight:600}
.ok{background:#2ca02c} .warn{background:#e08a00} .bad{background:#d62728}
.chip{display:inline-block;width:10px;height:10px;margin-right:5px;border-radius:2px}
.bar{display:flex;height:18px;width:100%;max-width:500px;border:1px solid #ccc} .bar div{height:100%}
.sample{border-left:3px solid #ccc;padding-left:8px;margin:8px 0} .facts{font-size:12px;color:#555}
.prompt{font-family:monospace;font-size:12px;color:#333}
"""


def _names(run_dirs: list[str | Path]) -> list[str]:
    """Folder names, or the last two path parts where folder names repeat (runs/a/run, runs/b/run)."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return names


def write_report(run_dirs: list[str | Path], out_path: str | Path, title: str | None = None,
                 extra_html: str = "") -> Path:
    """Write the HTML page for ``run_dirs`` to ``out_path`` and return its path.

    ``extra_html`` (trusted HTML, e.g. a summary table from the demo) is inserted under the title.
    """
    if not run_dirs:
        raise TetherError("give at least one run directory")
    runs = [load_run(d, name) for d, name in zip(run_dirs, _names(run_dirs))]
    images, empty = _plots(runs, health_config_from_run(runs[0].config))
    title = title or "tether report: " + " vs ".join(r.label for r in runs)
    cols = f"style='grid-template-columns:repeat({len(runs)},1fr)'"

    def per_run(render) -> str:
        return f"<div class=cols {cols}>" + "".join(
            f"<div><h3><span class=chip style='background:{COLORS[i % len(COLORS)]}'></span>"
            f"{html.escape(r.label)}</h3>{render(r)}</div>" for i, r in enumerate(runs)) + "</div>"

    def verdict(r: Run) -> str:
        d = r.diagnosis
        badge = (f"<span class='badge bad'>{html.escape(d.failure_mode)}</span>" if not d.healthy else
                 f"<span class='badge warn'>warning: {html.escape(', '.join(d.warnings))}</span>" if d.warnings else
                 "<span class='badge ok'>healthy</span>")
        return f"{badge}<pre>{html.escape(format_diagnosis(d))}</pre>"

    plots = "".join(f"<img alt='{html.escape(t)}' src='data:image/png;base64,{b64}'>" for t, b64 in images)
    missing = f"<p>No data in any run for: {html.escape(', '.join(empty))}.</p>" if empty else ""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<title>{html.escape(title)}</title><style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
{extra_html}
<h2>Runs</h2>{_summary_table(runs)}
<h2>Doctor's verdict</h2><div>{" ".join(
        f"<span class=chip style='background:{COLORS[i % len(COLORS)]}'></span>{html.escape(r.label)}: "
        f"<b>{html.escape(r.diagnosis.summary())}</b><br>" for i, r in enumerate(runs))}</div>
<h2>Curves</h2><p>Shaded green: healthy band; dashed red: alarm threshold (docs/diagnostics.md).</p>
<div class=grid>{plots}</div>{missing}
<h2>Diagnosis</h2>{per_run(verdict)}
<h2>Gold evaluations, paired with the best so far</h2>{per_run(_gold_html)}
<h2>Where the time goes</h2>{per_run(_phase_html)}
<h2>Sample responses</h2>{per_run(_samples_html)}
</body></html>
"""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(page, encoding="utf-8")
    return out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="one or more `tether ppo` run directories (or `tether train-rm` outputs)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="where to write the page [default: FIRST_RUN_DIR/report.html]")
    parser.add_argument("--title", default=None, help="page title [default: the run names]")


def run(args: argparse.Namespace) -> int:
    out = args.output or Path(args.run_dirs[0]) / "report.html"
    path = write_report(args.run_dirs, out, title=args.title)
    print(f"wrote {path}")
    return 0
