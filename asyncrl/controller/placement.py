"""Placement on the local host: which GPUs, or which CPU cores, each group's ranks get.

Constraints: `colocate_with(g)` (share g's devices: the hybrid engine), `separate_from(g)`
(disjoint devices), `same_host_as(g)` (always true on one host), `nvlink_group(n)` (all ranks
within one NVLink domain of n GPUs), `share_gpus(k)` (up to k of the group's ranks per GPU).
Groups are placed one at a time, in spawn order, each on the devices used least so far; a
constraint that cannot be met is an error saying why — except on a CPU-only host, where
groups share cores with a warning when there are too few.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import AsyncRLError

log = logging.getLogger("asyncrl")


class PlacementError(AsyncRLError, ValueError):
    """A placement constraint cannot be met on this host; the message says which, why, and
    what to change."""


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


def check_nice(group: str, nice: Any) -> int:
    """A group's `nice`: how much lower its ranks' CPU priority is (0-19, as nice(1) counts).
    On shared cores the other groups' work goes first: e.g. the reference and the reward
    beside a rollout, which the trainer waits for. Raising a priority needs privileges."""
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise ValueError(f"group {group!r}: nice must be an int from 0 (the default) to 19 (the "
                         f"lowest CPU priority), got {nice!r}")
    return nice


def colocate_with(group: Any) -> Constraint:
    return Constraint("colocate_with", _name(group))


def separate_from(group: Any) -> Constraint:
    return Constraint("separate_from", _name(group))


def same_host_as(group: Any) -> Constraint:
    return Constraint("same_host_as", _name(group))


def nvlink_group(n: int) -> Constraint:
    """All of the group's GPUs within one NVLink domain of `n` GPUs. Domains are taken to be
    aligned blocks of `n` GPU ids (GPU d is in domain d // n: 0..n-1, n..2n-1, ...), or the
    whole host where it has n GPUs or fewer; ids as the controller counts its GPUs (the d-th
    of its CUDA_VISIBLE_DEVICES, where that is set)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"nvlink_group(n) needs n >= 1, got {n!r}")
    return Constraint("nvlink_group", None, n)


def share_gpus(ranks_per_gpu: int) -> Constraint:
    """Up to `ranks_per_gpu` of the group's ranks on each GPU (rank i on GPU i % n). For
    groups that only move data (CUDA IPC, host staging) or run a rank's own GPU work: NCCL
    refuses two ranks of one communicator on one GPU, so no NCCL collective inside the
    group. Ignored on a CPU-only host."""
    if not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1:
        raise ValueError(f"share_gpus(ranks_per_gpu) needs an int >= 1, got {ranks_per_gpu!r}")
    return Constraint("share_gpus", None, ranks_per_gpu)


