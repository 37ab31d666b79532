"""Beyond one machine: a cluster description, and the torchrun command of each host of a group.

    --hosts FILE (JSON)   {"hosts": [{"name": "node1", "address": "10.0.0.1", "gpus": 8,
                                      "cpus": 64, "via": "ssh"}, ...]}
    inside SLURM          SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE / SLURM_CPUS_ON_NODE: hosts
                          reached with srun
    "via": "local" runs the agent on this machine (several "hosts" on loopback: tests, and a
    laptop that imitates a cluster); "netns" in the network namespace named like the host
    (separate network stacks on one machine: `ip netns exec NAME ...`, as root); of GPU
    hosts, at most one is this machine (each hands out GPUs 0..n-1)
    addresses are IPv4 addresses or names (IPv6 is not supported yet)

A group spread over k hosts runs one torchrun agent per host, `--nnodes k --node-rank i
--nproc-per-node n`, meeting at the first host's `--rdzv-endpoint`; its ranks connect back to
the controller's address, which is then not loopback.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.actors.rank_fork import RANK_ENV_DEFAULTS
from asyncrl.comm.dataserver import addresses, is_loopback
from asyncrl.controller.placement import Host, PlacementError, constraints_of

VIAS = ("local", "ssh", "srun", "netns")
HERE = ("local", "netns")  # the vias that run on the controller's own machine
# rendezvous ports off this machine: a generator of its own (the flow's seeded `random` would
# give every run of a sweep the same port, and shift the state checkpoints keep), below the
# ephemeral ports, which connections take
_PORTS = random.SystemRandom()


@dataclass(frozen=True)
class HostSpec:
    name: str  # how ranks and the data plane tell hosts apart
    address: str  # where the others reach it: rendezvous, data plane
    gpus: int = 0
    cpus: int = 1
    via: str = "local"

    @property
    def slots(self) -> int:
        return self.gpus or self.cpus


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list: "node[01-03,07],gpu5" -> node01 node02 node03 node07
    gpu5; text after a range and several ranges in a name too ("rack[1-2]-n[1-2]-ib", as
    `scontrol show hostnames` expands them: the last range fastest)."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            parts = [text + n for n in _expand_ranges(ranges)] if ranges else [text]
            names = [name + part for name in names for part in parts]
        hosts.extend(names)
    return hosts


def _expand_ranges(ranges: str) -> list[str]:
    """"01-03,07" -> 01 02 03 07 (the width of the first bound kept)."""
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out.extend([lo] if not hi else [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)])
    return out


class Cluster:
    def __init__(self, hosts: list[HostSpec]):
        if not hosts:
            raise ValueError("a cluster needs at least one host")
        names = [h.name for h in hosts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"hosts named twice: {dup}; every host needs its own name")
        for h in hosts:
            if h.via not in VIAS:
                raise ValueError(f"host {h.name!r}: via is one of {VIAS}, got {h.via!r}")
            for key in ("gpus", "cpus"):
                n = getattr(h, key)
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"host {h.name!r}: \"{key}\" is a whole number >= 0, "
                                     f"got {n!r}")
            if h.slots < 1:
                raise ValueError(f"host {h.name!r} has no GPU and no CPU to run ranks on")
            if _is_ipv6(h.address):  # data servers bind tcp://ADDRESS: no zmq.IPV6, no [ ]
                raise ValueError(f"host {h.name!r}: address {h.address!r}: IPv6 addresses "
                                 f"are not supported yet; give the host's IPv4 address or a "
                                 f"name that resolves to one")
        if any(h.gpus for h in hosts) and not all(h.gpus for h in hosts):
            # a group would land on either kind (or be split over both: NCCL beside gloo)
            raise ValueError(f"hosts {[h.name for h in hosts if h.gpus]} have GPUs and "
                             f"{[h.name for h in hosts if not h.gpus]} none: a cluster of "
                             f"both kinds is not supported (a group cannot say which it "
                             f"needs); list one kind")
        _refuse_shared_gpus([h for h in hosts if h.gpus])
        self.hosts = hosts
        self._taken: dict[str, set[int]] = {h.name: set() for h in hosts}  # slots in use
        self._groups: dict[str, dict[str, list[int]]] = {}  # group -> host -> its slots
        self._deaths: dict[str, int] = {}  # host -> ranks that died there (see `suspect`)
        self._ports: dict[str, tuple[str, int]] = {}  # group -> its rendezvous address, port

    @staticmethod
    def from_file(path: str | os.PathLike) -> Cluster:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"hosts file {p}: {e}; expected JSON like {{\"hosts\": [{{\"name\": "
                             f"\"node1\", \"address\": \"10.0.0.1\", \"gpus\": 8}}]}}") from None
        entries = data.get("hosts") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"hosts file {p}: no \"hosts\" list")
        hosts = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or "name" not in entry:
                raise ValueError(f"hosts file {p}: host {i} needs at least a \"name\"")
            unknown = sorted(set(entry) - {"name", "address", "gpus", "cpus", "via"})
            if unknown:
                raise ValueError(f"hosts file {p}: host {entry['name']!r} has unknown keys "
                                 f"{unknown}")
            name = str(entry["name"])
            hosts.append(HostSpec(name, str(entry.get("address", name)), entry.get("gpus", 0),
                                  entry.get("cpus", 1), str(entry.get("via", "ssh"))))
        try:  # (its checks, named with the file)
            cluster = Cluster(hosts)
            _check_gpus_here(cluster.hosts)
            return cluster
        except ValueError as e:
            raise ValueError(f"hosts file {p}: {e}") from None

    @staticmethod
    def from_slurm(env: Mapping[str, str] = os.environ,
                   here: str | None = None) -> Cluster | None:
        """The allocation this process runs in; None outside SLURM, and in an allocation of
        this one node, placed as one host (GPUs shared by colocated groups, as without
        SLURM). `here`: this machine's name (by default its host name)."""
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            return None
        nodes = expand_nodelist(nodelist)
        # SLURM's name for this node, in a batch script or a step (not in salloc's shell on
        # a login node); else the host name, which may differ from SLURM's
        here = (here or env.get("SLURMD_NODENAME") or socket.gethostname()).split(".")[0]
        if len(nodes) == 1 and nodes[0].split(".")[0] == here:
            return None  # (salloc's shell on a login node: the node is another machine)
        # per node as SLURM lists them ("64(x2),32"): SLURM_CPUS_ON_NODE is this node's only
        cpus = _per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""), len(nodes)) or \
            [_leading_int(env.get("SLURM_CPUS_ON_NODE", "1")) or 1] * len(nodes)
        per_node = env.get("SLURM_GPUS_PER_NODE")  # "8", "a100:8": asked for every node
        gpus = _gpu_count(per_node) if per_node and re.search(r"\d", per_node) \
            else _leading_int(env.get("SLURM_GPUS_ON_NODE", "0"))
        total = _gpu_count(env.get("SLURM_GPUS", ""))  # --gpus=[TYPE:]N: over the job's nodes
        if per_node is None and total and total != gpus * len(nodes):
            raise ValueError(
                f"SLURM allocation of {total} GPUs over {len(nodes)} nodes ({nodelist}), "
                f"{gpus} on this one: their split is not known here; ask for them per node "
                f"(--gpus-per-node), or list the hosts with --hosts")
        return Cluster([HostSpec(h, h, gpus, c, "srun") for h, c in zip(nodes, cpus,
                                                                          strict=True)])

    def spread(self, group: str, nprocs: int) -> list[tuple[HostSpec, list[int]]]:
        """The fewest hosts that hold `nprocs` ranks evenly (torchrun runs the same number of
        ranks on each), the least used first, with the free slots (GPUs or cores) each gets.
        A slot serves one group at a time: groups on a cluster never share slots. Hosts a
        rank died on come last: a respawned group lands elsewhere when it fits there."""
        def free(h: HostSpec) -> list[int]:
            return [s for s in range(h.slots) if s not in self._taken[h.name]]

        order = sorted(self.hosts, key=lambda h: (self._deaths.get(h.name, 0),
                                                  len(self._taken[h.name]),
                                                  self.hosts.index(h)))
        for k in range(1, len(order) + 1):
            if nprocs % k:
                continue
            per = nprocs // k
            fit = [h for h in order if len(free(h)) >= per]
            if len(fit) >= k:
                chosen = [(h, free(h)[:per]) for h in fit[:k]]
                for h, slots in chosen:
                    self._taken[h.name].update(slots)
                self._groups[group] = {h.name: slots for h, slots in chosen}
                return chosen
        left = [(h.name, len(free(h))) for h in self.hosts]
        raise PlacementError(f"group {group!r}: {nprocs} ranks do not fit evenly on the free "
                             f"slots (GPUs, else cores) of the hosts {left}; add hosts or slots "
                             f"(to the hosts file, or the SLURM allocation), or give the "
                             f"group a size they can hold")

    def check_place(self, group: str, place: Any) -> None:
        """Refuse the constraints a cluster cannot honour yet. separate_from holds by itself
        (groups never share a cluster's slots); the others would need slots shared or picked
        by host, which spreading does not do."""
        for c in constraints_of(place):
            if c.kind == "separate_from":
                if c.target not in self._groups:
                    raise PlacementError(
                        f"group {group!r}: {c!r} names a group that is not placed yet; spawn "
                        f"{c.target!r} first (groups are placed in spawn order)")
                continue
            raise PlacementError(
                f"group {group!r}: place={c!r} is not supported on a cluster (--hosts or "
                f"SLURM) yet: there every group gets slots of its own, spread over the "
                f"fewest hosts; drop {c.kind}, or run on one host (no --hosts; under "
                f"SLURM: an allocation of one node, the controller on it)")

    def suspect(self, *hosts: str) -> None:
        """A rank died on each of `hosts` (its process gone, silent, or crashed), or none
        started there (its agent failed, or hung at the rendezvous): groups placed from now on
        go to other hosts first (a dead node, a failing GPU would take the respawn too). A
        preference, not a ban: a host is used again when the others lack the slots."""
        for host in hosts:
            if host in self._taken:
                self._deaths[host] = self._deaths.get(host, 0) + 1

    def rendezvous_port(self, group: str, host: HostSpec) -> int:
        """A port for `group`'s rendezvous on its first host, `host`: one probed free here
        (local), else drawn at random; never one a placed group's rendezvous holds at its
        address (hosts that share one, as "hosts" on loopback do, share its ports)."""
        held = {port for address, port in self._ports.values() if address == host.address}
        while True:
            port = free_port() if host.via == "local" else _PORTS.randint(20000, 32000)
            if port not in held:
                self._ports[group] = (host.address, port)
                return port

    def here(self) -> set[str]:
        """The names of the hosts that are this machine (via local or netns): their ranks'
        shared memory is this machine's."""
        return {h.name for h in self.hosts if h.via in HERE}

    def forget(self, group: str) -> None:
        for name, slots in self._groups.pop(group, {}).items():
            self._taken[name].difference_update(slots)
        self._ports.pop(group, None)


