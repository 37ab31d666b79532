"""Where `asyncrl launch` runs a flow's groups: this machine, the hosts of --hosts FILE, or
the SLURM allocation it runs in, and the address their ranks reach the controller at."""

from __future__ import annotations

import argparse
from typing import Any


def launch_cluster(args: argparse.Namespace, command: str = "launch") -> tuple[Any, str]:
    """The cluster to spread groups over (--hosts FILE, or the SLURM allocation this runs
    in), and the address the control plane listens on (this machine's, beyond loopback,
    when ranks run on other machines); refusals name `asyncrl <command>`."""
    import socket

    from asyncrl.controller.cluster import Cluster, unreachable

    try:
        cluster = Cluster.from_file(args.hosts) if args.hosts else Cluster.from_slurm()
    except ValueError as e:
        raise SystemExit(f"asyncrl {command}: {e}") from None
    if cluster is None or all(h.via == "local" for h in cluster.hosts):
        return cluster, "127.0.0.1"
    remote = [h.name for h in cluster.hosts if h.via != "local"]
    fix = (f"pass --controller-address ADDRESS, this machine's address as host(s) {remote} "
           f"reach it: their ranks connect back to the controller")
    address = args.controller_address
    said = f"--controller-address {address}"
    if address is None:
        name = socket.gethostname()
        try:
            address = socket.gethostbyname(name)
        except OSError as e:  # (gaierror)
            raise SystemExit(f"asyncrl {command}: this machine's name {name!r} does not "
                             f"resolve here ({e}); {fix}") from None
        said = (f"this machine's name {name!r} resolves to {address} (Debian-style hosts "
                f"name themselves 127.0.1.1)")
    why = unreachable(address)  # (a loopback or wildcard IP, or a name resolving to one)
    if why is not None:  # (as Controller refuses them)
        raise SystemExit(f"asyncrl {command}: {said}{why and f' ({why})'}, an address other "
                         f"machines cannot reach; {fix}")
    return cluster, address
