"""What a PPO run writes as it goes: :mod:`tether.runlog` (shared with SFT), importable from here as before, and
what it says on the console (:class:`Progress`): a start-up summary, one line per step (a bar on a terminal, a
plain line otherwise), one line per evaluation, and the end line :func:`end_line`."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from tether.runlog import (  # noqa: F401 - this module's API since before the move to tether.runlog
    RunLog,
    check_trackers,
    progress_mode,
    read_jsonl_rows,
    tracker_names,
    truncate_jsonl,
    write_jsonl,
    write_text_atomic,
)


def _num(x, fmt: str = ".3g") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _count(n: int) -> str:
    """A parameter count the way people say it: 124.4M, 1.5B, 8.2k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def memory_verdict(cfg) -> str:
    """The memory plan's verdict for this run (:mod:`tether.ppo.dryrun`'s), or '' when the planner cannot read the
    policy's shape (a preset without a config.json, say)."""
    try:
        from tether.diagnostics.plan import GB, plan
        from tether.diagnostics.shapes import config_shape
        from tether.ppo.dryrun import device_memory_gb, run_plan_config

        gb, device = device_memory_gb()
        plan_cfg = run_plan_config(cfg, gb)
        result = plan(config_shape(plan_cfg.model), plan_cfg)
    except Exception:  # noqa: BLE001 - the summary is a courtesy; the run does not depend on it
        return ""
    verdict = "fits" if result["fits"] else "may NOT fit (tether ppo --dry-run explains)"
    return f"memory plan: peak {result['peak'] / GB:.2f} GB per process ({result['peak_phase']}) of {gb:.1f} GB " \
           f"{device}: {verdict}"


def start_summary(run, cfg, steps_done: int) -> str:
    """The lines a run starts with: its prompts and held-out split, policy and trainable parameters, rewards and gold
    rule, engine and the memory plan's verdict."""
    data, models = run.data, run.models
    held = (f"{len(data.eval_rows)} held-out from {cfg.data.eval_prompts}" if cfg.data.eval_prompts
            else f"{len(data.eval_rows)} held-out ({cfg.data.eval_fraction:g} of the file, split by prompt)"
            if cfg.data.eval_fraction else f"{len(data.eval_rows)} held-out" if data.eval_rows
            else "none held out (no evaluation: --eval-prompts FILE or --eval-fraction 0.1)")
    total = sum(p.numel() for p in models.unwrapped_policy.parameters())
    trainable = sum(p.numel() for p in run.optim.policy_params)
    critic = sum(p.numel() for p in run.optim.critic_params)
    sources = ", ".join(cfg.reward.sources)  # rewards given from Python are recorded here too (tether.ppo.inputs)
    gold = "none (no accuracy)" if data.gold is None else cfg.reward.gold
    evals = f"every {data.eval_every} steps and at the end" if data.eval_every else "off"
    lines = [
        f"tether ppo: {cfg.steps} steps" + (f", resuming after step {steps_done}" if steps_done else "")
        + f" -> {cfg.output_dir}",
        f"  prompts:  {len(data.prompts.rows)} training; {held}",
        f"  policy:   {cfg.model.policy} ({_count(total)} parameters, {_count(trainable)} trainable"
        + (f"; LoRA r={cfg.model.lora_r}" if cfg.model.lora_r else "") + f"; {cfg.model.dtype})"
        + (f"; critic {_count(critic)} trainable" if critic else f"; no critic ({cfg.advantage.estimator})"),
        f"  rewards:  {sources}; gold rule: {gold}; evaluation {evals}",
        f"  sampling: {cfg.generation.engine}, {cfg.batch_size} prompts x {cfg.samples_per_prompt} per step, "
        f"up to {cfg.generation.max_new_tokens} new tokens; KL beta {cfg.kl.coef:g} ({cfg.kl.controller})",
    ]
    verdict = memory_verdict(cfg)
    if verdict:
        lines.append("  " + verdict)
    return "\n".join(lines)


