"""Where inputs are read: data files and Hub datasets as records, and what the records mean to each stage.

- ``records``: JSONL, JSON arrays, CSV, Parquet, ``datasets`` folders and ``hf:org/name`` datasets read as numbered
  records, and rows handed over from Python; every bad row named by file and line/row in one line;
- ``pairs``: preference pairs (prompt/chosen/rejected, HH transcripts, TRL's conversational form), their counts,
  the split by prompt, the length- and reply-balanced subsets;
- ``splits``: the held-out split by prompt and one epoch's shuffled batches, for pairs and SFT rows alike;
- ``prompt_rows``: prompt rows in prompt/GSM8K/SVAMP/HH/message shapes (PPO, SFT evaluation, ``tether sample``);
- ``conversations``: prompts as chat messages: TRL's conversational pairs, HH transcripts, text rendering.

SFT rows are read in :mod:`tether.sft.data` and step-labelled data in :mod:`tether.rm.steps`, on top of
``records``. This ``__init__`` imports nothing: ``import tether.inputs.records`` loads only what it needs
(``datasets`` and ``pyarrow`` when a file asks for them).

May import: the standard library, torch (lazily), ``tether.errors``, ``tether.hub`` and ``tether.rules`` (the shared
layer) — never a stage (``tether.rm``, ``tether.ppo``, ``tether.sft``, ``tether.demo``), ``tether.rollout`` or
``tether.diagnostics``.
"""
