"""The final policy of a PPO run, ``RUN_DIR/policy``, written atomically by the main process with the tokenizer:
a plain model (full fine-tune, or LoRA merged) or the adapter alone (``--export-lora adapter``), in
``--model-dtype`` — :func:`tether.export.write_policy`, shared with SFT."""

from __future__ import annotations

from pathlib import Path

from tether.checkpoint import atomic_dir, check_finite
from tether.export import merged_lora_copy, set_config_dtype  # noqa: F401 - this module's API before the move
from tether.export import write_policy
from tether.sharding import full_model_state


def export_policy(run, run_dir: Path, lora: str = "merged", dtype: str = "fp32") -> Path | None:
    """Write ``run``'s policy to ``run_dir/policy``; returns the path on the main process. Every process calls it:
    a sharded policy is gathered first (collective). ``lora``: ``merged`` or ``adapter`` (a LoRA policy);
    ``dtype``: the run's ``--model-dtype``."""
    model = run.models.unwrapped_policy
    state = full_model_state(model) if run.models.fsdp is not None else None
    if not run.processes.is_main:
        return None
    check_finite(model, f"{run_dir / 'policy'}", state)  # refused (one line) if a weight is NaN/Inf
    return atomic_dir(run_dir / "policy",
                      lambda tmp: write_policy(tmp, model, run.models.tokenizer, lora, dtype, state))
