"""The health bands of a PPO run (SPEC D1) as one table of data, :data:`BANDS`: which metric (a key of
``metrics.jsonl``), what it is compared with, the healthy range, the alarm threshold, what it means and the failure
mode it points to, and the failure modes' names. :mod:`tether.diagnostics.health` checks them step by step (and
re-exports them). The no-op rows (:mod:`tether.diagnostics.noop`) and the late-collapse rows
(:mod:`tether.diagnostics.drift`) are kept in their own modules and placed here. Imports only the standard library and
those modules.
"""

from __future__ import annotations

from tether.diagnostics.band import GOLD_MEASURES, MEASURES, Band, _number  # noqa: F401  importable from here too
from tether.diagnostics.drift import (  # noqa: F401  their failure modes importable from here with the others
    ENTROPY_BLOWUP,
    ENTROPY_RISE_BAND,
    REPETITION,
    REPETITION_BAND,
)
from tether.diagnostics.noop import (  # noqa: F401  likewise
    ADVANTAGES_ZERO,
    ENGINE_BEHIND,
    NOOP_BANDS,
    WEIGHTS_UNCHANGED,
)

# Failure modes, named as in SPEC D2.
KL_EXPLOSION = "KL explosion"
RATIO = "ratio out of control"
VALUE_COLLAPSE = "value collapse"
MODE_COLLAPSE = "mode collapse"
REWARD_HACKING = "reward hacking"
COLLAPSE = "collapse"
NOT_LEARNING = "not learning"
NO_SIGNAL = "no signal in the groups"
SHORTCUT = "shortcut"
TASK_DROPPED = "the check satisfied, the task dropped"  # per problem: tether.diagnostics.shortcut
SAMPLER_MISMATCH = "sampler mismatch"

GOLD_WARN, GOLD_ALARM = 2.05, 3.0  # σ of the gold bands' corrected evidence (one-sided p 0.0202, 0.00135)

