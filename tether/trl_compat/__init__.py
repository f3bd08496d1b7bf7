"""Coming from TRL: its config key names (:mod:`~tether.trl_compat.keys`, the one table) and its trainer arguments
(:mod:`~tether.trl_compat.arguments`) in tether's terms. docs/coming-from-trl.md is the table for readers.

``keys`` imports nothing of tether but its errors (the configs use it); ``arguments`` builds the stage configs (the
trainers use it). Nothing is imported here, so ``tether.config`` can import ``keys`` without loading a stage.
"""
