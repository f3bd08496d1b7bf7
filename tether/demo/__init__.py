"""The built-in demo (SPEC E): a synthetic task with a gold rule, a tiny policy, SFT, and preference pairs.

``task`` defines addition (2 digits in the demo, answers units first, fixed width), its gold rule, the character tokenizer and the GPT-2 policy;
``sft`` fine-tunes the policy, generates answers and measures gold accuracy; ``pairs`` samples the SFT
policy and labels its answers with the gold rule to make the reward model's preference pairs;
``pipeline`` runs the whole story (``tether demo``), ``side_by_side`` its two PPO runs at once; ``steps`` is the step task (running sums, every
step checkable by a rule) for process reward models (A9, ``bench/prm_best_of_n.py``).

May import: every room below it (``tether.core``, the shared modules, ``tether.rm``, ``tether.rollout``,
``tether.ppo``, ``tether.diagnostics``): the demo is a user of the library, the top stage.
"""