def _is_ipv6(address: str) -> bool:
    try:  # (bracketed, and with a zone: "[fe80::1%eth0]")
        return ipaddress.ip_address(address.strip("[]").partition("%")[0]).version == 6
    except ValueError:
        return False  # IPv4, or a name


def _refuse_shared_gpus(gpu_hosts: list[HostSpec]) -> None:
    """Each GPU host hands out its machine's GPUs 0..n-1: two hosts that are one machine
    would put two groups on a GPU."""
    here = [h.name for h in gpu_hosts if h.via in HERE]
    if len(here) > 1:  # (netns too: a namespace has its own network, not its own GPUs)
        raise ValueError(f"GPU hosts {here} are all this machine (via \"local\" or \"netns\"), "
                         f"and each would hand out its GPUs 0..n-1 to other groups; list one "
                         f"host with all of this machine's GPUs")
    seen: dict[str, str] = {}  # an address of a machine -> the host listed with it
    for h in gpu_hosts:
        for a in sorted(_machine_of(h)):
            first = seen.setdefault(a, h.name)
            if first != h.name:
                raise ValueError(f"GPU hosts {[first, h.name]} are one machine ({a}): "
                                 f"list each machine once, with all its GPUs")


def _machine_of(h: HostSpec) -> set[str]:
    """What tells `h`'s machine apart: its address, and the IP addresses that resolves to
    here (best effort: a name only ssh's own config knows need not resolve); "this machine"
    for local and netns hosts, and for an address that is a loopback or one this machine
    holds (ssh to its own LAN address). srun's nodes are SLURM's, each named once."""
    resolved = (addresses(h.address) or set()) if h.via != "srun" else set()
    here = h.via in HERE or any(map(_is_mine, resolved))
    return {h.address, *resolved, *(["this machine"] if here else [])}