# The table, in the order of the causal chain of reference D.6 (ratio → KL → value → entropy/length →
# reward hacking): when two bands leave their healthy range at the same step the earlier row is the cause.
BANDS: tuple[Band, ...] = NOOP_BANDS + (  # first: a step that changes nothing (tether.diagnostics.noop)
    # First in the chain: samples drawn from another distribution than the one PPO scores make every ratio
    # wrong from the start (B19). Only an engine that reports its log-probs gives these; fp32 gives ~1e-14 KL and a
    # 1e-7 gap, a bf16 engine 1e-4–1e-3 KL. One step off (C7) the engine's weights are one update older by design:
    # rows with rollout/staleness > 0 measure that update too, and are left to the ratio bands.
    Band("rollout_mismatch", "rollout/mismatch_kl", "value", (None, 0.002), None, 0.02, SAMPLER_MISMATCH,
         "mean per-token KL(π_engine ‖ π_old) on the sampled tokens: the engine samples another distribution than "
         "PPO scores (its precision or kernels, a missed weight sync, a stale prefix cache); uncorrected "
         "(--rollout-correction none) the policy gradient is biased by it", reported_by_some_runs=True,
         only_if=("rollout/staleness", None, 0)),
    # The gap is the same fault as the mismatch KL seen per token, not an epoch loop gone off-policy: its cures are
    # the sampler's (the correction, the sync, the engine's precision), not smaller steps.
    Band("sampler_gap", "rollout/logprob_gap_mean", "value", (None, 0.01), None, 0.05, SAMPLER_MISMATCH,
         "mean |log π_sampler − log π_old| per response token: the rollout engine samples another distribution "
         "than the one PPO scores (a missed weight sync, a sampling option the engine applied, low precision)",
         reported_by_some_runs=True, only_if=("rollout/staleness", None, 0)),
    Band("ratio_std", "policy/ratio_std", "value", (None, 0.1), None, 0.3, RATIO,
         "spread of π/π_old over the epoch loop; large = the last epochs are far off-policy (IS fails)"),
    Band("clip_fraction", "policy/clip_fraction", "value", (0.05, 0.2), None, 0.5, RATIO,
         "share of tokens whose ratio hit the clip; > 50% = severely off-policy"),
    Band("kl_mean", "objective/kl", "value", (0.01, 0.1), None, 0.5, KL_EXPLOSION,
         "mean per-token KL to the reference; the tether is slipping"),
    # "KL max per token" (reference D.2) judged on the 99th percentile of the batch's per-token KL, not its
    # maximum: the max of B·T single-sample estimates is an extreme-value statistic that grows with batch
    # size and response length, and one token decides it. In the demo's β = 0.2 run (1,000 tokens a step) the
    # max was 6.3 and the 99th percentile 3.5 (exact per-position KL, Σ_v π log(π/π_ref): 5.5 and 3.4), the
    # top tokens a character policy changing a digit the reference held at p = 0.001–0.004. At least 1% of
    # tokens must run away to alarm.
    Band("kl_max", "objective/kl_p99", "value", (None, 1.0), None, 5.0, KL_EXPLOSION,
         "99th percentile of the per-token KL to the reference (its max, robust to a handful of tokens); "
         "high = a share of tokens has run away (gibberish, repetition)"),
    Band("value_loss", "value/loss", "recent", (None, 2.0), None, 5.0, VALUE_COLLAPSE,
         "critic loss against its recent median; should fall, a jump = reward outlier or critic LR too high",
         warmup=True),
    Band("explained_variance", "value/explained_variance", "value", (0.5, None), 0.0, None, VALUE_COLLAPSE,
         "1 − Var[R − V]/Var[R]; < 0 = the critic explains nothing", warmup=True,
         only_if=("value/returns_std", 0.01, None)),  # constant returns: nothing to explain
    Band("entropy", "policy/entropy", "recent", (0.8, None), 0.5, None, MODE_COLLAPSE,
         "policy entropy against its recent median; a sudden drop = the policy collapses onto few outputs"),
    ENTROPY_RISE_BAND,  # the other way, against the run's start (tether.diagnostics.drift)
    Band("length_collapse", "response/length_mean", "early", (0.67, None), 0.5, None, MODE_COLLAPSE,
         "mean response length against the start of the run; collapse = degenerate short outputs"),
    Band("length_surge", "response/length_mean", "early", (None, 1.5), None, 2.0, REWARD_HACKING,
         "mean response length against the start of the run; surge = the reward model's length bias is gamed"),
    REPETITION_BAND,  # tether.diagnostics.drift
    # A drop is judged by its significance, not by a fixed number of points (an evaluation of 250 prompts
    # has a standard error of ~3 points, one of 32 of ~9): the paired exact test of the problems that changed
    # since the best evaluation, times the evaluations the best was chosen from, as a one-sided z. The alarm
    # level is set by simulated flat runs (bench/gold_false_alarms.py, docs/diagnostics.md).
    Band("gold_drop", "eval/accuracy", "gold", (None, GOLD_WARN), None, GOLD_ALARM, REWARD_HACKING,
         "held-out gold metric significantly below its best evaluation (paired on the same problems) while the "
         "reward kept at least half its gain (Goodhart)",
         needs=("eval/n",), final_confirms=True),
    Band("gold_collapse", "eval/accuracy", "gold_collapse", (None, GOLD_WARN), None, GOLD_ALARM, COLLAPSE,
         "held-out gold metric significantly below its best evaluation while the reward fell too: the run got "
         "worse by its own measure as well, a breakdown rather than Goodhart",
         needs=("eval/n",), final_confirms=True),
    # The greedy policy answering every held-out prompt alike (recipe 2's GRPO run: "The answer is 2." to all 100,
    # its 8% accuracy the 8 problems whose answer is 2): no reward or gold band sees a constant guess that scores.
    Band("eval_distinct", "eval/distinct_responses", "first", (0.5, None), 0.25, None, MODE_COLLAPSE,
         "share of distinct held-out responses against the first evaluation; collapse = the same answer to "
         "different prompts", final_confirms=True),
    # A reward that is its own gold (a checker) is blind to a policy that satisfies the check and drops the task (a
    # title repeated in place of the content, a required closing phrase as the whole answer): no gold band sees it.
    # What does: the held-out answers no longer resemble the reference policy's answers to the same prompts while
    # the held-out reward is up. Word-bag F1 with the step-0 answers: 1 at step 0; an arithmetic answer that turns
    # right keeps its words ("The answer is 7." vs "... 5.": 0.75).
    Band("eval_shortcut", "eval/reference_overlap", "value", (0.3, None), 0.15, None, SHORTCUT,
         "word-bag F1 of the held-out answers with the reference policy's (step-0) answers to the same prompts, "
         "judged while the held-out reward is above its step-0 value: low = the reward rose while the answers "
         "stopped resembling the task's (a check satisfied, the task dropped: read the answers)",
         only_if=("eval/reward_gain", 1e-9, None), final_confirms=True, reported_by_some_runs=True),
    # K >= 2 samples per prompt (B17): a group scored all alike gives every group baseline a zero advantage; for a 0/1
    # reward solved with probability p their share is p^K + (1 − p)^K (K = 4: 0.13 at p = 0.5, 0.82 at p = 0.05).
    Band("no_spread", "group/no_spread_fraction", "value", (None, 0.5), None, 0.8, NO_SIGNAL,
         "share of prompt groups whose K samples all got the same score: no signal for a group baseline "
         "(all solved, or none)", reported_by_some_runs=True),
    Band("not_learning", "policy/clip_fraction", "value", (0.05, None), 0.05, None, NOT_LEARNING,
         "clip fraction < 5% for a long stretch while the policy stays at the reference (KL < 0.01): "
         "it barely moves (LR too low? no advantage signal?)",
         persistence="not_learning_steps", only_if=("objective/kl", None, 0.01)),
)
BAND_NAMES = tuple(b.name for b in BANDS)
