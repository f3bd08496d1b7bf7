"""Layer 0, the math: pure functions on tensors (advantages, KL estimators and controllers, losses,
statistics, length control, process-reward steps), each with its equation in the docstring.

May import: torch, the standard library and ``tether.core`` itself — nothing else (a test checks it), so
``import tether`` stays light and every formula can be tested without a model.
"""
