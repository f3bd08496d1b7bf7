"""Stage B, PPO: the run config (``config``), the models (``models``: policy, reference, critic),
prompts (``prompts``), reward sources (``sources``: reward models, rules, ensembles, penalties),
the training-side forward (``forward``: log-probs, entropy, values), the typed records of one step (``records``),
building a run (``setup``), the PPO step top to bottom (``step``), the run loop and ``PPOTrainer`` (``train``),
checkpoints and resume (``resume``), the final policy (``export``), inputs given from Python (``inputs``) and
the command line (``cli``).

Sampling — engines, the weight wire, the process layouts — is the layer below, ``tether.rollout``.

May import: ``tether.core``, the shared modules, ``tether.rm`` (reward models are a reward source),
``tether.rollout`` (sampling) and ``tether.diagnostics`` (live alerts, the plan) — never ``tether.demo``.
"""
