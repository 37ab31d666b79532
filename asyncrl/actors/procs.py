"""Processes by pid, told apart from later ones that get the same pid."""

from __future__ import annotations

PROCESS_ENV = "ASYNCRL_CONTROLLER_PROCESS"  # a local rank's: its controller, as "pid:birth"


def birth(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, /proc), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> str:
    """This process as `runs` reads it."""
    import os

    return f"{os.getpid()}:{birth(os.getpid())}"


def runs(process: str) -> bool:
    """Whether the process `this_process()` named (in another process) still runs (a zombie,
    killed and not yet reaped, does not)."""
    pid, _, born = process.partition(":")
    if not pid.isdigit() or born == "None" or birth(int(pid)) != born:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
