"""Health bands (D1) as data, their overrides, and the live monitor's alerts (D3)."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

from statistics import NormalDist

import pytest

from tether.cli_flags import add_config_flags
from tether.config import config_from_dict, resolve_config
from tether.diagnostics.health import BANDS, GOLD_ALARM, GOLD_WARN, HealthConfig, HealthMonitor, resolve_bands
from tether.errors import ConfigError


def band(name, bands=BANDS):
    return next(b for b in bands if b.name == name)


def feed(monitor, key, values, extra=None):
    """Feed one metric's values from step 1; return {step: [alerts]} for steps that alerted."""
    out = {}
    for step, v in enumerate(values, 1):
        alerts = monitor.update(step, {key: v, **(extra or {})})
        if alerts:
            out[step] = alerts
    return out


def test_default_table_is_the_reference_d1():
    got = {b.name: (b.key, b.healthy, b.alarm_low, b.alarm_high, b.failure_mode) for b in BANDS}
    assert got["kl_mean"] == ("objective/kl", (0.01, 0.1), None, 0.5, "KL explosion")
    assert got["kl_max"] == ("objective/kl_p99", (None, 1.0), None, 5.0, "KL explosion")
    assert got["ratio_std"] == ("policy/ratio_std", (None, 0.1), None, 0.3, "ratio out of control")
    assert got["clip_fraction"] == ("policy/clip_fraction", (0.05, 0.2), None, 0.5, "ratio out of control")
    assert got["not_learning"] == ("policy/clip_fraction", (0.05, None), 0.05, None, "not learning")
    assert got["explained_variance"] == ("value/explained_variance", (0.5, None), 0.0, None, "value collapse")
    assert got["value_loss"][2:] == (None, 5.0, "value collapse")
    assert got["entropy"][1:] == ((0.8, None), 0.5, None, "mode collapse")
    assert got["length_surge"][3:] == (2.0, "reward hacking")
    assert got["length_collapse"][2:] == (0.5, None, "mode collapse")
    assert got["gold_drop"][0] == "eval/accuracy"
    assert got["sampler_gap"] == ("rollout/logprob_gap_mean", (None, 0.01), None, 0.05, "sampler mismatch")
    assert got["rollout_mismatch"] == ("rollout/mismatch_kl", (None, 0.002), None, 0.02, "sampler mismatch")
    assert all(b.meaning for b in BANDS)


@pytest.mark.parametrize("name,value,state", [
    ("kl_mean", 0.005, "ok"),   # below the healthy range, but not on the alarm side
    ("kl_mean", 0.05, "ok"), ("kl_mean", 0.2, "warn"), ("kl_mean", 0.6, "alarm"),
    ("explained_variance", 0.7, "ok"), ("explained_variance", 0.3, "warn"), ("explained_variance", -0.1, "alarm"),
    ("clip_fraction", 0.01, "ok"), ("clip_fraction", 0.3, "warn"), ("clip_fraction", 0.6, "alarm"),
    ("not_learning", 0.01, "alarm"), ("not_learning", 0.1, "ok"),
    ("kl_max", float("nan"), "alarm"), ("kl_max", float("inf"), "alarm"),
    ("sampler_gap", 1e-7, "ok"), ("sampler_gap", 0.03, "warn"), ("sampler_gap", 0.2, "alarm"),
    ("rollout_mismatch", 1e-14, "ok"), ("rollout_mismatch", 0.005, "warn"), ("rollout_mismatch", 0.05, "alarm"),
])
def test_band_state(name, value, state):
    assert band(name).state(value) == state


def test_alert_once_when_alarm_persists_and_healthy_flag():
    m = HealthMonitor(HealthConfig(persistence=2))
    healthy = []
    alerts = {}
    for step, kl in enumerate([0.05, 0.2, 0.6, 0.7, 0.8, 0.05, 0.7, 0.7], 1):
        got = m.update(step, {"objective/kl": kl})
        if got:
            alerts[step] = got
        healthy.append(m.healthy)
    assert list(alerts) == [4]  # 0.6 at step 3 and 0.7 at step 4: alarm confirmed at 4, once per run
    (a,) = alerts[4]
    assert (a.band.name, a.alarm_step, a.onset_step, a.value) == ("kl_mean", 3, 2, 0.7)
    assert healthy == [True, True, True, False, False, True, True, False]
    line = str(a)
    assert "\n" not in line and "step 4" in line and "objective/kl" in line and "KL explosion" in line
    assert "since step 2" in line


