"""What every benchmark's JSON lines say about where they ran: the machine, Python, and the
versions of what was measured (importable from each benchmark: they run from this folder)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(**versions: str | None) -> dict[str, Any]:
    """{"machine": {"arch", "nproc": the cores this process may use}, "python", "versions"}."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": {"arch": platform.machine(), "nproc": nproc},
            "python": platform.python_version(), "versions": versions}
