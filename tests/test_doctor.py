"""tether doctor: synthetic metric histories, one per failure mode plus healthy and noisy-healthy ones,
each diagnosed with the right cause and first step; the CLI's exit codes and --json output.

Each history starts from a healthy run and injects a failure from a known step; the expected first step is
computed from the injected values and the D1 thresholds, not read back from the doctor.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from statistics import NormalDist

import pytest
import yaml

from tether.cli import main
from tether.diagnostics.doctor import diagnose, format_diagnosis, load_metrics, phase_seconds
from tether.diagnostics.health import GOLD_ALARM, GOLD_WARN, HealthConfig

N = 60


def healthy_rows(n: int = N, seed: int = 0, eval_every: int = 5) -> list[dict]:
    """A plausible healthy PPO run: KL creeping up inside its band, critic learning, stable length."""
    rng = random.Random(seed)

    def jitter(x: float, rel: float) -> float:
        return x * (1.0 + rng.gauss(0.0, rel))

    rows = []
    for s in range(1, n + 1):
        score = 0.2 + 0.6 * s / n + rng.gauss(0, 0.03)
        row = {
            "step": s,
            "objective/scores": score, "objective/scores_raw": score, "objective/rlhf_reward": score - 0.01,
            "objective/kl": jitter(0.005 + 0.05 * s / n, 0.1), "objective/kl_max": jitter(0.3 + 0.3 * s / n, 0.1),
            "objective/kl_p99": jitter(0.2 + 0.2 * s / n, 0.1),
            "objective/kl_sequence": 0.2, "objective/kl_coef": 0.05,
            "policy/loss": rng.gauss(0, 0.05), "policy/clip_fraction": jitter(0.1, 0.2),
            "policy/approx_kl": jitter(0.005, 0.2), "policy/ratio_mean": 1.0, "policy/ratio_std": jitter(0.04, 0.15),
            "policy/ratio_max": jitter(1.3, 0.05), "policy/entropy": jitter(2.0 * (1 - 0.004 * s), 0.03),
            "policy/grad_norm": jitter(0.5, 0.1), "policy/lr": 1e-5,
            "value/loss": jitter(math.exp(-s / 30) + 0.1, 0.1), "value/clip_fraction": 0.05,
            "value/explained_variance": min(0.9, 0.1 + 0.05 * s) + rng.gauss(0, 0.02),
            "value/mean": 0.3, "value/std": 0.2, "value/grad_norm": 0.4, "value/lr": 5e-5,
            "response/length_mean": jitter(20.0, 0.03), "response/length_min": 12, "response/length_max": 31,
            "response/truncated_fraction": 0.01, "response/repetition": 0.02,
            "perf/seconds_generate": 1.0, "perf/seconds_score": 0.3, "perf/seconds_train": 1.5,
            "perf/seconds_step": 2.9, "perf/tokens_per_second": 400.0, "perf/rollout_share": 0.34,
            "ppo/epochs_run": 4, "ppo/early_stopped": 0,
        }
        if s % eval_every == 0:
            row.update({"eval/reward": score, "eval/accuracy": 0.3 + 0.3 * s / n + rng.gauss(0, 0.01),
                        "eval/n": 200, "eval/distinct_responses": min(1.0, jitter(0.9, 0.05))})
        rows.append(row)
    return rows


def first_step(rows, key, pred) -> int:
    return next(r["step"] for r in rows if key in r and pred(r[key]))


def test_healthy_run_is_healthy():
    d = diagnose(healthy_rows())
    assert d.healthy and d.failure_mode is None and d.cause_metric is None and d.first_step is None
    assert d.prescriptions == [] and d.unchecked == []


def test_noisy_single_step_spikes_need_persistence():
    rows = healthy_rows(seed=1)
    rows[19]["policy/ratio_std"] = 0.5       # step 20, one step above the 0.3 alarm
    rows[29]["objective/kl_p99"] = 8.0       # step 30, above 5
    rows[39]["value/loss"] *= 8              # step 40, ×8 its recent median
    rows[44]["policy/entropy"] *= 0.3        # step 45, a one-step dip
    assert diagnose(rows).healthy  # default persistence 2
    d = diagnose(rows, HealthConfig(persistence=1))
    assert not d.healthy
    assert (d.cause_metric, d.first_step, d.failure_mode) == ("policy/ratio_std", 20, "ratio out of control")
    assert [c["key"] for c in d.evidence["chain"]] == ["objective/kl_p99", "value/loss", "policy/entropy"]


def test_kl_explosion():
    rows = healthy_rows()
    for r in rows[24:]:  # from step 25
        j = r["step"] - 25
        r["objective/kl"] = 0.08 * 1.35 ** j
        r["objective/kl_p99"] = 0.8 * 1.35 ** j
    d = diagnose(rows)
    expected = first_step(rows, "objective/kl", lambda v: v > 0.1)
    assert expected == 26
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("KL explosion", "objective/kl", expected)
    assert d.alarm_step == first_step(rows, "objective/kl", lambda v: v > 0.5)
    assert d.prescriptions[0]["key"] == "kl.coef"
    assert [p["key"] for p in d.prescriptions] == [
        "kl.coef", "optim.lr", "ppo.epochs", "ppo.clip_range", "kl.controller", "health.rollback"]


def test_sampler_gap_is_the_cause_before_the_ratio_it_breaks():
    """An engine whose samples stop matching what PPO scores (vLLM after a missed sync): its log-prob gap leaves
    the band at step 12, the ratio spread follows at 14; the doctor names the gap, not the ratio, as a sampler
    mismatch with the sampler's cures (the correction, the weight sync, fp32), not smaller steps."""
    rows = healthy_rows()
    for r in rows:
        r["rollout/logprob_gap_mean"] = 2e-7 if r["step"] < 12 else 0.3
        if r["step"] >= 14:
            r["policy/ratio_std"] = 0.6
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("sampler mismatch", "rollout/logprob_gap_mean", 12)
    assert [p["key"] for p in d.prescriptions] == ["correction.mode", "correction.mode", None, "model.dtype"]
    assert diagnose(healthy_rows()).unchecked == []  # a transformers run has no gap and is not short of a check