def test_persistence_one_alerts_on_the_first_step():
    m = HealthMonitor(HealthConfig(persistence=1))
    assert list(feed(m, "policy/ratio_std", [0.05, 0.5, 0.05])) == [2]


def test_single_spike_is_not_an_alarm_with_default_persistence():
    m = HealthMonitor()
    assert feed(m, "policy/ratio_std", [0.05, 0.5, 0.05, 0.05, 0.6, 0.05]) == {}
    assert m.healthy


def test_reset_forgets_alerts():
    m = HealthMonitor(HealthConfig(persistence=1))
    assert feed(m, "objective/kl", [0.6]) and not m.healthy
    m.reset()
    assert m.healthy and feed(m, "objective/kl", [0.6])


def test_recent_median_measure_entropy_drop():
    m = HealthMonitor()
    got = feed(m, "policy/entropy", [2.0, 2.1, 1.9, 2.0, 0.9, 0.9, 0.9])
    (a,) = got[6]
    # step 5: 0.9 / median(2.0, 2.1, 1.9, 2.0) = 0.45 < 0.5; step 6: 0.9 / 2.0 = 0.45 again
    assert (a.alarm_step, a.onset_step) == (5, 5) and a.measure == pytest.approx(0.45)
    assert list(got) == [6]


def test_gradual_entropy_decline_is_not_a_drop():
    m = HealthMonitor()
    assert feed(m, "policy/entropy", [2.0 * 0.97 ** s for s in range(80)]) == {}


def test_early_median_measure_length():
    m = HealthMonitor(HealthConfig(baseline_steps=3))
    got = feed(m, "response/length_mean", [10, 12, 11, 11, 16, 25, 25])
    (a,) = got[7]  # baseline median(10, 12, 11) = 11; 16/11 = 1.45 ok; 25/11 = 2.27 > 2 at steps 6 and 7
    assert a.band.name == "length_surge" and a.onset_step == 6
    got = feed(HealthMonitor(HealthConfig(baseline_steps=3)), "response/length_mean", [10, 12, 11, 5, 4, 4])
    assert [a.band.name for a in got[5]] == ["length_collapse"]


def test_warmup_skips_the_critic_bands():
    cfg = HealthConfig(warmup=5)
    assert feed(HealthMonitor(cfg), "value/explained_variance", [-0.5] * 5 + [0.6] * 5) == {}
    got = feed(HealthMonitor(cfg), "value/explained_variance", [-0.5] * 7)
    (a,) = got[7]
    assert (a.alarm_step, a.onset_step) == (6, 6)  # never healthy before: the onset is the alarm itself


def _z(p_best, n_best, p, n):
    """Agresti–Caffo z of a drop in a proportion, written out independently of tether.health."""
    a, b = (p_best * n_best + 1) / (n_best + 2), (p * n + 1) / (n + 2)
    return (a - b) / math.sqrt(a * (1 - a) / (n_best + 2) + b * (1 - b) / (n + 2))


def _selected(z, candidates):
    """The gold bands' measure for rows without per-problem results: the one-sided p of an unpaired z, times
    the earlier evaluations the best was chosen from, back to a z."""
    return -NormalDist().inv_cdf(min(0.5, candidates * NormalDist().cdf(-z)))


def test_gold_drop_needs_reward_rising():
    rows = [(0.3, 0.0), (0.5, 0.1), (0.45, 0.2), (0.35, 0.3), (0.3, 0.4), (0.3, 0.5)]  # (accuracy, reward), n = 200
    # The best is step 20 (chosen from 2, 3, 4, then 5 earlier evaluations): step 30 ok, 40 warns, 50-60 alarm
    assert _selected(_z(0.5, 200, 0.45, 200), 2) < GOLD_WARN < _selected(_z(0.5, 200, 0.35, 200), 3) < GOLD_ALARM
    assert GOLD_ALARM < min(_selected(_z(0.5, 200, 0.3, 200), 4), _selected(_z(0.5, 200, 0.3, 200), 5))
    m = HealthMonitor()
    alerts = {}
    for step, (acc, rew) in enumerate(rows, 1):
        if got := m.update(step * 10, {"eval/accuracy": acc, "eval/reward": rew, "eval/n": 200}):
            alerts[step * 10] = got
    (a,) = alerts[60]
    assert (a.band.name, a.alarm_step, a.onset_step) == ("gold_drop", 50, 40)
    assert a.measure == pytest.approx(_selected(_z(0.5, 200, 0.3, 200), 5))
    assert "unpaired (no per-problem results)" in str(a)
    m = HealthMonitor()
    got = [a for step, (acc, _) in enumerate(rows, 1)  # reward falling with the accuracy: a collapse, not hacking
           for a in m.update(step, {"eval/accuracy": acc, "objective/scores_raw": -step, "eval/n": 200})]
    assert [(a.band.name, a.failure_mode, a.alarm_step) for a in got] == [("gold_collapse", "collapse", 5)]


