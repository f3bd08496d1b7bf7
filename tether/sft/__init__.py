"""Stage 0, supervised fine-tuning (SPEC S1–S4): the policy and the reference of the stages after it.

The run config (``config``); SFT rows in the shapes people have them — prompt/response, prompt/completion,
TRL's conversational ``messages`` — read and split by prompt (``data``); their tokens and loss mask, by the chat
template (``tokens``); batches: the epoch's order, padded or packed rows whose sequences never see each other
(``batches``); building a run (``setup``); one optimiser step (``step``); held-out loss, perplexity and gold
accuracy (``evaluate``); checkpoints and resume (``resume``); the run loop and ``SFTTrainer`` (``train``); the
command line (``cli``); rejection-sampling data, K samples per prompt kept when a rule or a reward model accepts
them (``sample``, ``tether sample``).

May import: ``tether.core``, the shared modules, ``tether.rm`` (a reward model accepts samples),
``tether.rollout`` (sampling: gold evaluation, ``tether sample``) and ``tether.diagnostics`` — never ``tether.ppo``
(the stage beside it) or ``tether.demo``.
"""
