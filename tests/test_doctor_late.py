"""tether doctor on planted histories for issue 54: a run that trains nothing (its weights unchanged, its engine left
behind, its advantages all zero), named by step 2, and a late collapse (entropy blowing up, responses looping) judged
against the run's own start — each beside a history it must not name (healthy noise, one-step blips).

Histories start from tests/test_doctor.py's healthy run; the expected steps are computed here from the planted values
and the documented thresholds (docs/diagnostics.md), not read back from the doctor."""

from __future__ import annotations

import random
import statistics

import pytest
from test_doctor import healthy_rows

from tether.diagnostics.doctor import diagnose, format_diagnosis
from tether.diagnostics.drift import ENTROPY_BLOWUP, REPETITION
from tether.diagnostics.noop import ADVANTAGES_ZERO, ENGINE_BEHIND, WEIGHTS_UNCHANGED

N = 60


def one_epoch(rows: list[dict]) -> list[dict]:
    """A one-epoch on-policy run's rows: its clip fraction is 0 by construction (ratio 1 on its only minibatch), its
    update norm and advantages healthy, its engine (vLLM) in step."""
    rng = random.Random(7)
    for r in rows:
        r.update({"policy/clip_fraction": 0.0, "ppo/epochs_run": 1, "ppo/param_update_norm": 0.02 * (1 + rng.random()),
                  "advantages/nonzero_fraction": 0.5 + 0.3 * rng.random(), "rollout/weight_version": r["step"] - 1,
                  "rollout/weight_lag": 0})
    return rows


def test_a_healthy_one_epoch_run_is_healthy_and_a_single_zero_step_is_no_no_op():
    rows = one_epoch(healthy_rows())
    assert diagnose(rows).healthy
    rows[0]["ppo/param_update_norm"] = 0.0  # a warm-up from lr 0: its first update moves nothing
    rows[30]["advantages/nonzero_fraction"] = 0.0  # one batch of groups all scored alike
    d = diagnose(rows)
    assert d.healthy, format_diagnosis(d)


@pytest.mark.parametrize("n_steps", [2, N])
def test_weights_unchanged_is_named_at_step_2(n_steps):
    rows = one_epoch(healthy_rows())[:n_steps]
    for r in rows:
        r["ppo/param_update_norm"] = 0.0  # e.g. the adapter on modules the forward never calls
        r["objective/kl"] = 0.0  # the policy is the reference, step after step
    assert diagnose(rows[:1]).healthy  # one step of no change is allowed (a warm-up from lr 0) ...
    d = diagnose(rows)  # ... the second confirms it: in alarm since step 1
    assert (d.failure_mode, d.cause_band, d.first_step, d.alarm_step) == (WEIGHTS_UNCHANGED, "weights_unchanged", 1, 1)
    assert d.prescriptions[0]["key"] == "model.lora_target_modules"
    text = format_diagnosis(d)
    assert "UNHEALTHY: the run trains nothing (weights unchanged)" in text and "ppo/param_update_norm" in text


def test_an_engine_left_behind_is_named_at_its_first_lag():
    rows = one_epoch(healthy_rows())
    for r in rows:  # the sync never arrives: the engine keeps the step-0 weights
        r["rollout/weight_version"], r["rollout/weight_lag"] = 0, r["step"] - 1
    assert diagnose(rows[:1]).healthy
    d = diagnose(rows[:2])  # a count, not an estimate: its first lag is the fault
    assert (d.failure_mode, d.first_step, d.alarm_step) == (ENGINE_BEHIND, 2, 2)
    assert d.prescriptions[0]["key"] is None and "weight sync" in d.prescriptions[0]["action"]
    assert diagnose(rows).cause_band == "engine_behind"


def test_advantages_all_zero_are_named_at_step_2_before_the_weights_they_leave_unchanged():
    rows = one_epoch(healthy_rows())
    for r in rows:
        r["advantages/nonzero_fraction"] = 0.0
        r["ppo/param_update_norm"] = 0.0  # no gradient: nothing moves either
    assert diagnose(rows[:1]).healthy
    d = diagnose(rows[:2])
    assert (d.failure_mode, d.first_step, d.alarm_step) == (ADVANTAGES_ZERO, 1, 1)
    assert [c["band"] for c in d.evidence["chain"]] == ["weights_unchanged"]
    assert d.prescriptions[0]["key"] == "reward.sources"
    assert diagnose(rows).failure_mode == ADVANTAGES_ZERO


