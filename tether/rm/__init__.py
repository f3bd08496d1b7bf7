"""Stage A, the reward model: the model and its scoring API (``model``: pooling, text formats,
standardised scores, ensembles), the ``train-rm`` config (``config``), training top to bottom
(``train``), the pairwise evaluation (``evaluate``) and the command line (``cli``).

May import: ``tether.core`` and the shared modules (``config``, ``data``, ``errors``, ``hf``,
``presets``, ``checkpoint``, ``metrics``) — never ``tether.ppo``, ``tether.diagnostics`` or ``tether.demo``.
"""