def _is_mine(ip: str) -> bool:
    """Whether `ip` is an address of this machine: a loopback, or one it can bind."""
    if is_loopback(ip):
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _check_gpus_here(hosts: list[HostSpec]) -> None:
    """A local or netns host claiming more GPUs than this machine has: its ranks' slots past
    the real ones would see no GPU (CUDA_VISIBLE_DEVICES=5 of 4), and run on the CPU."""
    here = [h for h in hosts if h.via in HERE and h.gpus]
    found = Host.detect().gpus if here else 0
    for h in here:
        if h.gpus > found:
            fix = f'"gpus": {found}' if found else 'no "gpus", and "cpus" instead'
            raise ValueError(f"host {h.name!r} is this machine (via {h.via!r}), which has "
                             f"{found} GPU(s) visible, but \"gpus\" gives it {h.gpus}: give "
                             f"it its real number of GPUs ({fix})")


def unreachable(address: str) -> str | None:
    """Why ranks on other machines could not reach the controller at `address`: "" for a
    loopback or wildcard address, what a name resolves to here for a name (127.0.1.1 on
    Debian); None: they may."""
    if address in ("0.0.0.0", "::", ""):  # (where it listens, not where others reach it)
        return ""
    resolved = addresses(address)
    if resolved and not all(map(is_loopback, resolved)):
        return None
    if resolved is not None and address.partition("%")[0] in resolved:
        return ""  # (a loopback IP address itself)
    return f"it resolves here to {', '.join(sorted(resolved))}" if resolved else \
        "it does not resolve here"