def test_a_run_without_the_no_op_metrics_is_not_reported_unchecked_for_them():
    assert not {"weights_unchanged", "engine_behind", "advantages_zero"} & set(diagnose(healthy_rows()).unchecked)


def early_median(rows, key, k=5):
    return statistics.median(r[key] for r in rows[:k])


def test_entropy_blowing_up_late_is_named_against_the_run_start():
    rows = healthy_rows()
    for r in rows[34:]:  # from step 35 the entropy climbs 12% of its value a step
        r["policy/entropy"] *= 1.12 ** (r["step"] - 34)
    base = early_median(rows, "policy/entropy")
    d = diagnose(rows)
    expected_onset = next(r["step"] for r in rows[5:] if r["policy/entropy"] / base > 1.5)
    expected_alarm = next(r["step"] for r in rows[5:] if r["policy/entropy"] / base > 2.0)
    assert (d.failure_mode, d.cause_band, d.first_step, d.alarm_step) == (
        ENTROPY_BLOWUP, "entropy_rise", expected_onset, expected_alarm)
    assert [p["key"] for p in d.prescriptions][:2] == ["optim.lr", "kl.coef"]
    assert any("--keep-best" in p["action"] for p in d.prescriptions)
    clip_high = next(p for p in d.prescriptions if p["key"] == "ppo.clip_range_high")
    assert "collapse" in clip_high["action"] and clip_high["suggestion"] is None  # not set: nothing to set back
    d = diagnose(rows, run_config={"ppo": {"clip_range": 0.2, "clip_range_high": 0.28}})
    clip_high = next(p for p in d.prescriptions if p["key"] == "ppo.clip_range_high")
    assert (clip_high["current"], clip_high["suggestion"]) == (0.28, "none (= ppo.clip_range)")
    d = diagnose(rows, run_config={"optim": {"lr": 1e-5}, "kl": {"coef": 0.0}})
    assert [(p["current"], p["suggestion"]) for p in d.prescriptions[:2]] == [(1e-5, "5e-06"), (0.0, "0.05–0.2 (β = 0: the tether is off)")]


def test_entropy_noise_and_a_mild_rise_are_no_blow_up():
    rng = random.Random(3)
    rows = healthy_rows()
    for r in rows:  # 10% noise a step (three times the healthy run's) and a slow 30% rise over the run
        r["policy/entropy"] = 2.0 * (1 + 0.3 * r["step"] / N) * (1 + rng.gauss(0, 0.1))
    d = diagnose(rows)
    assert d.healthy, format_diagnosis(d)


def test_responses_looping_late_are_named_against_the_run_start():
    rows = healthy_rows()
    for r in rows:
        r["response/repetition"] = 0.25  # a task whose answers repeat phrases from the start (lists, tables)
    for r in rows[39:]:  # from step 40: 0.04 more repeated 3-grams a step
        r["response/repetition"] = 0.25 + 0.04 * (r["step"] - 39)
    base = early_median(rows, "response/repetition")
    d = diagnose(rows)
    expected_onset = next(r["step"] for r in rows[5:] if r["response/repetition"] - base > 0.15)
    expected_alarm = next(r["step"] for r in rows[5:] if r["response/repetition"] - base > 0.3)
    assert (expected_onset, expected_alarm) == (43, 47)
    assert (d.failure_mode, d.cause_band, d.first_step, d.alarm_step) == (REPETITION, "repetition", 43, 47)
    assert "reward.missing_eos_penalty" in [p["key"] for p in d.prescriptions]


def test_repetition_noise_and_a_high_start_are_no_loops():
    rng = random.Random(5)
    rows = healthy_rows()
    for r in rows:  # high from the start (judged against its own start), noisy by ±0.1
        r["response/repetition"] = 0.5 + rng.uniform(-0.1, 0.1)
    rows[50]["response/repetition"] = 0.95  # one step of loops, not persistent
    d = diagnose(rows)
    assert d.healthy, format_diagnosis(d)
