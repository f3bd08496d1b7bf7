"""The POSIX shared memory of vLLM's CPU tensor-parallel engines, kept from outliving the run.

vLLM's CPU communicator gives each process of a tensor-parallel group a shared-memory segment named after the
group alone, ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}``; under the ``external_launcher`` executor the
identifier is empty, so every run on a machine uses the same names (``/dev/shm/-tp:0-[0-1]-cpushm_0``...). It
creates them exclusively and unlinks them only at interpreter teardown — which a launched tether process skips
(:func:`tether.ppo.processes.leave_without_teardown`) and a killed one never reaches. A name left behind makes the
next tensor-parallel run on the machine fail at start-up with ``create shm in SHMManager failed. errno: 17``.

So: once every process has joined its group's segments the names are unlinked (the mappings keep the memory for
as long as the processes live), and before an engine starts, segments of that naming which no live process maps
(left by a run killed while its engine started) are removed. And each run names its segments with a token of its
own (:func:`name_segments_after_run`, ``tether{token}-tp:0-[0-1]-cpushm_0``), so that two tensor-parallel runs
starting at the same moment on one machine do not both create (or sweep) the same names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# vLLM 0.32 _CPUSHMDistributed.make_group_name + the C++ SHMManager's "_{rank}" suffix
SEGMENT = re.compile(r".*-\[[0-9-]+\]-cpushm_[0-9]+")


def name_segments_after_run(token: str, shm_class=None) -> None:
    """Prefix vLLM's CPU shared-memory group names with ``tether{token}`` (the same token on every process of the
    run: the processes of a group must agree on its name, which vLLM checks). vLLM derives the prefix from its
    init method, ``env://`` under ``external_launcher`` (the same for every run), and sets it inside the engine's
    start-up, so the name maker itself is wrapped (vLLM 0.32 ``_CPUSHMDistributed.make_group_name``); calling
    this again replaces the token. ``shm_class``: that class (default: vLLM's)."""
    if shm_class is None:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed as shm_class
    vllm_name = getattr(shm_class, "_vllm_make_group_name", shm_class.make_group_name)
    shm_class._vllm_make_group_name = vllm_name
    # vLLM's prefix is "//" under env://, which shm_open drops: the name starts at "-tp:0-..."
    shm_class.make_group_name = staticmethod(lambda communicator: f"tether{token}{vllm_name(communicator).lstrip('/')}")


def unlink_joined_segments() -> list[str]:
    """Unlink this process's segment of every vLLM group that talks through shared memory; call once the engine is
    built (vLLM's start-up ends with a barrier after every process has mapped every segment of its group).
    Returns the names unlinked."""
    from vllm.distributed import parallel_state

    unlinked = []
    for ref in list(parallel_state._groups.values()):
        group = ref()
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        name = getattr(shm, "group_name", None)
        if not isinstance(name, str):
            continue
        segment = f"{name}_{group.rank_in_group}"
        try:
            (SHM_DIR / segment.lstrip("/")).unlink()
        except FileNotFoundError:
            continue
        unlinked.append(segment)
    return unlinked


def mapped_paths() -> set[str]:
    """Paths of files that a process readable to us maps (``/proc/*/maps``)."""
    paths = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        for line in text.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6:
                paths.add(fields[5].strip())
    return paths


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove vLLM CPU tensor-parallel segments (our user's) that no live process maps: left by a run killed while
    its engine started. Another run's engine holds its segments mapped from creation until it unlinks them, so
    they are kept. Returns the names removed."""
    if not shm_dir.is_dir():
        return []
    candidates = [p for p in shm_dir.iterdir() if SEGMENT.fullmatch(p.name) and _owned(p)]
    if not candidates:
        return []
    live = mapped_paths()
    removed = []
    for path in candidates:
        if str(path) in live:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
    return removed


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False