def step_line(row: dict, total: int, seconds: float | None) -> str:
    """One plain line per step, for a log that is not a terminal."""
    rate = f"  {seconds:.1f} s/step" if seconds is not None else ""
    return (f"ppo step {row['step']}/{total}  score {_num(row.get('objective/scores'), '.3f')}  "
            f"kl {_num(row.get('objective/kl'), '.4f')}  beta {_num(row.get('objective/kl_coef'))}{rate}")


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927), as :func:`tether.core.stats.wilson_interval`."""
    from tether.core.stats import wilson_interval

    return wilson_interval(successes, n, z)


def paired_change(base: str, now: str) -> tuple[int, int]:
    """(better, worse): problems wrong at the baseline and right now, and the reverse; ``base`` and ``now`` are
    ``eval/correct`` strings over the same problems in the same order."""
    better = sum(a == "0" and b == "1" for a, b in zip(base, now))
    worse = sum(a == "1" and b == "0" for a, b in zip(base, now))
    return better, worse


def eval_line(row: dict, total: int, baseline: dict | None) -> str:
    """One line per evaluation: gold accuracy with its 95% Wilson interval and the paired change since the first
    evaluation (exact two-sided McNemar p), the held-out reward and the KL to the reference."""
    from tether.core.stats import mcnemar_exact

    parts = [f"eval step {row['step']}/{total}:"]
    accuracy, correct = row.get("eval/accuracy"), row.get("eval/correct")
    if isinstance(accuracy, (int, float)):
        n = len(correct) if isinstance(correct, str) and correct else int(row.get("eval/n") or 0)
        k = correct.count("1") if isinstance(correct, str) and correct else round(accuracy * n)
        low, high = wilson(k, n)
        parts.append(f"accuracy {100 * accuracy:.1f}% (95% CI {100 * low:.1f}-{100 * high:.1f}%, n {n})")
        if baseline is not None and baseline is not row and baseline.get("step") != row["step"]:
            base = baseline.get("eval/correct")
            if isinstance(base, str) and isinstance(correct, str) and len(base) == len(correct):
                better, worse = paired_change(base, correct)
                parts.append(f"{100 * (better - worse) / n:+.1f} points since step {baseline['step']} "
                             f"({better} problems gained, {worse} lost, McNemar p {mcnemar_exact(worse, better):.2g})")
    parts.append(f"reward {_num(row.get('eval/reward'), '.3f')}")
    kl, length = row.get("eval/kl_sequence"), row.get("eval/response_length")
    if isinstance(kl, (int, float)) and math.isfinite(kl):
        per_token = f", ~{kl / length:.2g} a token" if isinstance(length, (int, float)) and length > 0 else ""
        parts.append(f"KL to the reference {kl:.3g} a response{per_token}")
    return "  ".join(parts[:1]) + " " + "; ".join(parts[1:])


class Progress:
    """The run's console, on the main process. Per step, on stderr: a progress bar on a terminal (steps, not
    evaluations), otherwise one plain line per step (no ``\\r``: a CI log or a batch scheduler's file stays one line
    a step); nothing with ``--progress false``. On stdout, whatever ``--progress`` says: the start-up summary and
    one line per evaluation (stderr stays for the bar, warnings and errors: a bad input is still one line there)."""

    def __init__(self, run, cfg, steps_done: int, stream=None, out=None):
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.enabled = bool(run.processes.is_main)
        self.total, self.run_dir = cfg.steps, Path(cfg.output_dir)
        self.baseline: dict | None = None
        self.mode = progress_mode(self.stream, cfg.progress and self.enabled)
        self.bar = None
        self.last = time.monotonic()
        if self.enabled:
            self.print(start_summary(run, cfg, steps_done))
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(desc="ppo", initial=steps_done, total=cfg.steps, unit="step", dynamic_ncols=True,
                            file=self.stream)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.out)
        else:
            print(message, file=self.out, flush=True)

    def evaluated(self, row: dict) -> None:
        """The evaluation line of ``row`` (a step's, or step 0's before the first step), when it has one."""
        if not self.enabled or not any(k.startswith("eval/") for k in row):
            return
        if self.baseline is None:  # the run's first evaluation (a resumed run: its first one on disk)
            rows = [r for r in read_jsonl_rows(self.run_dir / "metrics.jsonl") if "eval/accuracy" in r]
            self.baseline = rows[0] if rows else row
        self.print(eval_line(row, self.total, self.baseline))

    def step(self, row: dict) -> None:
        """After step ``row['step']``'s metrics row is written."""
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(score=_num(row.get("objective/scores"), ".3f"),
                                 kl=_num(row.get("objective/kl"), ".4f"), beta=_num(row.get("objective/kl_coef")))
        elif self.mode == "lines":
            print(step_line(row, self.total, seconds), file=self.stream, flush=True)
        self.evaluated(row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def end_line(run_dir: Path, steps: int, stopped: str | None = None) -> str:
    """The run's last line: steps done, the last evaluation against the first, and the commands to read the run."""
    rows = read_jsonl_rows(Path(run_dir) / "metrics.jsonl")
    evals = [r for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    trained = [r for r in rows if r.get("step", 0) > 0 and "objective/scores" in r]
    parts = [f"tether ppo: {steps} steps" + (f" (stopped: {stopped})" if stopped else "")]
    if evals:
        first, last = evals[0], evals[-1]
        change = (f" (step {first['step']}: {100 * first['eval/accuracy']:.1f}%)" if last is not first else "")
        parts.append(f"held-out accuracy {100 * last['eval/accuracy']:.1f}% at step {last['step']}{change}")
    if trained:
        parts.append(f"last score {_num(trained[-1].get('objective/scores'), '.3f')}, "
                     f"KL {_num(trained[-1].get('objective/kl'), '.4f')}")
    parts.append(f"run written to {run_dir}")
    return "; ".join(parts) + f"\nnext: tether doctor {run_dir}   tether report {run_dir}"
