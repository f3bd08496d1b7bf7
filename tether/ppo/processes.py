"""The PPO run's processes: the shared :mod:`tether.processes` (accelerator, rank, reductions, the collective
timeout) plus PPO's rollout layout — in the disaggregated layout the run's process group is the trainers' and a
:class:`~tether.rollout.layout.Link` joins them to the rollout processes. ``Processes`` and
``leave_without_teardown`` are importable from here as before.
"""

from __future__ import annotations

from tether.processes import (  # noqa: F401 - this module's API since before the move to tether.processes
    Processes,
    ignored_mixed_precision_note,
    leave_without_teardown,
    open_processes,
)
from tether.rollout.layout import Link, launch_layout, trainers_world


def make_processes(cfg) -> Processes:
    """The processes of PPO run ``cfg`` (:func:`tether.processes.open_processes`, trackers from ``--log-with``);
    with ``--rollout-processes`` the trainers' group first and the link to the rollout processes after."""
    from tether.runlog import check_trackers, tracker_names

    trackers = tracker_names(cfg)
    check_trackers(trackers)
    layout = launch_layout(cfg)
    trainers_world(layout)  # disaggregated: the run's process group is the trainers' (the last ranks only generate)
    processes = open_processes(cfg.output_dir, trackers, cfg.model.dtype, cfg.collective_timeout_minutes)
    processes.link = Link(layout, cfg.collective_timeout_minutes) if layout.rollouts else None
    return processes
