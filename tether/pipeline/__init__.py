"""``tether rlhf``: the classic pipeline on a real model in one command (:class:`~tether.pipeline.run.RLHFPipeline`).

``config`` the pipeline's settings; ``stages`` each stage as a call of the command that does it (sample, train-rm,
ppo, sft); ``probe`` what a reward model learned; ``dpo_arm`` the DPO arm; ``estimate`` the expected time;
``results`` the paired held-out evaluations, the doctor, ``report.md`` and ``results.json``; ``run`` the stages in
order, each skipped when complete; ``cli`` the flags.

May import: every room below it (``tether.core``, the shared modules, ``tether.rm``, ``tether.rollout``,
``tether.ppo``, ``tether.sft``, ``tether.diagnostics``) and ``tether.demo`` (its side-by-side runner) and
``tether.dpo``: the pipeline is a user of the library, the top stage.
"""