def test_sampler_mismatch_is_named_with_the_correction_first():
    """The engine's distribution drifts from the trainer's (bf16 kernels, a stale cache): rollout/mismatch_kl leaves
    its band at step 20 (0.03 > 0.02 for 2 steps) before the ratio suffers at 25: the doctor names the sampler
    mismatch and prescribes the correction first; with --rollout-correction tis in place it is listed as such and
    masking (mis) comes first. One step off, the same values (one update's KL, by design) are not judged."""
    rows = healthy_rows()
    for r in rows:
        r["rollout/mismatch_kl"] = 1e-4 if r["step"] < 20 else 0.03
        if r["step"] >= 25:
            r["policy/ratio_std"] = 0.6
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("sampler mismatch", "rollout/mismatch_kl", 20)
    assert [p["key"] for p in d.prescriptions][:2] == ["correction.mode", "correction.mode"]
    assert d.prescriptions[0]["suggestion"] == "tis"
    corrected = diagnose(rows, run_config={"correction": {"mode": "tis"}})
    assert [(p["suggestion"], p["in_place"]) for p in corrected.prescriptions if p["key"] == "correction.mode"] == [
        ("mis", False), (None, True)]
    for r in rows:
        r["rollout/staleness"] = 1 if r["step"] > 1 else 0
    assert diagnose(rows).cause_metric == "policy/ratio_std"


def test_kl_band_reads_the_percentile_not_the_max():
    rows = healthy_rows()
    for r in rows[20:]:
        r["objective/kl_max"] = 9.0  # a handful of tokens far out: the max alone does not alarm
    assert diagnose(rows).healthy
    for r in rows[20:]:
        r["objective/kl_p99"] = 6.0  # 1% of the tokens past 5 nats: it does
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.alarm_step) == ("KL explosion", "objective/kl_p99", 21)


def test_ratio_out_of_control():
    rows = healthy_rows()
    for r in rows[14:]:
        j = r["step"] - 15
        r["policy/ratio_std"] = 0.04 * 1.5 ** j
        r["policy/clip_fraction"] = min(0.95, 0.1 * 1.3 ** j)
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric) == ("ratio out of control", "policy/ratio_std")
    assert d.first_step == first_step(rows, "policy/ratio_std", lambda v: v > 0.1)
    assert d.prescriptions[0]["key"] == "ppo.epochs"


def test_chain_is_attributed_to_the_ratio():
    """ratio std leaves its band first (step 10) but alarms after KL does (14 vs 13): the cause is the ratio."""
    rows = healthy_rows()
    for r in rows:
        s = r["step"]
        if s >= 10:
            r["policy/ratio_std"] = 0.11 + 0.06 * (s - 10)
        if s >= 12:
            r["objective/kl"] = 0.2 * 3 ** (s - 12)
        if s >= 16:
            r["value/loss"] = 10.0
    d = diagnose(rows)
    assert (d.cause_metric, d.first_step, d.alarm_step) == ("policy/ratio_std", 10, 14)
    chain = {c["key"]: c for c in d.evidence["chain"]}
    assert chain["objective/kl"]["onset_step"] == 12 and chain["objective/kl"]["alarm_step"] == 13
    assert chain["value/loss"]["onset_step"] == 16
    assert [c["key"] for c in d.evidence["chain"]][:2] == ["objective/kl", "value/loss"]


def test_value_collapse():
    rows = healthy_rows()
    for r in rows[29:]:
        r["value/loss"] *= 10
        if r["step"] > 30:
            r["value/explained_variance"] = -0.5
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("value collapse", "value/loss", 30)
    assert d.evidence["chain"][0]["key"] == "value/explained_variance"
    assert d.prescriptions[0]["key"] == "ppo.clip_range_value"
    # the last way out: no critic at all (B17), suggested for a GAE run
    d = diagnose(rows, run_config={"advantage": {"estimator": "gae"}, "samples_per_prompt": 1})
    last = d.prescriptions[-1]
    assert last["key"] == "advantage.estimator" and last["current"] == "gae" and "grpo" in last["suggestion"]


def test_mode_collapse_entropy():
    rows = healthy_rows()
    for r in rows[24:]:
        r["policy/entropy"] *= 0.3
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("mode collapse", "policy/entropy", 25)


def test_mode_collapse_the_same_answer_to_every_held_out_prompt():
    """Recipe 2's GRPO run, in small: the greedy policy ends up answering every held-out prompt alike (16 distinct
    of 16, then 15, then 1): distinct responses fall below a quarter of the first evaluation's share at the last
    evaluation, which confirms at once (nothing comes after). A task whose answers are few from the start (two
    labels: 2 distinct of 200 throughout) is no collapse."""
    rows, finished = healthy_rows(), {"steps": N}  # the last row is the run's final step
    evals = [r for r in rows if "eval/distinct_responses" in r]
    for r, share in zip(evals, [1.0] * (len(evals) - 2) + [15 / 16, 1 / 16]):
        r["eval/distinct_responses"] = share
    d = diagnose(rows, run_config=finished)
    assert (d.failure_mode, d.cause_metric, d.cause_band) == ("mode collapse", "eval/distinct_responses",
                                                              "eval_distinct")
    assert d.first_step == d.alarm_step == evals[-1]["step"] == N
    assert d.evidence["first_alarm"]["measure"] == pytest.approx(1 / 16)
    evals[-1]["eval/distinct_responses"] = 0.3  # 0.3×: a warning, which the last evaluation does not confirm
    d = diagnose(rows, run_config=finished)
    assert d.healthy
    evals[-2]["eval/distinct_responses"] = evals[-1]["eval/distinct_responses"] = 0.2  # two in alarm, or ...
    assert diagnose(rows, run_config=finished).cause_band == "eval_distinct"
    evals[-1]["eval/distinct_responses"] = 0.9  # ... one in alarm, recovered after: not persistent
    assert diagnose(rows, run_config=finished).healthy
    for r in evals:
        r["eval/distinct_responses"] = 2 / 200
    assert diagnose(rows, run_config=finished).healthy


def test_reward_hacking_length_surge():
    rows = healthy_rows()
    for r in rows[29:]:
        r["response/length_mean"] = 20.0 * (1 + 0.15 * (r["step"] - 30))
    base = statistics.median(r["response/length_mean"] for r in rows[:5])
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric) == ("reward hacking", "response/length_mean")
    assert d.first_step == first_step(rows, "response/length_mean", lambda v: v / base > 1.5)


