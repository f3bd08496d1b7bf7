"""The doctor's "the run trains nothing" (issue 54): three bands that name, by the second step, a run whose update
phase changes nothing — judged from what the step logs (:mod:`tether.ppo.noop`), not from the clip fraction, which
is 0 by construction in a one-epoch on-policy run (its ratio is 1 on its only minibatch) and so cannot tell a no-op
from a healthy GRPO step.

- ``weights_unchanged``: ``ppo/param_update_norm`` = ‖θ_after − θ_before‖₂ over the trainable parameters is 0 at two
  steps in a row (an adapter on modules the forward never reaches, parameters left frozen, a learning rate of 0,
  updates all skipped as non-finite). One zero step alone is allowed: a warm-up that starts at lr 0 moves nothing on
  its first update of a one-update step.
- ``engine_behind``: ``rollout/weight_lag`` = the trainer's weight version − the rollout engine's at sampling is ≥ 1:
  an engine holding its own copy of the weights (vLLM, the rollout processes) samples an older policy than the one
  PPO trains. A count, not an estimate: its first value in alarm is the fault (persistence "once").
- ``advantages_zero``: ``advantages/nonzero_fraction`` is 0 at two steps in a row: every token's advantage is 0, so
  the policy loss has no gradient whatever the learning rate (every group scored alike under a group baseline).

Each band is its own failure mode, so each gets its own prescriptions (:data:`PRESCRIPTIONS`, as tuples that
:mod:`tether.diagnostics.prescriptions` makes its ``Rx``: that module imports this one). Imports only the standard
library and :mod:`tether.diagnostics.band`.
"""

from __future__ import annotations

from tether.diagnostics.band import Band

TRAINS_NOTHING = "the run trains nothing"
WEIGHTS_UNCHANGED = f"{TRAINS_NOTHING} (weights unchanged)"
ENGINE_BEHIND = f"{TRAINS_NOTHING} (engine not updated)"
ADVANTAGES_ZERO = f"{TRAINS_NOTHING} (advantages all zero)"
NOOP_MODES = (WEIGHTS_UNCHANGED, ENGINE_BEHIND, ADVANTAGES_ZERO)

# First rows of the table: nothing downstream of an update that changes nothing is a cause. In causal order: advantages
# all 0 give no gradient, so no weight changes (ties at one step name the advantages); unchanged weights leave the
# engine nothing new to take.
NOOP_BANDS: tuple[Band, ...] = (
    Band("advantages_zero", "advantages/nonzero_fraction", "value", (1e-9, None), 1e-9, None, ADVANTAGES_ZERO,
         "share of response tokens whose advantage is not 0: 0 = the policy loss has no gradient at any learning "
         "rate", reported_by_some_runs=True),
    # 1e-12: any real update is far above it (lr 1e-7 Adam on 1e4 parameters moves them ~1e-5 in norm); an update
    # that changed nothing is exactly 0.
    Band("weights_unchanged", "ppo/param_update_norm", "value", (1e-12, None), 1e-12, None, WEIGHTS_UNCHANGED,
         "‖θ_after − θ_before‖₂ of the trainable parameters over the step's updates: 0 = the update phase ran and "
         "changed no weight", reported_by_some_runs=True),
    Band("engine_behind", "rollout/weight_lag", "value", (None, 0.5), None, 0.5, ENGINE_BEHIND,
         "the trainer's weight version minus the rollout engine's when it sampled: ≥ 1 = the engine missed a weight "
         "sync and samples an older policy than PPO trains", reported_by_some_runs=True, persistence="once"),
)


def _is(*values):
    return lambda current: current in values


# (action, config key, suggestion given the current value, whether the current value already does it)
PRESCRIPTIONS: dict[str, list[tuple]] = {
    WEIGHTS_UNCHANGED: [
        ("check that the adapter reaches the model: its target modules must name modules of this architecture "
         "(a LoRA on modules the forward never calls trains nothing; `tether plan` lists the adapter's tensors)",
         "model.lora_target_modules"),
        ("check the learning rate and its schedule: policy/lr in metrics.jsonl is what each update applied (a "
         "warm-up longer than the run keeps it near 0)", "optim.lr"),
        ("read the step's notes: updates skipped for non-finite losses or gradients (health/skipped_updates) move "
         "nothing", None),
    ],
    ENGINE_BEHIND: [
        ("the engine samples a policy the trainer left behind: check the weight sync (perf/seconds_weight_sync > 0 "
         "at every step) and that the engine's weights are the trainer's (rollout/mismatch_kl near 0)", None),
        ("sample with the trained module itself until the sync is fixed", "generation.engine",
         lambda c: "transformers", _is("transformers")),
    ],
    ADVANTAGES_ZERO: [
        ("the reward gives no spread: every response of a prompt (or of the batch) scored alike, so every "
         "advantage is 0 — score a few responses by hand (samples/step_K.jsonl 'score')", "reward.sources"),
        ("with a group baseline, more samples per prompt make a group with both outcomes likelier",
         "samples_per_prompt", lambda c: f"{2 * c}" if isinstance(c, int) and c > 1 else None),
        ("redraw groups whose scores have no spread (dynamic sampling, --filter-groups)", "difficulty.filter_groups",
         lambda c: "true", _is(True)),
    ],
}
