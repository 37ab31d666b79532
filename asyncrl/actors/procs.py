"""Processes by pid, told apart from later ones that get the same pid; this process's
open-file limit."""

from __future__ import annotations

import contextlib
import os
import resource
import signal

PROCESS_ENV = "ASYNCRL_CONTROLLER_PROCESS"  # a local rank's: its controller, as "pid:birth"


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first), [] when none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return []


def _children() -> dict[int, list[int]]:
    """Every process's children, from one scan of /proc (none where /proc is missing)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if entry.isdigit() and len(fields := _stat(int(entry))) > 1:  # (gone meanwhile: [])
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def state(pid: int) -> str | None:
    """Its state letter in /proc (R, S, T stopped, Z zombie...), None when there is none."""
    fields = _stat(pid)
    return fields[0] if fields else None


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` now."""
    return _children().get(pid, [])


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def birth(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, /proc), None when there is none."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


def this_process() -> str:
    """This process as `runs` reads it."""
    return f"{os.getpid()}:{birth(os.getpid())}"


def runs(process: str) -> bool:
    """Whether the process `this_process()` named (in another process) still runs (a zombie,
    killed and not yet reaped, does not)."""
    pid, _, born = process.partition(":")
    fields = _stat(int(pid)) if pid.isdigit() else []
    return len(fields) > 19 and fields[19] == born and fields[0] not in ("Z", "X")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead), whichever process it is now."""
    if pid <= 0:  # (kill(0, 0) would ask about this process's group)
        return False
    fields = _stat(pid)
    if fields:
        return fields[0] not in ("Z", "X")
    try:  # no /proc entry to read: gone, or one this process may not read (hidepid)
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        return True


def raise_open_file_limit() -> None:
    """This process's open-file limit raised to its hard limit: the controller holds sockets
    and a log file per rank, a rank two descriptors a segment kept (1024 ran out at ~450)."""
    with contextlib.suppress(ValueError, OSError):  # (a container's odd limits: as they are)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