def check_controller_address(cluster: Cluster, host: str) -> None:
    """Refuse a controller address that ranks on the cluster's remote hosts cannot reach:
    they would connect to their own machine and wait out the startup timeout."""
    remote = [h.name for h in cluster.hosts if h.via != "local"]
    why = unreachable(host) if remote else None
    if why is not None:
        raise ValueError(f"a cluster with remote hosts ({remote}) needs the controller's "
                         f"address as they reach it, got {host!r}{why and f' ({why})'}: "
                         f"ranks connect back to the controller; give a routable address of "
                         f"this machine (Controller(host=...), or asyncrl launch "
                         f"--controller-address; Debian-style hosts name themselves 127.0.1.1)")


def _gpu_count(text: str) -> int:
    """SLURM's "8", "a100:8", "a100:4,v100:2": the GPUs of each type summed (0 for none)."""
    return sum(int((re.findall(r"\d+", part) or ["0"])[-1]) for part in text.split(","))


def _leading_int(text: str) -> int:
    """SLURM's "8" or "8(x2)": 8 (0 for none)."""
    return int(re.sub(r"\D.*", "", text) or 0)


def _per_node(text: str, n: int) -> list[int] | None:
    """SLURM_JOB_CPUS_PER_NODE ("64(x2),32") for `n` nodes, in their order; None when it
    does not name them all."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m[1])] * int(m[2] or 1)
    return counts if len(counts) == n else None


def torchrun_command(host: HostSpec, env: Mapping[str, str], nnodes: int, node_rank: int,
                     per_node: int, endpoint: str, rdzv_id: str,
                     scratch: str | None = None, given: frozenset[str] = frozenset()
                     ) -> list[str]:
    """The command that starts one host's agent of a group, run `via` the host's way.
    `scratch`: a folder of this machine for torchrun's own, on hosts that share its files
    (elsewhere, and without one, `asyncrl.actors.agent_main` makes and removes its own).
    `given`: the names of the group's own `env=`, which ssh carries whatever they are: in
    the agent's lifeline (`lifeline_env`), not on its command line, which `ps` shows."""
    shared = host.via in ("local", "netns") and scratch is not None
    agent = "torch.distributed.run" if shared else "asyncrl.actors.agent_main"
    run = [sys.executable, "-m", agent, "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--nproc-per-node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
           # the first host serves the rendezvous store: said outright, since its address
           # need not be one torchrun recognises as its own (namespaces, NAT, aliases)
           "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}",
           "--local-addr", host.address,  # what the ranks of the first host are reached at
           "--max-restarts", "0", "--monitor-interval", "0.1",
           *(["--log-dir", str(scratch)] if shared else []), "-m", "asyncrl.actors.rank_main"]
    if host.via == "local":
        return run
    if host.via == "netns":  # the environment passes through `ip netns exec`
        return ["ip", "netns", "exec", host.name, *run]
    if host.via == "srun":  # srun runs in the ranks' environment and exports all of it (a
        # list after ALL would split values at commas: CUDA_VISIBLE_DEVICES=0,1);
        # --overlap: since SLURM 20.11 a step takes its node's resources for itself, and a
        # second group's agent there would wait for the first group's to end; no binding:
        # since 22.05 srun takes no --cpus-per-task from the allocation, and a 1-task step's
        # task may be bound to one CPU, the agent and every rank on it (the step has the
        # job's CPUs of the node; a CPU host's ranks asyncrl pins to their share)
        return ["srun", "--nodes=1", "--ntasks=1", "--overlap", f"--nodelist={host.name}",
                "--export=ALL", "--cpu-bind=none", *run]
    # ssh passes no environment: ours, the group's env=, and the network and library
    # settings users tune; and starts in $HOME: the ranks go where the controller runs
    # (relative paths: PYTHONPATH entries, data files), on the shared file system
    exports = [f"{k}={v}" for k, v in env.items() if _on_command_line(k)]
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", host.address,
            f"cd {shlex.quote(os.getcwd())} && env "
            + " ".join(shlex.quote(e) for e in exports) + " " + shlex.join(run)]


def _on_command_line(key: str) -> bool:
    """What ssh's command line carries: ours and the settings users tune (the agent needs
    PYTHONPATH to start at all; PYTHONUNBUFFERED, for the ranks' prints to reach their logs as
    they come); the rest of a group's env= goes in its lifeline."""
    return key.startswith(("ASYNCRL_", "PYTHONPATH", "PYTHONUNBUFFERED", "OMP_", "CUDA_",
                           "NCCL_", "GLOO_", "TORCH_")) or key in RANK_ENV_DEFAULTS


def lifeline_env(host: HostSpec, env: Mapping[str, str], given: frozenset[str]) -> bytes:
    """The first line of a remote agent's lifeline (agent_main.read_env_line): over ssh, the
    group's own `env=` that ssh's command line does not carry, which `ps` would show (srun
    passes the whole environment itself)."""
    sent = {k: env[k] for k in given if k in env and not _on_command_line(k)} \
        if host.via == "ssh" else {}
    return json.dumps(sent).encode() + b"\n"


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
