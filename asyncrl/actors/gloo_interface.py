"""Where a rank's gloo listens when its group spans hosts.

Without GLOO_SOCKET_IFNAME, gloo listens on the address this machine's name resolves to.
Debian's /etc/hosts names a machine 127.0.1.1: its peers on other hosts were told to
connect to loopback, and init_process_group waited for them until the collective timeout
(the controller said "did not say hello within 120 s"). Gloo is given the interface that
holds the host's address (the one its data plane binds, ASYNCRL_DATA_HOST), else refused.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import MutableMapping

from asyncrl.comm.dataserver import addresses, is_loopback

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(got[20:24])


def set_gloo_interface(env: MutableMapping[str, str]) -> None:
    """GLOO_SOCKET_IFNAME for a rank of a group over several hosts (unless set): the
    interface of the host's address. RuntimeError where there is none and this machine's
    name resolves to loopback only (gloo would listen there)."""
    controller = env.get("ASYNCRL_ADDR", "").removeprefix("tcp://").rpartition(":")[0]
    if env.get("GLOO_SOCKET_IFNAME") or \
            int(env.get("WORLD_SIZE", "1")) <= int(env.get("LOCAL_WORLD_SIZE", "1")) or \
            all(map(is_loopback, addresses(controller.strip("[]")) or {"127.0.0.1"})):
        return  # (one host, or hosts imitated on this machine: loopback is fine)
    host = env.get("ASYNCRL_DATA_HOST", "")
    wanted = addresses(host) or set()
    for _, name in socket.if_nameindex():  # (never lo: "127.0.0.1 node1" in /etc/hosts)
        if interface_address(name) in {a for a in wanted if not is_loopback(a)}:
            env["GLOO_SOCKET_IFNAME"] = name
            return
    own = socket.gethostname()
    for name, found in ((host, wanted), (own, addresses(own))):  # (a SLURM host's address
        if found and all(map(is_loopback, found)):  # is its name: 127.0.1.1 on Debian)
            raise RuntimeError(
                f"{name!r} resolves to loopback here ({', '.join(sorted(found))}), where gloo "
                f"would listen, and no interface here holds the host's address {host!r}: "
                f"ranks on other hosts could not reach this one; give the host its IP address "
                f"in the cluster's hosts, or set GLOO_SOCKET_IFNAME (the interface its peers "
                f"reach it on) in the group's env=")
