"""What every benchmark's JSON lines say about where they ran: the machine (its GPU, where
one measured), Python, and the versions of what was measured (importable from each
benchmark: they run from this folder)."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(**versions: str | None) -> dict[str, Any]:
    """{"machine": {"arch", "nproc": the cores this process may use}, "python", "versions",
    "commit": the checkout's short git commit (None outside a git checkout), "date": now, in
    UTC}."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": {"arch": platform.machine(), "nproc": nproc},
            "python": platform.python_version(), "versions": versions, "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


@functools.cache
def commit() -> str | None:
    """`git rev-parse --short HEAD` of the checkout these benchmarks are in, or None where
    git is missing, fails or this is no checkout (a local edit does not show in it)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe_gpu() -> dict[str, Any] | None:
    """{"name", "cuda", "driver"} of this process's first GPU, or None without one. Imports
    torch and starts CUDA: ask it where the measuring does both anyway (a rank, not a driver
    that would hold a CUDA context of its own beside the ranks)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
            "driver": _driver()}


def _driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi says it (the same for every GPU of a
    machine); None where nvidia-smi is missing, fails or hangs."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next(iter(out.split()), None)