def test_gold_drop_holds_while_a_flat_reward_wobbles_and_ends_when_the_reward_gives_back_its_gain():
    # demo seed 1, beta = 0 (n = 250): the reward flat after step 10, a hair under its step-10 value at 30
    evals = [(0.664, 0.2947), (0.688, 0.5075), (0.492, 0.5123), (0.432, 0.5045), (0.368, 0.5294)]
    assert min(_selected(_z(0.688, 250, acc, 250), s) for s, (acc, _) in enumerate(evals[2:], 2)) > GOLD_ALARM
    m = HealthMonitor()
    got = {10 * s: a for s, (acc, rew) in enumerate(evals)
           for a in m.update(10 * s, {"eval/accuracy": acc, "eval/reward": rew, "eval/n": 250})}
    (step, a), = got.items()  # confirmed at step 30 (two evaluations in alarm), in alarm since step 20
    assert (step, a.band.name, a.alarm_step, a.onset_step) == (30, "gold_drop", 20, 20)
    # the same fall with the reward back below half its gain (0.2947 + 0.213 / 2 = 0.401): not Goodhart
    m = HealthMonitor()
    fell = [(0.664, 0.2947), (0.688, 0.5075), (0.492, 0.40), (0.432, 0.39)]
    got = [a for s, (acc, rew) in enumerate(fell) for a in m.update(s, {"eval/accuracy": acc, "eval/reward": rew,
                                                                         "eval/n": 250})]
    assert [p.measure for p in m.trace("gold_drop")][2:] == [0.0, 0.0]
    assert [a.band.name for a in got] == ["gold_collapse"]  # both fell: a breakdown


@pytest.mark.parametrize("n, alarmed", [(32, False), (1000, True)])
def test_gold_drop_is_judged_by_its_significance_not_its_size(n, alarmed):
    # the same 10-point fall (50% -> 40%, twice) is noise on 32 prompts and a real fall on 1000
    assert (min(_selected(_z(0.5, n, 0.4, n), 1), _selected(_z(0.5, n, 0.4, n), 2)) > GOLD_ALARM) == alarmed
    m = HealthMonitor()
    got = [a for s, acc in enumerate([0.5, 0.4, 0.4], 1)
           for a in m.update(s, {"eval/accuracy": acc, "eval/reward": float(s), "eval/n": n})]
    assert [a.band.name for a in got] == (["gold_drop"] if alarmed else [])


def test_gold_drop_at_the_final_evaluation_alarms_without_waiting_for_a_second():
    # demo seed 4, beta = 0 (n = 250): gold 43.6 -> 40.8 -> 41.6 -> 32.8 -> 29.2% while the reward rose
    evals = [(0.436, -0.036), (0.408, 0.135), (0.416, 0.18), (0.328, 0.213), (0.292, 0.205)]
    # warn at 30 and 40 (the best, step 0, chosen from 3 and 4 earlier evaluations): with the tether off
    # (β not logged here) the final evaluation's warning is its alarm
    assert GOLD_WARN < _selected(_z(0.436, 250, 0.328, 250), 3) < _selected(_z(0.436, 250, 0.292, 250), 4) < GOLD_ALARM

    def run(final_step):
        m = HealthMonitor()
        return {10 * s: a for s, (acc, rew) in enumerate(evals)
                for a in m.update(10 * s, {"eval/accuracy": acc, "eval/reward": rew, "eval/n": 250},
                                  final=10 * s == final_step)}

    assert run(final_step=None) == {}  # one evaluation in alarm: not confirmed while the run goes on
    (step, a), = run(final_step=40).items()  # the run's last evaluation: nothing comes after to confirm it
    assert (step, a.band.name, a.alarm_step, a.onset_step) == (40, "gold_drop", 40, 30)
    assert a.measure == pytest.approx(_selected(_z(0.436, 250, 0.292, 250), 4))
    # bands without final_confirms keep their persistence at the final step: a last-step KL spike is no alarm
    m = HealthMonitor()
    for step in range(1, 10):
        assert m.update(step, {"objective/kl": 0.05 if step < 9 else 5.0}, final=step == 9) == []


