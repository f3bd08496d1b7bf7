"""What a PPO run writes as it goes: :mod:`tether.runlog` (shared with SFT), importable from here as before."""

from tether.runlog import (  # noqa: F401 - this module's API since before the move to tether.runlog
    RunLog,
    check_trackers,
    read_jsonl_rows,
    tracker_names,
    truncate_jsonl,
    write_jsonl,
    write_text_atomic,
)
