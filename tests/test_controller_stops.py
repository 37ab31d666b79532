"""What a group's stop frees, on a controller of stubs (no process starts): the name and
placement of a group whose close was cancelled, and the shared memory its killed ranks left
on this machine, whichever host of a cluster they ran as."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

import asyncrl.controller.controller as controller_module
from asyncrl.comm.dataplane import pool_prefix
from asyncrl.controller.cluster import Cluster, HostSpec
from asyncrl.controller.controller import Controller
from asyncrl.controller.placement import Host, Placer


def _controller(cluster: Cluster | None = None) -> Controller:
    ctl = object.__new__(Controller)  # only what closing and reaping a group use
    ctl.placer, ctl.cluster, ctl.groups = Placer(Host(2, (0,))), cluster, {}
    ctl.inbox = SimpleNamespace(forget_stopped=lambda: None)
    ctl.run_id, ctl.shutdown_grace, ctl.logs = "run", 0.0, None
    ctl._reaper = SimpleNamespace(agents=[])
    ctl.channel = SimpleNamespace(forget=lambda route: None)
    return ctl


def test_a_cancelled_close_frees_the_name_and_placement_once_the_stop_ends():
    """The caller of close_group cancelled while the stop went on: the group stayed in
    ctl.groups and placed, its name taken and its GPUs counted, for the controller's life."""
    async def main():
        ctl = _controller()
        ctl.placer.place("g", 1, None)
        group = SimpleNamespace(name="g", stopping=None)
        ctl.groups["g"] = group
        waiting, release = asyncio.Event(), asyncio.Event()

        async def stop(g, grace=None):  # as _stop_group: a stop that its caller cannot end
            g.stopping = asyncio.ensure_future(release.wait())
            waiting.set()
            await asyncio.shield(g.stopping)
        ctl._stop_group = stop
        closing = asyncio.ensure_future(ctl.close_group(group))
        await waiting.wait()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        held = ("g" in ctl.groups, "g" in ctl.placer.placed)  # the stop goes on
        release.set()
        await group.stopping  # (its callbacks run in order: the controller's first)
        return held, "g" in ctl.groups, ctl.placer.placed, dict(+ctl.placer._use)
    assert asyncio.run(asyncio.wait_for(main(), 30)) == ((True, True), False, {}, {})


def test_killed_ranks_segments_are_swept_on_hosts_that_are_this_machine(monkeypatch):
    """Ranks of a cluster report their host's name (ASYNCRL_HOST_NAME), never this
    machine's: the segments left by killed ranks of local and netns hosts stayed."""
    swept: list[str] = []
    monkeypatch.setattr(controller_module, "cleanup_segments", swept.append)
    cluster = Cluster([HostSpec("loop", "127.0.0.1", via="local"),
                       HostSpec("ns", "10.200.0.2", via="netns"),
                       HostSpec("far", "10.0.0.9", via="ssh")])
    ctl = _controller(cluster)
    hosts = {0: "loop", 1: "ns", 2: "far", 3: socket.gethostname()}
    group = SimpleNamespace(name="g", agent=SimpleNamespace(proc=None, signal_all=lambda s: None),
                            ranks={r: SimpleNamespace(pid=100 + r, host=h)
                                   for r, h in hosts.items()})
    asyncio.run(ctl._reap(group, grace=0.0))
    assert swept == [pool_prefix("run", "g", r, 100 + r) + "-" for r in (0, 1, 3)]