def test_gold_drop_needs_the_evaluation_size():
    m = HealthMonitor()
    for s, acc in enumerate([0.9, 0.1, 0.1, 0.1], 1):
        assert m.update(s, {"eval/accuracy": acc, "eval/reward": float(s)}) == []
    assert m.trace("gold_drop") == []


def test_not_learning_needs_a_long_stretch_at_the_reference():
    cfg = HealthConfig(not_learning_steps=20)
    got = feed(HealthMonitor(cfg), "policy/clip_fraction", [0.01] * 25, extra={"objective/kl": 0.001})
    (a,) = got[20]
    assert (a.band.name, a.alarm_step, a.onset_step) == ("not_learning", 1, 1)
    # the same clip fraction while the policy has moved from the reference (KL >= 0.01): a slow learner
    assert feed(HealthMonitor(cfg), "policy/clip_fraction", [0.01] * 25, extra={"objective/kl": 0.05}) == {}
    assert feed(HealthMonitor(cfg), "policy/clip_fraction", [0.01] * 19) == {}


def test_explained_variance_not_judged_when_returns_are_constant():
    cfg = HealthConfig(warmup=0)
    assert feed(HealthMonitor(cfg), "value/explained_variance", [-3.0] * 5, extra={"value/returns_std": 1e-4}) == {}
    assert list(feed(HealthMonitor(cfg), "value/explained_variance", [-3.0] * 5,
                     extra={"value/returns_std": 0.5})) == [2]


def test_missing_and_non_numeric_values_are_ignored():
    m = HealthMonitor(HealthConfig(persistence=1))
    assert m.update(1, {}) == []
    assert m.update(2, {"objective/kl": None, "policy/ratio_std": "high", "ppo/early_stopped": True}) == []
    assert m.healthy


def test_overrides():
    cfg = HealthConfig(bands=["kl_mean=0.01:0.2::1.0", "ratio_std=off"])
    bands = resolve_bands(cfg)
    assert "ratio_std" not in {b.name for b in bands}
    kl = band("kl_mean", bands)
    assert (kl.healthy, kl.alarm_low, kl.alarm_high) == ((0.01, 0.2), None, 1.0)
    m = HealthMonitor(HealthConfig(persistence=1, bands=cfg.bands))
    assert feed(m, "objective/kl", [0.6, 0.8]) == {} and feed(m, "policy/ratio_std", [5.0]) == {}
    assert list(feed(HealthMonitor(HealthConfig(persistence=1)), "objective/kl", [0.6])) == [1]


@pytest.mark.parametrize("spec,msg", [
    ("kl=0:1:2:3", "NAME one of"), ("kl_mean", "NAME one of"), ("kl_mean=0:1:2", "4 ':'-separated"),
    ("kl_mean=a:1::2", "'a' is not a number"), ("kl_mean=0:1::", "at least one alarm bound"),
])
def test_bad_override_is_a_config_error(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        HealthConfig(bands=[spec]).validate()


def test_health_config_flags_and_yaml(tmp_path):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, HealthConfig)
    args = parser.parse_args(["--health-persistence", "3", "--stop-on-alarm", "--health-band", "kl_mean=off",
                              "--health-band", "entropy=0.9:::0.6"])
    cfg = resolve_config(HealthConfig, args)
    assert cfg.persistence == 3 and cfg.stop_on_alarm and not cfg.rollback
    assert cfg.bands == ["kl_mean=off", "entropy=0.9:::0.6"]
    args = parser.parse_args(["--health-persistence", "0"])
    with pytest.raises(ConfigError, match="--health-persistence"):
        resolve_config(HealthConfig, args)
    cfg = config_from_dict(HealthConfig, {"warmup": 0, "bands": ["kl_max=::0:9"]})
    assert cfg.warmup == 0 and band("kl_max", resolve_bands(cfg)).alarm_high == 9.0


def test_import_is_light():
    code = ("import sys, tether.diagnostics.health, tether.diagnostics.doctor; "
            "assert 'transformers' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
