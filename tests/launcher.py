"""``accelerate launch`` for the multi-process tests, as a user would run it, with N CPU processes (gloo).

Each launch rendezvouses on its own free port (a fixed one, accelerate's default 29500, is shared by every
launch on the machine: two overlapping launches, from parallel tests or another job, meet in one store).
Every process's stdout and stderr also go to its own file (torchrun's ``--log_dir``/``--tee``), so a failure
shows each process's whole stderr, not the last characters of the launcher's interleaved output. A launch
that outlives ``timeout`` is stopped with its processes (SIGTERM to the launcher, which stops its workers),
so no process is left behind to load the next test."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "accelerate"


def spawn_gloo(target, world_size: int = 2, timeout: float = 120) -> dict:
    """Run ``target(rank, world_size, port, queue)`` in ``world_size`` spawned processes that join a gloo group on a
    free port (no launcher); each puts ``(rank, result)`` on the queue. Returns ``{rank: result}``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, world_size, port, queue)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return results


def free_port() -> int:
    """A TCP port no socket holds now (the OS picks it for a bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchFailed(AssertionError):
    pass


def accelerate_launch(target: list[str], log_dir: Path | None = None, *, config: str | None = None,
                      processes: int = 2, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``accelerate launch ... TARGET`` (``-m tether ppo ...`` or a script and its arguments) from the repo
    root with ``processes`` CPU processes: ``config`` names a file in examples/accelerate (else plain DDP).
    Raises :class:`LaunchFailed` with every process's own stderr when the launch exits non-zero or times out.
    The processes' logs go under ``log_dir`` (default: a temporary directory, removed after a success)."""
    if log_dir is None:
        logs = Path(tempfile.mkdtemp(prefix="tether-launch-"))
        done = accelerate_launch(target, logs, config=config, processes=processes, timeout=timeout, env=env)
        shutil.rmtree(logs, ignore_errors=True)
        return done
    port = free_port()
    proc = start_launch(target, log_dir, config=config, processes=processes, port=port, env=env)
    return finish_launch(proc, port, log_dir, timeout)


def start_launch(target: list[str], log_dir: Path, *, config: str | None, processes: int, port: int,
                 env: dict | None = None, machine: tuple[int, int] | None = None) -> subprocess.Popen:
    """Start one ``accelerate launch`` (see :func:`accelerate_launch`); ``machine`` = (machine rank, machines):
    one machine of a multi-machine launch on localhost (``--num_machines M --machine_rank i``, the same port for
    all; ``processes`` is the total over the machines, as accelerate counts it)."""
    kind = ["--config_file", str(CONFIGS / config)] if config else \
        ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if machine is not None:
        kind += ["--num_machines", str(machine[1]), "--machine_rank", str(machine[0]),
                 "--main_process_ip", "127.0.0.1"]
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *kind, "--num_processes", str(processes),
           "--main_process_port", str(port), "--log_dir", str(log_dir), "--tee", "3", *target]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_launch(proc: subprocess.Popen, port: int, log_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a launch started by :func:`start_launch`; :class:`LaunchFailed` as :func:`accelerate_launch` says."""
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun's agent stops its workers, then exits
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise LaunchFailed(report(f"timed out after {timeout:.0f} s", port, log_dir, err)) from None
    if proc.returncode != 0:
        raise LaunchFailed(report(f"exited {proc.returncode}", port, log_dir, err))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def report(what: str, port: int, log_dir: Path, launcher_err: str) -> str:
    """The launcher's own lines (its summary names each failed process's exit code or signal), then each
    process's whole stderr from its file."""
    own = [line for line in launcher_err.splitlines() if not line.startswith("[default")]  # tee'd workers' lines
    summary = max((i for i, line in enumerate(own) if "ChildFailedError:" in line), default=None)
    if summary is not None:  # the launcher's own call stack down to the summary says nothing about the failure
        start = max((i for i in range(summary) if own[i].startswith("Traceback")), default=summary)
        own = own[:start] + own[summary:]
    parts = [f"accelerate launch {what} (port {port}); launcher's own stderr:", *own]
    for path in sorted(log_dir.glob("**/stderr.log"), key=lambda p: (p.parent.name, str(p))):
        parts.append(f"----- process {path.parent.name} stderr ({path}) -----")
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)
