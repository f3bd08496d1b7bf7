"""Rollout, the sampling layer (SPEC C3, B1): what turns prompts into responses, for PPO's steps, evaluation, the
demo, Best-of-N and SFT data alike. The record every engine returns (``records``: :class:`Rollout`); prompt encoding
and sampling with ``transformers`` generate (``sampling``); the engines behind one seam (``engines``:
``transformers``, vLLM in ``vllm_engine`` with its shared-memory hygiene in ``vllm_shm``, and the trainers' side of
the rollout processes); the policy's weights block by block for an engine that holds its own copy (``weights``);
which launched process trains or only generates (``layout``); the disaggregated wire (``remote``) and a rollout
process's loop (``server``).

May import: ``tether.core``, the shared modules and ``tether.diagnostics`` (the engine's memory plan) — never
``tether.ppo`` (the algorithm is a user of this layer), ``tether.rm`` or ``tether.demo``.
"""
