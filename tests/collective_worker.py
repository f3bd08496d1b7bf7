"""The process group tether's make_processes opens, seen from inside two processes.

``accelerate launch --num_processes 2 collective_worker.py OUT_DIR MODE [MINUTES]`` writes ``OUT_DIR/rank_R.json``:

- ``timeout``: the run's ``collective_timeout_minutes`` is MINUTES; process 0 stays out of the next collective
  for 20x that long, process 1 waits in it and records how long it waited and what it raised;
- ``close``: one collective, then :meth:`Processes.close`; records whether the process is still in a group.
Used by tests/test_collectives.py."""

import json
import sys
import time
from pathlib import Path

import torch

from tether.ppo.config import RunConfig
from tether.ppo.processes import make_processes


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    cfg = RunConfig()
    cfg.output_dir = str(out / "run")
    if mode == "timeout":
        cfg.collective_timeout_minutes = float(sys.argv[3])
    processes = make_processes(cfg)
    record = {"world_size": processes.world_size}
    if mode == "timeout":
        limit = cfg.collective_timeout_minutes * 60
        if processes.rank == 0:
            time.sleep(8 * limit)  # the others' wait, far past the limit: they must give up
        else:
            start = time.monotonic()
            try:
                torch.distributed.barrier()
                record["raised"] = None
            except Exception as error:  # noqa: BLE001 - what gloo raises at its timeout is the observation
                record["raised"] = f"{type(error).__name__}: {error}"
            record["waited_s"] = time.monotonic() - start
    else:
        processes.global_sum(1.0)
        processes.close()
        record["in_group_after_close"] = torch.distributed.is_initialized()
    (out / f"rank_{processes.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    from tether.ppo.processes import leave_without_teardown

    leave_without_teardown(0)  # gloo's threads outlive the group under DDP/FSDP2: no interpreter teardown (#32)