def test_reward_hacking_gold_metric_falls_while_reward_rises():
    rows = healthy_rows()
    evals = [r for r in rows if "eval/accuracy" in r]
    for i, r in enumerate(evals):
        r["eval/reward"] = 0.1 * i  # keeps rising
        if r["step"] > 30:
            r["eval/accuracy"] = 0.5 - 0.04 * (r["step"] - 30) / 5  # 0.46, 0.42, 0.38, ...
        elif r["step"] > 20:
            r["eval/accuracy"] = 0.5

    def z(r, n=200, best=0.5):
        """By hand: the Agresti–Caffo z of the drop from the best (step 30, the later of the two 0.5s), its
        one-sided p times the earlier evaluations the best was chosen from (step / 5 − 1), back to a z."""
        a, b = (best * n + 1) / (n + 2), (r["eval/accuracy"] * n + 1) / (n + 2)
        p = NormalDist().cdf(-(a - b) / math.sqrt((a * (1 - a) + b * (1 - b)) / (n + 2)))
        return -NormalDist().inv_cdf(min(0.5, (r["step"] // 5 - 1) * p))

    falling = evals[6:]  # after the best (0.5 at steps 25-30)
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric) == ("reward hacking", "eval/accuracy")
    assert d.first_step == next(r["step"] for r in falling if z(r) > GOLD_WARN) == 50  # 0.34: z = 2.7
    assert d.alarm_step == next(r["step"] for r in falling if z(r) > GOLD_ALARM) == 55  # 0.30: z = 3.3
    assert z(falling[2]) < GOLD_WARN < z(falling[3]) < GOLD_ALARM < z(falling[4]) < z(falling[5])
    assert "eval/accuracy" in format_diagnosis(d)


def test_a_gold_fall_at_the_final_evaluation_is_named_only_when_the_run_has_ended():
    rows = healthy_rows()  # evaluations every 5 steps up to step 60, gold near 0.6 at the end, n = 200
    for r in rows:
        r["objective/kl_coef"] = 0.0  # the tether off
    best = max(r["eval/accuracy"] for r in rows[:-1] if "eval/accuracy" in r)
    rows[-1]["eval/accuracy"] = best - 0.15  # the last evaluation only; the reward keeps rising

    def z(drop):  # by hand: Agresti–Caffo, one-sided p times the 11 earlier evaluations, back to a z
        a, b = (best * 200 + 1) / 202, ((best - drop) * 200 + 1) / 202
        p = NormalDist().cdf(-(a - b) / math.sqrt((a * (1 - a) + b * (1 - b)) / 202))
        return -NormalDist().inv_cdf(11 * p)

    assert GOLD_WARN < z(0.15) < GOLD_ALARM < z(0.3)  # a warning (the final evaluation's alarm at β = 0); an alarm
    assert diagnose(rows).healthy  # without the run's config the doctor cannot know the run has ended
    assert diagnose(rows, run_config={"steps": 100}).healthy  # still running (or killed): one evaluation only
    d = diagnose(rows, run_config={"steps": N})
    assert (d.failure_mode, d.cause_metric, d.alarm_step) == ("reward hacking", "eval/accuracy", N)
    # With the tether on (β > 0) the same last-moment dip is a warning, and a strong fall still an alarm
    for r in rows:
        r["objective/kl_coef"] = 0.05
    d = diagnose(rows, run_config={"steps": N})
    assert d.healthy and d.notes and d.notes[0].startswith("warning (reward hacking, not confirmed): step 60")
    assert "warning (reward hacking" in format_diagnosis(d)
    rows[-1]["eval/accuracy"] = best - 0.3
    assert diagnose(rows, run_config={"steps": N}).alarm_step == N


def test_an_adaptive_controller_that_drove_beta_to_zero_is_judged_untethered():
    """Issue #42: the final-evaluation rule read β from objective/kl_coef as tethered whenever β > 0, so an adaptive
    run that halved β every step (0.05 → 0.05·2⁻⁵⁹ at step 60) was spared the β = 0 rule. The β in force is judged
    against the run's first β: at most 1% of it (0.0005 here) is the tether off; a quarter of it is still on."""
    rows = healthy_rows()
    best = max(r["eval/accuracy"] for r in rows[:-1] if "eval/accuracy" in r)
    rows[-1]["eval/accuracy"] = best - 0.15  # the warning-level dip of the test above
    for r in rows:
        r["objective/kl_coef"] = 0.05 * 0.5 ** (r["step"] - 1)
    assert 0 < rows[-1]["objective/kl_coef"] < 1e-18
    d = diagnose(rows, run_config={"steps": N})
    assert (d.failure_mode, d.cause_metric, d.alarm_step) == ("reward hacking", "eval/accuracy", N)
    for r in rows:  # β lowered but in force: 0.05 → 0.0125
        r["objective/kl_coef"] = 0.05 * 0.5 ** min(2, r["step"] // 20)
    d = diagnose(rows, run_config={"steps": N})
    assert d.healthy and d.notes[0].startswith("warning (reward hacking, not confirmed): step 60")
    for r in rows:  # 0.05 → 0.0004 (7 halvings): off
        r["objective/kl_coef"] = 0.05 * 0.5 ** min(7, r["step"] // 8)
    assert diagnose(rows, run_config={"steps": N}).failure_mode == "reward hacking"


def test_gold_fall_with_rising_reward_is_the_verdict_even_after_a_kl_alarm():
    # β = 0: the tether is off, the KL runs away first, then the gold metric falls as the reward rises.
    rows = healthy_rows()
    for r in rows:
        if r["step"] >= 10:
            r["objective/kl"] = 0.6 + 0.01 * r["step"]
        if "eval/accuracy" in r:
            r["eval/reward"] = r["step"] / 10
            r["eval/accuracy"] = 0.5 if r["step"] <= 15 else 0.3
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step, d.alarm_step) == ("reward hacking", "eval/accuracy", 20, 20)
    assert d.evidence["chain"][0]["key"] == "objective/kl" and d.evidence["chain"][0]["onset_step"] == 10
    text = format_diagnosis(d)
    assert text.index("what led there") < text.index("objective/kl  ")
    assert d.prescriptions[0]["key"] == "kl.coef"
    for r in rows:  # the same KL without the gold fall: a KL explosion
        if "eval/accuracy" in r:
            r["eval/accuracy"] = 0.5
    assert diagnose(rows).failure_mode == "KL explosion"


def test_gold_metric_falling_with_reward_falling_is_not_hacking():
    rows = healthy_rows()
    for r in rows:
        if "eval/accuracy" in r and r["step"] > 30:
            r["eval/accuracy"] = 0.2
            r["eval/reward"] = -1.0
    d = diagnose(rows)  # both fell: a collapse, named by the earliest band as any other
    assert (d.failure_mode, d.cause_band, d.alarm_step) == ("collapse", "gold_collapse", 35)
    assert d.prescriptions[0]["key"] == "health.rollback"


def test_not_learning_only_when_nothing_else_fails():
    rows = healthy_rows()
    for r in rows:
        r["policy/clip_fraction"] = 0.02
        r["objective/kl"] = 0.001
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("not learning", "policy/clip_fraction", 1)
    assert d.prescriptions[0]["key"] == "optim.lr"
    for r in rows[24:]:
        r["policy/entropy"] *= 0.3
    assert diagnose(rows).failure_mode == "mode collapse"
    moving = [dict(r, **{"policy/clip_fraction": 0.02}) for r in healthy_rows()]
    assert diagnose(moving).healthy  # KL to the reference grows past 0.01: slow, but learning
    short = [dict(r, **{"policy/clip_fraction": 0.02, "objective/kl": 0.001}) for r in healthy_rows(n=15)]
    assert diagnose(short).healthy  # 15 low steps < 20 (health.not_learning_steps)


def test_missing_keys_tolerated():
    rows = [{k: v for k, v in r.items() if not k.startswith(("value/", "eval/"))} for r in healthy_rows()]
    d = diagnose(rows)
    assert d.healthy
    assert set(d.unchecked) == {"value_loss", "explained_variance", "gold_drop", "gold_collapse", "eval_distinct"}


def test_nan_metric_is_an_alarm():
    rows = healthy_rows()
    for r in rows[40:]:
        r["objective/kl"] = float("nan")
    d = diagnose(rows)
    assert (d.failure_mode, d.cause_metric, d.first_step) == ("KL explosion", "objective/kl", 41)
    json.dumps(d.to_dict(), allow_nan=False)  # NaN values are reported as strings


def test_prescription_keys_are_run_config_keys():
    from tether.config import leaf_fields
    from tether.diagnostics.doctor import PRESCRIPTIONS
    from tether.ppo.config import RunConfig

    keys = {key for key, _, _ in leaf_fields(RunConfig)}
    used = {rx.key for rxs in PRESCRIPTIONS.values() for rx in rxs if rx.key}
    assert used - keys == set()


# ---------------------------------------------------------------- CLI


def write_run(tmp_path, rows, name="run", config=None):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def test_cli_healthy_exit_0(tmp_path, capsys):
    run = write_run(tmp_path, healthy_rows())
    assert main(["doctor", str(run)]) == 0
    assert "HEALTHY" in capsys.readouterr().out


def test_cli_unhealthy_exit_1_json(tmp_path, capsys):
    rows = healthy_rows()
    for r in rows[24:]:
        r["objective/kl"] = 0.08 * 1.35 ** (r["step"] - 25)
    run = write_run(tmp_path, rows, config={"kl": {"coef": 0.05, "controller": "fixed"},
                                            "optim": {"lr": 1e-5}, "ppo": {"epochs": 4}})
    assert main(["doctor", str(run), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert {"healthy", "failure_mode", "cause_metric", "first_step", "evidence", "prescriptions"} <= set(out)
    assert out["healthy"] is False and out["cause_metric"] == "objective/kl" and out["first_step"] == 26
    beta = out["prescriptions"][0]
    assert (beta["key"], beta["current"], beta["suggestion"]) == ("kl.coef", 0.05, "0.1–0.2")
    assert out["prescriptions"][2]["suggestion"] == "2"  # ppo.epochs 4 -> 2
    assert main(["doctor", str(run)]) == 1
    text = capsys.readouterr().out
    assert "UNHEALTHY: KL explosion" in text and "[kl.coef (now 0.05) -> 0.1–0.2]" in text


def test_cli_health_settings_from_run_config_and_flags(tmp_path, capsys):
    rows = healthy_rows()
    rows[19]["policy/ratio_std"] = 0.5
    run = write_run(tmp_path, rows, config={"health": {"persistence": 1}})
    assert main(["doctor", str(run)]) == 1
    assert main(["doctor", str(run), "--persistence", "2"]) == 0
    assert main(["doctor", str(run), "--band", "ratio_std=:0.1::0.6"]) == 0
    assert main(["doctor", str(run), "--band", "nonsense=1:2:3:4"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_cli_reader_gone_is_not_a_traceback(tmp_path):
    """`tether doctor RUN | head -1`: the reader closes the pipe; the doctor stops quietly with the shell's SIGPIPE
    status (141), no BrokenPipeError traceback (neither from the print nor from the interpreter's exit flush)."""
    import subprocess
    import sys

    run = write_run(tmp_path, healthy_rows())
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    proc = subprocess.run([sys.executable, "-m", "tether", "doctor", str(run)], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=300)
    os.close(write)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr


def test_cli_unreadable_input_exit_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 2
    assert "metrics.jsonl: not found" in capsys.readouterr().err
    run = write_run(tmp_path, healthy_rows(n=3))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "objective/kl": 0.0\n')
    assert main(["doctor", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("tether doctor: error: ") and "metrics.jsonl: line 4: invalid JSON" in err


def test_load_metrics_skips_blank_lines(tmp_path):
    run = write_run(tmp_path, healthy_rows(n=3))
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n   \n")
    assert [r["step"] for r in load_metrics(run)] == [1, 2, 3]


@pytest.mark.parametrize("bad", ["[1, 2]\n", "\n"])
def test_load_metrics_rejects_non_objects_and_empty(tmp_path, bad):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(bad)
    from tether.errors import TetherError
    with pytest.raises(TetherError, match="metrics.jsonl"):
        load_metrics(run)


SPLIT_TIMES = {"perf/seconds_generate": 1.0, "perf/seconds_weight_sync": 0.0, "perf/seconds_logprobs_old": 0.25,
               "perf/seconds_reference": 0.25, "perf/seconds_values": 0.125, "perf/seconds_reward": 0.375,
               "perf/seconds_score": 1.0, "perf/seconds_train": 2.0, "perf/seconds_step": 4.0}


def test_doctor_says_where_the_time_goes():
    """Phases in step order with their mean seconds; scoring split into its parts, whose sum (seconds_score)
    is not counted twice; runs from before the split show one 'score' phase."""
    rows = [{**r, **SPLIT_TIMES} for r in healthy_rows()]
    rows[0]["perf/seconds_train"] = 4.0  # means, not the last value: (4 + 2·(n−1)) / n
    d = diagnose(rows)
    n = len(rows)
    assert list(d.phases) == ["generate", "weight sync", "old log-probs", "reference", "values", "reward", "train"]
    assert d.phases["reference"] == 0.25 and d.phases["weight sync"] == 0.0
    assert d.phases["train"] == pytest.approx((4.0 + 2.0 * (n - 1)) / n)
    line = format_diagnosis(d).splitlines()[-1]
    assert line.startswith("time per step: ") and "old log-probs 0.25 s" in line and "weight sync 0 s (0%)" in line
    old = phase_seconds(healthy_rows())
    assert old == pytest.approx({"generate": 1.0, "score": 0.3, "train": 1.5})
    assert list(old) == ["generate", "score", "train"]
    assert phase_seconds([{"step": 1}]) == {}


def test_prescriptions_the_run_already_follows_are_listed_as_in_place(tmp_path, capsys):
    """A value collapse in a run that already clips the value update (0.2) and the rewards (5): those two are
    listed as in place, not prescribed again; the rest keep their priority order, renumbered from 1."""
    rows = healthy_rows()
    for r in rows[29:]:
        r["value/loss"] *= 10
        if r["step"] > 30:
            r["value/explained_variance"] = -0.5
    config = {"ppo": {"clip_range_value": 0.2}, "reward": {"clip": 5.0}, "optim": {"critic_lr": 5e-4},
              "critic": {"warmup_steps": 0}, "advantage": {"estimator": "gae"}}
    d = diagnose(rows, run_config=config)
    todo = [(p["priority"], p["key"], p["suggestion"]) for p in d.prescriptions if not p["in_place"]]
    assert todo == [(1, "optim.critic_lr", "0.00025"), (2, "critic.warmup_steps", "10"),
                    (3, "advantage.estimator", "grpo or rloo, with samples_per_prompt 4–8")]
    assert [(p["priority"], p["key"], p["current"], p["suggestion"]) for p in d.prescriptions if p["in_place"]] == [
        (None, "ppo.clip_range_value", 0.2, None), (None, "reward.clip", 5.0, None)]
    text = format_diagnosis(d)
    assert "1. lower the critic learning rate" in text and "[ppo.clip_range_value" not in text
    assert "already in place (this run does these): ppo.clip_range_value = 0.2 (clip the value update); " \
           "reward.clip = 5.0" in text
    # a run that does none of them (no value clip, rewards unclipped): all five, in the reference's order
    d = diagnose(rows, run_config={**config, "ppo": {"clip_range_value": 0.0}, "reward": {"clip": 0.0}})
    assert [p["key"] for p in d.prescriptions if not p["in_place"]] == [
        "ppo.clip_range_value", "optim.critic_lr", "reward.clip", "critic.warmup_steps", "advantage.estimator"]
    assert "already in place" not in format_diagnosis(d)


@pytest.mark.parametrize("config, in_place", [
    ({"kl": {"controller": "adaptive"}, "health": {"rollback": True}, "ppo": {"epochs": 1}},
     ["ppo.epochs", "kl.controller", "health.rollback"]),
    ({"kl": {"controller": "fixed"}, "health": {"rollback": False}, "ppo": {"epochs": 4}}, []),
])
def test_kl_explosion_prescriptions_in_place(config, in_place):
    rows = healthy_rows()
    for r in rows[24:]:
        r["objective/kl"] = 0.08 * 1.35 ** (r["step"] - 25)
    d = diagnose(rows, run_config=config)
    assert [p["key"] for p in d.prescriptions if p["in_place"]] == in_place
    assert [p["priority"] for p in d.prescriptions] == [*range(1, 7 - len(in_place)), *[None] * len(in_place)]


# ---------------------------------------------------------------- shortcut (a checker's blind spot)


def test_word_f1_by_hand():
    from tether.diagnostics.text import word_f1

    assert word_f1("The answer is 7.", "The answer is 5.") == pytest.approx(2 * 3 / 8)
    assert word_f1("a a b", "a b b") == pytest.approx(2 * 2 / 6)  # multisets: a∩ = 1, b∩ = 1
    assert word_f1("", "") == 1.0 and word_f1("x", "") == 0.0


def shortcut_rows(overlaps, gains) -> list[dict]:
    """A healthy run whose evaluations after step 0 carry the given overlaps and reward gains."""
    rows = healthy_rows()
    evals = [r for r in rows if "eval/reward" in r]
    for r, overlap, gain in zip(evals, overlaps, gains):
        r["eval/reference_overlap"], r["eval/reward_gain"] = overlap, gain
    return rows


def test_shortcut_the_reward_rises_while_the_answers_stop_resembling_the_task():
    """The outside task's shortcut in small: a checker credits replies that drop the task (a title repeated, a
    closing phrase alone): the held-out reward is up, the answers' overlap with the reference's falls to 0.05 —
    no gold band can see it (the reward is its own gold). Named at the final evaluation, with the answers."""
    n = len([r for r in healthy_rows() if "eval/reward" in r])
    finished = {"steps": N}
    rows = shortcut_rows([0.7] * (n - 2) + [0.2, 0.05], [0.1 * i for i in range(1, n + 1)])
    d = diagnose(rows, run_config=finished)
    assert (d.failure_mode, d.cause_band, d.alarm_step) == ("shortcut", "eval_shortcut", N)
    assert d.prescriptions[0]["action"].startswith("read the held-out answers")
    # legitimate learning: right answers keep the reference's words ("The answer is 7." vs "... 5.": 0.75)
    assert diagnose(shortcut_rows([0.75] * n, [0.1 * i for i in range(1, n + 1)]), run_config=finished).healthy
    # the answers drift while the reward is not up: not judged as a shortcut (other bands see a collapse)
    assert diagnose(shortcut_rows([0.7] * (n - 2) + [0.2, 0.05], [-0.1] * n), run_config=finished).healthy


def test_doctor_shows_a_shortcut_with_its_answers(tmp_path):
    from tether.diagnostics.doctor import diagnose_run

    n = len([r for r in healthy_rows() if "eval/reward" in r])
    run = write_run(tmp_path, shortcut_rows([0.7] * (n - 2) + [0.2, 0.05], [0.1 * i for i in range(1, n + 1)]),
                    config={"steps": N})
    (run / "samples").mkdir()
    samples = [{"prompt": "Write a story titled Rain.", "response": "Rain", "reference": "Rain fell on the town."},
               {"prompt": "2+2?", "response": "The answer is 4.", "reference": "The answer is 5."}]
    (run / "samples" / f"step_{N}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    d = diagnose_run(run)
    assert [a["response"] for a in d.evidence["answers"]] == ["Rain", "The answer is 4."]  # least alike first
    text = format_diagnosis(d, run)
    assert "UNHEALTHY: shortcut" in text and "reference: 'Rain fell on the town.'" in text


def short_answer_rows(gained: int, lost: int, *, distinct: float = 0.9, overlap: float | None = 0.85) -> list[dict]:
    """Recipe 4 in small: a task whose reply is "The answer is N.", learned. From step 20 the 99th percentile of the
    per-token KL is 7 (the number token, now sure of a digit the reference gave < 0.3%) and from step 25 the
    entropy is at 0.3× (guessing turned knowing). Held out (200 problems, every 5 steps): 76 right at the first
    evaluation; every later one has ``gained`` of the wrong ones right and ``lost`` of the right ones wrong."""
    rows = healthy_rows()
    for r in rows:
        if r["step"] >= 20:
            r["objective/kl_p99"] = 7.0
        if r["step"] >= 25:
            r["policy/entropy"] *= 0.3
    first = "1" * 76 + "0" * 124
    later = "1" * (76 - lost) + "0" * lost + "1" * gained + "0" * (124 - gained)
    for i, r in enumerate(r for r in rows if "eval/accuracy" in r):
        correct = first if i == 0 else later
        r.update({"eval/correct": correct, "eval/accuracy": correct.count("1") / 200, "eval/distinct_responses":
                  0.2 if i == 0 else 0.2 * distinct / 0.9, "eval/reward": correct.count("1") / 200})
        if i and overlap is not None:
            r.update({"eval/reference_overlap": overlap, "eval/reward_gain": (gained - lost) / 200})
    return rows


def test_a_significant_held_out_gain_with_varied_on_task_answers_overrules_the_kl_and_entropy_bands():
    """The KL tail and the entropy predict damage that the held-out evaluation measures directly. When the last
    evaluation is better than the first on the same problems (exact one-sided McNemar: +20 / −0 gives
    p = 2^-20 = 9.5e-7 <= 0.00135, the gold bands' alarm level), with varied answers alike the reference's, their
    alarms are notes and the run is healthy. +6 / −1 (p = 8/128 = 0.0625), answers collapsed to one (0.2× the first
    share), or no overlap measured (a shortcut not excluded): the bands stand."""
    finished = {"steps": N}
    d = diagnose(short_answer_rows(20, 0), run_config=finished)
    assert d.healthy, d.summary()
    assert [n.split(" not counted")[0] for n in d.notes[:2]] == ["KL explosion", "mode collapse"]
    assert "20 wrong -> right, 0 right -> wrong, p = 9.5e-07" in d.notes[0]
    assert "38% at step 5 -> 48% at step 60" in d.notes[0]
    assert "not counted" in format_diagnosis(d)
    assert format_diagnosis(d).startswith("HEALTHY: no alarm stands in 60 steps (2 answered by the held-out")
    for rows in (short_answer_rows(6, 1), short_answer_rows(20, 0, distinct=0.2),
                 short_answer_rows(20, 0, overlap=None), short_answer_rows(20, 0, overlap=0.05)):
        d = diagnose(rows, run_config=finished)
        assert not d.healthy and not any("not counted" in n for n in d.notes)
    # a ratio out of control is mechanics, not a prediction a gold evaluation answers
    rows = short_answer_rows(20, 0)
    for r in rows[9:]:
        r["policy/ratio_std"] = 0.5
    assert diagnose(rows, run_config=finished).failure_mode == "ratio out of control"


def test_groups_flat_because_solved_are_the_training_prompts_learned_when_held_out_problems_confirm_it():
    """Recipe 4 past step 15: most groups of its ~100 training problems are solved K/K, so the share of flat groups
    is in alarm — with a held-out gain (+20 / −0) that is the training set learned, a note naming harder prompts,
    not the verdict. Flat because unsolved (the task out of reach), or solved without a confirmed gain (+6 / −1):
    the alarm stands."""
    finished = {"steps": N}

    def flat_from_30(rows, solved, unsolved):
        for r in rows:
            flat = 0.9 if r["step"] >= 30 else 0.2
            r.update({"group/no_spread_fraction": flat, "group/solved_fraction": solved * flat / 0.9,
                      "group/unsolved_fraction": unsolved * flat / 0.9})
        return rows

    d = diagnose(flat_from_30(short_answer_rows(20, 0), 0.85, 0.05), run_config=finished)
    assert d.healthy, d.summary()
    note = next(n for n in d.notes if n.startswith("no signal in the groups not counted"))
    assert "the flat groups are solved ones" in note and "harder prompts" in note and "p = 9.5e-07" in note
    for rows in (flat_from_30(short_answer_rows(20, 0), 0.05, 0.85), flat_from_30(short_answer_rows(6, 1), 0.85, 0.05)):
        d = diagnose(rows, run_config=finished)
        assert not d.healthy
        assert not any(n.startswith("no signal in the groups not counted") for n in d.notes)
    d = diagnose(flat_from_30(short_answer_rows(20, 0), 0.05, 0.85), run_config=finished)
    assert (d.healthy, d.failure_mode) == (False, "no signal in the groups")
    assert d.prescriptions[0]["action"].startswith("no sample of most groups is rewarded")


def test_groups_flat_because_unsolved_early_then_healthy_are_vouched_for_by_a_held_out_gain():
    """The #51 measurement's gated arm: at first most groups had no rewarded sample (87% flat at step 2, a 4% task),
    the band was healthy again well before the last evaluation, and held-out gold rose 4% -> 48% (p = 2.9e-06): the
    task came within reach, a note, not the verdict. Still flat at the end (the test above): the alarm stands."""
    rows = short_answer_rows(20, 0)
    for r in rows:
        flat = 0.9 if 5 <= r["step"] < 20 else 0.2
        r.update({"group/no_spread_fraction": flat, "group/solved_fraction": 0.05 * flat / 0.9,
                  "group/unsolved_fraction": 0.85 * flat / 0.9})
    d = diagnose(rows, run_config={"steps": N})
    assert d.healthy, d.summary()
    note = next(n for n in d.notes if n.startswith("no signal in the groups not counted"))
    assert "unsolved ones at first" in note and "--filter-groups" in note and "p = 9.5e-07" in note
    without_gain = short_answer_rows(6, 1)
    for r, planted in zip(without_gain, rows):
        r.update({k: planted[k] for k in planted if k.startswith("group/")})
    assert diagnose(without_gain, run_config={"steps": N}).failure_mode == "no signal in the groups"

def test_an_alarm_after_the_last_evaluation_is_not_vouched_for():
    rows = [r for r in short_answer_rows(20, 0) if r["step"] <= 50]  # last evaluation at step 50 ...
    rows += [dict(r, **{"policy/ratio_std": 0.04}) for r in short_answer_rows(20, 0)[50:]]
    for r in rows[50:]:
        r.pop("eval/accuracy", None)
        r["objective/kl"] = 0.9  # ... the mean KL in alarm from step 51: nothing measured it on held-out problems
    d = diagnose(rows, run_config={"steps": N})
    assert (d.failure_mode, d.cause_metric, d.alarm_step) == ("KL explosion", "objective/kl", 51)
    assert any(n.startswith("KL explosion not counted (objective/kl_p99") for n in d.notes)


def test_gain_since_first_by_hand():
    from tether.diagnostics.gold import GoldHistory

    h = GoldHistory()
    assert h.gain_since_first() is None
    h.update(0, 0.5, 4, 0.0, "1100")
    h.update(10, 0.5, 4, 0.0, None)
    assert h.gain_since_first() is None  # no per-problem results at the last evaluation
    h.update(20, 0.75, 4, 0.0, "1011")  # problems 2 and 3 gained, problem 1 lost: d = 3, P[X >= 2] = 4/8
    assert h.gain_since_first() == (2, 1, 0.5)


def held_out_rows(gained: int, lost: int, rewards: list[float] | None, reward_std: float | None = 0.3) -> list[dict]:
    """healthy_rows with the held-out evaluations of short_answer_rows (without its KL tail): 76 of 200 right at the
    first, ``gained`` / ``lost`` problems changed at every later one; ``rewards`` at the evaluations (None: the
    accuracy) and ``reward_std`` their spread over the prompts (None: not logged)."""
    evals = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in short_answer_rows(gained, lost)]
    rows = healthy_rows()
    for r, e in zip(rows, evals):
        r.update(e)
    for i, r in enumerate(r for r in rows if "eval/accuracy" in r):
        if rewards is not None:
            r["eval/reward"] = rewards[i]
        if reward_std is not None:
            r["eval/reward_std"] = reward_std
    return rows


def test_reward_without_gold_is_a_warning_when_the_reward_rises_significantly_and_gold_does_not():
    """Recipe 5's β = 0.2 run in small: a reward model's held-out score rises 0.13 -> 0.82 (spread 0.3 over the 200
    prompts: z = 0.69 / sqrt(2 · 0.3² / 200) = 23) while the task's check goes 76 -> 74 of 200 (+8 / −10 on the same
    problems; exact one-sided p of a gain P[X >= 8 | 18, 1/2] = 0.760). Nothing fell significantly, so no band
    alarms; the headline is a WARNING, never "HEALTHY …, but". When the reward is the check itself or gold rose,
    there is no such note."""
    finished = {"steps": N}
    n_evals = sum("eval/accuracy" in r for r in short_answer_rows(0, 0))
    rising = [0.13 + 0.69 * i / (n_evals - 1) for i in range(n_evals)]
    d = diagnose(held_out_rows(8, 10, rising), run_config=finished)
    note = next(n for n in d.notes if n.startswith("reward without gold"))
    z = 0.69 / math.sqrt(2 * 0.3 ** 2 / 200)
    assert "0.13 -> 0.82" in note and "38% -> 37%" in note and f"z = {z:.1f} standard errors" in note
    assert "8 wrong -> right, 10 right -> wrong, p of a gain = 0.76" in note
    assert d.healthy and d.level == "WARNING" and d.summary() == "warning (60 steps, no band in alarm; reward without gold)"
    assert format_diagnosis(d).splitlines()[0] == ("WARNING: reward without gold (below); no band reached its alarm "
                                                   "in 60 steps")
    assert "HEALTHY" not in format_diagnosis(d) and d.to_dict()["level"] == "WARNING"
    for rows in (held_out_rows(8, 10, None), held_out_rows(20, 0, rising)):  # reward = gold; gold rose with the reward
        assert not any(n.startswith("reward without gold") for n in diagnose(rows, run_config=finished).notes)
    # gold that moved a little is no gain: +11 / −8 (P[X >= 11 | 19, 1/2] = 0.324 by hand) is the note; +14 / −3
    # (P[X >= 14 | 17, 1/2] = 0.0064 < 0.0202, the warning level's p) is a gain, no note
    assert sum(math.comb(19, i) for i in range(11, 20)) / 2 ** 19 == pytest.approx(0.3238, abs=1e-4)
    note = next(n for n in diagnose(held_out_rows(11, 8, rising), run_config=finished).notes
                if n.startswith("reward without gold"))
    assert "did not rise significantly (38% -> 40%; paired: 11 wrong -> right, 8 right -> wrong, p of a gain = 0.32)" \
        in note
    assert sum(math.comb(17, i) for i in range(14, 18)) / 2 ** 17 < 0.0202
    assert not any(n.startswith("reward without gold") for n in diagnose(held_out_rows(14, 3, rising),
                                                                         run_config=finished).notes)
    # a significant fall with the reward up is reward hacking, named by the gold band, not a note
    d = diagnose(held_out_rows(0, 30, rising), run_config=finished)
    assert d.failure_mode == "reward hacking" and not any(n.startswith("reward without gold") for n in d.notes)


def test_a_reward_rise_within_its_noise_is_no_reward_without_gold():
    """Issue 51: held-out reward 0.380 -> 0.381 with 76/200 right at every evaluation gave the note (at 0.379, none:
    a coin flip). With the rewards' spread over the 200 prompts 0.45 the standard error of the rise is
    sqrt(2 · 0.45² / 200) = 0.045: 0.001 is z = 0.02, no note, and the run is HEALTHY. The threshold is the gold
    bands' warning level, z = 2.05: a rise of 0.095 (z = 2.11) gives the note, 0.09 (z = 2.00) none."""
    finished = {"steps": N}
    n_evals = sum("eval/accuracy" in r for r in short_answer_rows(0, 0))
    se = math.sqrt(2 * 0.45 ** 2 / 200)
    assert 0.09 / se < GOLD_WARN < 0.095 / se

    def rows(rise):
        return held_out_rows(0, 0, [0.380] * (n_evals - 1) + [0.380 + rise], reward_std=0.45)

    d = diagnose(rows(0.001), run_config=finished)
    assert not any(n.startswith("reward without gold") for n in d.notes)
    assert d.level == "HEALTHY" and format_diagnosis(d).startswith("HEALTHY: no band reached its alarm in 60 steps")
    assert any(n.startswith("reward without gold") for n in diagnose(rows(0.095), run_config=finished).notes)
    assert not any(n.startswith("reward without gold") for n in diagnose(rows(0.09), run_config=finished).notes)
    # a run logged before eval/reward_std: the rise cannot be judged, no note
    assert not any(n.startswith("reward without gold") for n in diagnose(
        held_out_rows(0, 0, [0.380] * (n_evals - 1) + [0.9], reward_std=None), run_config=finished).notes)


def test_a_run_whose_gold_fell_does_not_read_healthy():
    """Gold 76 -> 74 of 200 (+8 / −10): far from an alarm (p of a fall 0.41), no reward rise to speak of (the reward is
    the accuracy): the headline is a WARNING naming the fall, not HEALTHY."""
    d = diagnose(held_out_rows(8, 10, None), run_config={"steps": N})
    note = next(n for n in d.notes if n.startswith("gold fell"))
    p_fall = sum(math.comb(18, i) for i in range(10, 19)) / 2 ** 18  # P[X >= 10 | 18, 1/2]
    assert "38.0% at step 5 -> 37.0% at step 60" in note and f"p of a fall = {p_fall:.2g}" in note
    assert d.healthy and d.level == "WARNING"
    assert format_diagnosis(d).startswith("WARNING: gold fell (below); no band reached its alarm in 60 steps")


def test_a_held_out_gain_does_not_vouch_for_a_blow_up_after_the_evaluation():
    """Issue 51's planted history: the mean KL in alarm at 0.9 nats a token from step 40, a +20 / −0 evaluation at
    step 50 (p = 9.5e-7), then 0.9 -> 6.8 -> 52 nats in the ten steps after it (0.9 · (52/0.9)^((s − 50)/10)). The
    evaluation measured a policy 0.9 nats out, not 52: the alarm is the verdict (it read "healthy (60 steps, no band
    in alarm)"). The KL tail holding its level (7) after the evaluation stays vouched for, and so does the mean KL
    when it holds 0.9."""
    def planted(after):
        rows = short_answer_rows(20, 0)
        for r in rows:
            if r["step"] > 50:
                for k in [k for k in r if k.startswith("eval/")]:
                    del r[k]
            if r["step"] >= 40:
                r["objective/kl"] = after(r["step"]) if r["step"] > 50 else 0.9
        return rows

    rows = planted(lambda s: 0.9 * (52 / 0.9) ** ((s - 50) / 10))
    assert [round(r["objective/kl"], 1) for r in rows if r["step"] in (50, 55, 60)] == [0.9, 6.8, 52.0]
    d = diagnose(rows, run_config={"steps": N})
    assert not d.healthy and d.level == "UNHEALTHY"
    assert (d.failure_mode, d.cause_metric, d.first_step, d.alarm_step) == ("KL explosion", "objective/kl", 40, 40)
    assert any(n.startswith("KL explosion not counted (objective/kl_p99") for n in d.notes)
    assert not any(n.startswith("KL explosion not counted (objective/kl ") for n in d.notes)
    d = diagnose(planted(lambda s: 0.9), run_config={"steps": N})  # the level the evaluation saw: covered
    assert d.healthy and any(n.startswith("KL explosion not counted (objective/kl ") for n in d.notes)
    d = diagnose(planted(lambda s: 1.2), run_config={"steps": N})  # 1.33x the worst it saw, past the 1.25 slack
    assert (d.healthy, d.cause_metric) == (False, "objective/kl")


def flat_rows(**per_step) -> list[dict]:
    """Issue 51's run: a score of 0.000 on every row of every step, the policy barely moving (clip fraction 2%, KL
    0.001: "not learning"), the held-out answers 2 distinct in 8 at every evaluation (no fall against the first)."""
    rows = healthy_rows()
    for r in rows:
        r.update({"objective/scores": 0.0, "objective/scores_raw": 0.0, "objective/scores_std": 0.0,
                  "policy/clip_fraction": 0.02, "objective/kl": 0.001, **per_step})
        if "eval/reward" in r:
            r.update({"eval/reward": 0.0, "eval/n": 8, "eval/distinct_responses": 2 / 8})
    return rows


def test_a_flat_reward_is_ranked_first_and_names_collapsed_answers():
    d = diagnose(flat_rows())
    assert (d.failure_mode, d.cause_band, d.first_step, d.alarm_step) == ("no reward signal", "flat_reward", 1, 5)
    assert d.prescriptions[0]["action"].startswith("the reward gives no signal: check the reward function and its "
                                                   "answer column")
    assert d.prescriptions[0]["priority"] == 1 and d.prescriptions[0]["key"] == "reward.sources"
    assert [c["failure_mode"] for c in d.evidence["chain"]] == ["not learning"]  # what followed, not the verdict
    text = format_diagnosis(d)
    assert text.splitlines()[0] == "UNHEALTHY: no reward signal; answers collapsed (2 distinct in 8)"
    assert "raise the actor learning rate" not in text
    assert text.index("what followed") < text.index("1. the reward gives no signal")
    assert any(n.startswith("answers collapsed: the held-out answers at step 60 are 2 distinct in 8") for n in d.notes)
    # K >= 2 without objective/scores_std: every group flat, each solved and unsolved at once (all samples alike)
    groups = [{k: v for k, v in r.items() if k != "objective/scores_std"} for r in flat_rows(
        **{"group/no_spread_fraction": 1.0, "group/solved_fraction": 1.0, "group/unsolved_fraction": 1.0})]
    assert diagnose(groups).failure_mode == "no reward signal"
    # nothing but the means logged: identical means over the first steps read as flat, and say so
    bare = [{k: v for k, v in r.items() if k != "objective/scores_std"} for r in flat_rows()]
    assert "judged by the means" in diagnose(bare).evidence["meaning"]


def test_scores_that_vary_within_a_step_or_later_in_the_first_steps_are_no_flat_reward():
    assert diagnose(flat_rows(**{"objective/scores_std": 0.3})).failure_mode == "not learning"  # same mean, spread
    rows = flat_rows()
    rows[3]["objective/scores_raw"] = 0.125  # one right reply of 8 at step 4
    assert diagnose(rows).failure_mode == "not learning"
    groups = flat_rows(**{"group/no_spread_fraction": 0.75, "group/solved_fraction": 0.0,
                          "group/unsolved_fraction": 0.75})
    assert diagnose([{k: v for k, v in r.items() if k != "objective/scores_std"} for r in groups]
                    ).failure_mode == "not learning"


def test_cli_warning_exits_0_and_json_carries_the_level(tmp_path, capsys):
    """A WARNING is no alarm: exit 0, the headline says WARNING, --json has "level"; a flat reward exits 1."""
    run = write_run(tmp_path, held_out_rows(8, 10, None), config={"steps": N})
    assert main(["doctor", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"{run}: WARNING: gold fell (below)")
    assert main(["doctor", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["level"], out["healthy"]) == ("WARNING", True)
    flat = write_run(tmp_path, flat_rows(), name="flat")
    assert main(["doctor", str(flat), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["level"] == "UNHEALTHY"
