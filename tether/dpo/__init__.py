"""Direct preference optimisation (``tether dpo``): the policy trained on the preference pairs ``train-rm`` reads,
with the starting policy as the reference and no reward model. The config (``config``); pairs as the policy's
tokens, batches and their reply log-probs (``data``); the run top to bottom and ``DPOTrainer`` (``train``); the
command line (``cli``). The loss is :func:`tether.core.preference.dpo_loss`.

May import: ``tether.core``, the shared modules, ``tether.inputs``, ``tether.sft`` (tokens, batches, the model's
loading and optimisation, as SFT does them) and ``tether.rm.resume``/``tether.rm.train`` (checkpoints, the
optimiser step) — never ``tether.ppo``, ``tether.diagnostics`` or ``tether.demo``.
"""
