"""Stage B, PPO: the run config (``config``), the models (``models``: policy, reference, critic),
prompts (``prompts``), reward sources (``sources``: reward models, rules, ensembles, penalties),
sampling and the training-side forward (``rollout``), the typed records of one step (``records``),
building a run (``setup``), the PPO step top to bottom (``step``), the run loop and ``PPOTrainer`` (``train``),
checkpoints and resume (``resume``), the final policy (``export``), inputs given from Python (``inputs``) and
the command line (``cli``).

May import: ``tether.core``, the shared modules, ``tether.rm`` (reward models are a reward source) and
``tether.diagnostics.health`` (live alerts) — never ``tether.demo``.
"""
