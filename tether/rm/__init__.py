"""Stage A, the reward model: the backbone both kinds share (``backbone``: padding, hidden states,
pooling, loading), the model and its scoring API (``model``: text formats, standardised scores,
ensembles), the ``train-rm`` config (``config``), training top to bottom (``train``),
``RewardTrainer`` (``trainer``), its checkpoints and resume (``resume``), the pairwise evaluation (``evaluate``) and the
command line (``cli``); process reward models (A9): step-labelled data and the converter (``steps``),
``ProcessRewardModel``'s step read-outs, scoring and evaluation (``process``), ``train-rm --process`` top to
bottom (``train_process``) and ``tether label-steps`` (``label_cli``).

May import: ``tether.core`` and the shared modules (``config``, ``data``, ``errors``, ``hf``, ``presets``,
``checkpoint``, ``metrics``, ``callbacks``, ``conversations``) — never ``tether.ppo``, ``tether.diagnostics``
or ``tether.demo``.
"""
