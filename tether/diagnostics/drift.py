"""Late collapse (issue 54): two bands that judge a run against its own start, for the breakdowns that come after a
healthy beginning and that the existing bands, which look for a collapse of entropy and length, do not see.

- ``entropy_rise``: ``policy/entropy`` against the median of the run's first ``health.baseline_steps`` steps. A
  policy whose per-token entropy doubles is spreading its mass over tokens the task never wanted (the blow-up that
  ends in gibberish); the ``entropy`` band sees only the opposite direction, and only against the recent median, which
  a slow rise carries along with it.
- ``repetition``: ``response/repetition`` (1 − distinct/total token 3-grams within responses, pooled) minus the same
  early median: an *additive* rise, because the share starts near 0 in healthy runs and a ratio to ~0 says nothing.
  +0.3 = three more 3-grams in ten repeat an earlier one of their own response than at the start: loops.

Thresholds are for drift well outside step-to-step noise (the planted healthy histories of tests/test_doctor_late.py
jitter entropy by 3% a step and repetition by ±0.02, and stay far inside); persistence as the other bands'.
Prescriptions as tuples (see :mod:`tether.diagnostics.noop`). Imports only :mod:`tether.diagnostics.band`.
"""

from __future__ import annotations

from tether.diagnostics.band import Band

ENTROPY_BLOWUP = "entropy blow-up"
REPETITION = "repetition loops"
DRIFT_MODES = (ENTROPY_BLOWUP, REPETITION)

ENTROPY_RISE_BAND = Band(
    "entropy_rise", "policy/entropy", "early", (None, 1.5), None, 2.0, ENTROPY_BLOWUP,
    "policy entropy against the start of the run; a rise to twice it = the policy spreads its mass over tokens the "
    "task never used (the way to gibberish)")
REPETITION_BAND = Band(
    "repetition", "response/repetition", "rise", (None, 0.15), None, 0.3, REPETITION,
    "share of repeated token 3-grams within responses, minus its value at the start of the run; +0.3 = responses "
    "looping on their own phrases", reported_by_some_runs=True)


def _is(*values):
    return lambda current: current in values


def _half(current):
    return f"{current * 0.5:.3g}" if isinstance(current, (int, float)) and not isinstance(current, bool) else None


def _beta(current):
    if isinstance(current, (int, float)) and current == 0:
        return "0.05–0.2 (β = 0: the tether is off)"
    return f"{current * 2:.3g}–{current * 4:.3g}" if isinstance(current, (int, float)) else None


# no key: the doctor's own best-evaluation line (tether.diagnostics.best) carries eval.keep_best when the run fell
_KEEP_BEST = ("use the best held-out evaluation's checkpoint rather than the last (--keep-best keeps it in "
              "RUN_DIR/best): the run was better before the drift", None)
_ROLLBACK = ("roll back to the last checkpoint saved while healthy, with the settings above", "health.rollback",
             lambda c: "true", _is(True))

# (action, config key, suggestion given the current value, whether the current value already does it)
PRESCRIPTIONS: dict[str, list[tuple]] = {
    ENTROPY_BLOWUP: [
        ("lower the actor learning rate", "optim.lr", _half),
        ("raise β, the KL coefficient: the reference's entropy is where the tether pulls back to", "kl.coef", _beta),
        ("if the upper clip is widened (clip-higher, DAPO): that is a cure for entropy *collapse*; in a blow-up it "
         "lets unlikely tokens grow faster, so set it back to the lower one", "ppo.clip_range_high",
         lambda c: "none (= ppo.clip_range)" if c is not None else None),
        ("no entropy bonus while entropy rises", "ppo.entropy_coef", lambda c: "0", _is(0, 0.0)),
        _KEEP_BEST,
        _ROLLBACK,
    ],
    REPETITION: [
        ("lower the actor learning rate", "optim.lr", _half),
        ("raise β, the KL coefficient: the reference does not loop", "kl.coef", _beta),
        ("looping responses run to --max-new-tokens without EOS: a penalty for no EOS takes the reward a loop earns",
         "reward.missing_eos_penalty", lambda c: "0.5–1 (in score units)",
         lambda c: isinstance(c, (int, float)) and c > 0),
        _KEEP_BEST,
        _ROLLBACK,
    ],
}
