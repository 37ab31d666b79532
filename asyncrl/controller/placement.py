"""Placement on the local host: which GPUs, or which CPU cores, each group's ranks get.

Constraints: `colocate_with(g)` (share g's devices: the hybrid engine), `separate_from(g)`
(disjoint devices), `same_host_as(g)` (always true on one host), `nvlink_group(n)` (all ranks
within one NVLink domain of n GPUs). Groups are placed one at a time, in spawn order, each on
the devices used least so far; a constraint that cannot be met is an error saying why — except
on a CPU-only host, where groups share cores with a warning when there are too few.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("asyncrl")


class PlacementError(ValueError):
    """A placement constraint cannot be met on this host; the message says which and why."""


@dataclass(frozen=True)
class Constraint:
    kind: str
    target: str | None = None
    n: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}({self.target if self.target is not None else self.n})"


def _name(g: Any) -> str:
    name = getattr(g, "name", g)
    if not isinstance(name, str):
        raise TypeError(f"a placement constraint names a group (or its name), got {g!r}")
    return name


def colocate_with(group: Any) -> Constraint:
    return Constraint("colocate_with", _name(group))


def separate_from(group: Any) -> Constraint:
    return Constraint("separate_from", _name(group))


def same_host_as(group: Any) -> Constraint:
    return Constraint("same_host_as", _name(group))


def nvlink_group(n: int) -> Constraint:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"nvlink_group(n) needs n >= 1, got {n!r}")
    return Constraint("nvlink_group", None, n)


@dataclass(frozen=True)
class Host:
    gpus: int
    cores: tuple[int, ...]

    @staticmethod
    def detect() -> Host:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU here
            gpus = 0
        return Host(gpus, tuple(cores))

    @property
    def kind(self) -> str:
        return "GPU" if self.gpus else "CPU core"


@dataclass
class Placement:
    devices: list[int]  # GPU ids, or CPU cores; rank i uses devices[i % len(devices)]
    env: dict[str, str] = field(default_factory=dict)


class Placer:
    def __init__(self, host: Host | None = None):
        self.host = host or Host.detect()
        self.placed: dict[str, list[int]] = {}
        self._use: Counter[int] = Counter()

    def place(self, group: str, nprocs: int, place: Any) -> Placement:
        constraints = _constraints(place)
        host = self.host
        pool = list(range(host.gpus)) if host.gpus else list(host.cores)
        for c in constraints:
            if c.target is not None and c.target not in self.placed:
                raise PlacementError(
                    f"group {group!r}: {c!r} names a group that is not placed yet; spawn "
                    f"{c.target!r} first (groups are placed in spawn order)")
        colocate = [c for c in constraints if c.kind == "colocate_with"]
        for c in constraints:
            if c.kind == "nvlink_group" and (not host.gpus or nprocs > min(c.n, host.gpus)):
                raise PlacementError(
                    f"group {group!r}: nvlink_group({c.n}) needs its {nprocs} ranks on GPUs of "
                    f"one NVLink domain of {c.n}, but this host has {host.gpus} GPU(s)")
        if colocate:
            devices = list(self.placed[colocate[0].target])  # type: ignore[index]
        else:
            apart = {d for c in constraints if c.kind == "separate_from"
                     for d in self.placed[c.target]}  # type: ignore[index]
            free = [d for d in pool if d not in apart]
            if len(free) < nprocs:
                why = (f"group {group!r} needs {nprocs} {host.kind}(s) "
                       f"{' and '.join(repr(c) for c in constraints) or ''}".rstrip() +
                       f", but this host has {len(pool)} and {len(free)} are free of the "
                       f"groups it must stay apart from")
                if host.gpus:
                    raise PlacementError(why)
                log.warning("asyncrl placement: %s; ranks will share cores", why)
                free = free or pool
            free.sort(key=lambda d: (self._use[d], d))  # the least used first
            devices = free[:nprocs]
        if not host.gpus and len(devices) < nprocs:
            log.warning("asyncrl placement: group %r runs %d ranks on %d core(s)", group,
                        nprocs, len(devices))
        self.placed[group] = devices
        self._use.update(devices[i % len(devices)] for i in range(nprocs))
        key = "CUDA_VISIBLE_DEVICES" if host.gpus else "ASYNCRL_CPUS"
        return Placement(devices, {key: ",".join(map(str, devices))})

    def forget(self, group: str) -> None:
        devices = self.placed.pop(group, [])
        self._use.subtract(devices)


def _constraints(place: Any) -> list[Constraint]:
    if place is None:
        return []
    items: Iterable[Any] = place if isinstance(place, list | tuple) else [place]
    out = []
    for c in items:
        if not isinstance(c, Constraint):
            raise TypeError(f"place= takes constraints such as asyncrl.separate_from(g), or a "
                            f"list of them; got {c!r}")
        out.append(c)
    return out
