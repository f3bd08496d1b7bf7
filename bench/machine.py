"""What machine a bench ran on, for the line each bench prints beside its figures (figures are only as quiet and
as fast as the machine was)."""

from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo; "unknown CPU" where there is none (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