@dataclass(frozen=True)
class Host:
    gpus: int
    cores: tuple[int, ...]
    # what CUDA_VISIBLE_DEVICES named for the controller (SLURM's "4,5,6,7", UUIDs):
    # GPU d of this host is gpu_ids[d]; none given, GPU d is d
    gpu_ids: tuple[str, ...] = ()

    @staticmethod
    def detect() -> Host:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU here
            gpus = 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = tuple(v.strip() for v in visible.split(","))[:gpus] if visible else ()
        return Host(gpus, tuple(cores), ids)

    def gpu_id(self, d: int) -> str:
        """GPU d as the ranks' CUDA_VISIBLE_DEVICES names it (the controller's own list
        applies to them too: its d-th entry)."""
        return self.gpu_ids[d] if d < len(self.gpu_ids) else str(d)

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
        self._added: dict[str, list[int]] = {}  # what each group added to _use, one per rank
        # where a forgotten group was: placed again while groups placed with respect to it
        # remain (a respawn), it goes back there when that still meets every constraint
        # (those colocated with it take it to their devices in any case)
        self._was: dict[str, list[int]] = {}
        self._asked: dict[str, list[Constraint]] = {}  # each placed group's constraints

    def place(self, group: str, nprocs: int, place: Any, warn: bool = True) -> Placement:
        constraints = constraints_of(place)
        host = self.host
        pool = list(range(host.gpus)) if host.gpus else list(host.cores)
        per = max((c.n for c in constraints if c.kind == "share_gpus"), default=1) \
            if host.gpus else 1
        needed = -(-nprocs // per)  # devices it needs: one per rank, or per `per` ranks
        nvlink = [c.n for c in constraints if c.kind == "nvlink_group"]
        each = "one per rank" if per == 1 else f"one per {per} ranks (share_gpus({per}))"
        share = "" if per > 1 or not host.gpus else \
            ", or place=asyncrl.share_gpus(k) for k ranks per GPU (no NCCL inside the group)"
        for c in constraints:
            if c.target is not None and c.target not in self.placed:
                raise PlacementError(
                    f"group {group!r}: {c!r} names a group that is not placed yet; spawn "
                    f"{c.target!r} first (groups are placed in spawn order)")
            if c.kind == "nvlink_group" and (not host.gpus or needed > min(c.n, host.gpus)):
                fix = "drop nvlink_group on a host without GPUs" if not host.gpus else \
                    f"use nprocs <= {min(c.n, host.gpus) * per}" + (
                        f", or nvlink_group({needed}) if this host's NVLink domains are of "
                        f"{needed} GPUs or more (n is the hardware's)"
                        if c.n < needed <= host.gpus else "")
                raise PlacementError(
                    f"group {group!r}: nvlink_group({c.n}) needs its {nprocs} ranks on GPUs of "
                    f"one NVLink domain of {c.n}, but this host has {host.gpus} GPU(s); {fix}")
        on = {c.target: self.placed[c.target] for c in constraints if c.target is not None}
        colocate = [t for c in constraints if c.kind == "colocate_with" and (t := c.target)]
        apart = [t for c in constraints if c.kind == "separate_from" and (t := c.target)]
        contradiction = sorted(set(colocate) & set(apart))
        if contradiction:
            g = contradiction[0]
            raise PlacementError(
                f"group {group!r} is placed both colocate_with({g}) and separate_from({g}); "
                f"keep one of the two constraints")
        # placed again (closed, or respawned): what the placed groups ask of it holds too
        kept_with, kept_apart = self._held(group)
        spare = [f"separate_from({t})" for t in apart] + \
            [f"apart from {g!r} (placed separate_from({group}))" for g in kept_apart]
        anchor = f"colocate_with({colocate[0]})" if colocate else \
            f"{kept_with[0]!r} (placed colocate_with({group}))" if kept_with else ""
        again = f"; or close {kept_with + kept_apart} before placing {group!r} again" \
            if kept_with or kept_apart else ""
        problem = ""  # a constraint this host cannot meet, and how to change the request
        if anchor:
            devices = list(on[colocate[0]] if colocate else self.placed[kept_with[0]])
            used = set(devices[:nprocs])  # what its ranks use: rank i on devices[i % n]
            clash = [f"colocate_with({t}) (on {on[t]})" for t in colocate
                     if set(on[t]) != set(devices)] + \
                    [f"{g!r} (placed colocate_with({group}), on {self.placed[g]})"
                     for g in kept_with if set(self.placed[g]) != set(devices)] + \
                    [f"separate_from({t}) (on {on[t]})" for t in apart
                     if self._uses(t) & used] + \
                    [f"{g!r} (placed separate_from({group}), on {self.placed[g]})"
                     for g in kept_apart if self._uses(g) & used]
            if clash:
                problem = (f"group {group!r}: {anchor} puts it on {host.kind}s {devices}, "
                           f"which conflicts with {'; '.join(clash)}; drop one of the "
                           f"constraints, or place those groups so they agree{again}")
            elif host.gpus and len(devices) * per < nprocs:  # NCCL refuses two ranks a GPU
                k = -(-nprocs // len(devices))
                problem = (f"group {group!r}: {anchor} puts its {nprocs} ranks on the "
                           f"{len(devices)} GPU(s) {devices}, {k} ranks per GPU; give it "
                           f"nprocs <= {len(devices) * per}, or place it with "
                           f"asyncrl.share_gpus({k}) as well (no NCCL inside the group){again}")
            elif len({_domain(d, nvlink) for d in used}) > 1:
                problem = (f"group {group!r}: {anchor} puts it on GPUs {devices}, which are "
                           f"not within one NVLink domain of "
                           f"{' and '.join(f'nvlink_group({n})' for n in nvlink)}; drop "
                           f"nvlink_group, or place {(colocate or kept_with)[0]!r} with it"
                           f"{again}")
        else:
            away = {d for t in [*apart, *kept_apart] for d in self._uses(t)}
            free = [d for d in pool if d not in away]
            was = self._was.get(group, []) if any(
                c.target == group for cs in self._asked.values() for c in cs) else []
            if len(free) < needed and spare:
                problem = (f"group {group!r} needs {needed} {host.kind}(s) "
                           f"{' and '.join(spare)}, but only "
                           f"{len(free)} of this host's {len(pool)} are free of those groups; "
                           f"use nprocs <= {len(free) * per}, give those groups fewer ranks, or "
                           f"drop separate_from{share}{again}")
            elif len(free) < needed:
                problem = (f"group {group!r} needs {needed} {host.kind}(s), {each}, but this "
                           f"host has {len(pool)}; use nprocs <= {len(pool) * per}, or spread "
                           f"the group over several hosts with --hosts{share}")
            free = sorted(free or pool, key=lambda d: (self._use[d], d))  # least used first
            domains: dict[tuple[int, ...], list[int]] = {}  # one, without nvlink_group
            for d in free:
                domains.setdefault(_domain(d, nvlink), []).append(d)
            fits = [ds[:needed] for ds in domains.values() if len(ds) >= needed]
            if len(was) == needed and set(was) <= set(free) and \
                    len({_domain(d, nvlink) for d in was}) == 1:
                fits = [was]  # where it was, which still meets its constraints
            devices = min(fits, key=lambda ds: (sum(self._use[d] for d in ds), min(ds))) \
                if fits else free[:needed]
            if not fits and not problem:  # enough GPUs, but not within one domain
                n = min(nvlink)
                spared = " free of " + " and ".join(spare) if spare else ""
                problem = (f"group {group!r}: nvlink_group({n}) needs its {needed} GPU(s) "
                           f"within one NVLink domain (aligned blocks: GPUs 0-{n - 1}, "
                           f"{n}-{2 * n - 1}, ...), but no domain has {needed} GPU(s){spared} "
                           f"(the free ones: {sorted(free)}); give those groups fewer ranks or "
                           f"place them within one domain, or drop nvlink_group{again}")
        if problem and host.gpus:
            raise PlacementError(problem)
        if not host.gpus and len(devices) < nprocs and not problem:  # colocated on fewer
            problem = f"group {group!r} runs {nprocs} ranks on the {len(devices)} core(s) of " \
                f"{anchor}"
        if problem and warn:  # a CPU-only host runs it anyway, and says so
            log.warning("asyncrl placement: %s; on this CPU-only host it runs anyway: ranks "
                        "will share cores", problem)
        self.placed[group] = devices
        self._asked[group] = constraints
        self._was.pop(group, None)
        self._added[group] = [devices[i % len(devices)] for i in range(nprocs)]
        self._use.update(self._added[group])
        if host.gpus:
            return Placement(devices, {"CUDA_VISIBLE_DEVICES": ",".join(
                host.gpu_id(d) for d in devices)})
        return Placement(devices, {"ASYNCRL_CPUS": ",".join(map(str, devices))})

    def _uses(self, group: str) -> set[int]:
        """The devices `group`'s ranks run on (a colocated group of fewer ranks than its
        target's devices uses the first of them): what being kept apart from it means."""
        return set(self._added[group])

    def _held(self, group: str) -> tuple[list[str], list[str]]:
        """The placed groups that asked to be colocated with `group`, and those that asked
        to be kept apart from it."""
        others = [(g, cs) for g, cs in self._asked.items() if g != group]
        return [g for g, cs in others if colocate_with(group) in cs], \
            [g for g, cs in others if separate_from(group) in cs]

    def forget(self, group: str) -> None:
        if group in self.placed:
            self._was[group] = self.placed.pop(group)
        self._asked.pop(group, None)
        self._use.subtract(self._added.pop(group, []))


def _domain(device: int, nvlink: list[int]) -> tuple[int, ...]:
    """The NVLink domain of a GPU under each nvlink_group(n) asked for (aligned blocks)."""
    return tuple(device // n for n in nvlink)


def constraints_of(place: Any) -> list[Constraint]:
    """A `place=` argument (None, one constraint, or a list of them) as a list, checked."""
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
