"""Controller: the asyncio single controller. It controls; workers compute.

    async with Controller() as ctl:
        group = await ctl.spawn(Worker, nprocs=2)      one torchrun job, ranks say hello,
        value = await group.method(x)                  then build the worker and get ready

    parts: channel (ROUTER sockets; a reader task each) -> inbox (what ranks send: resolves
    calls) · outbox (what goes to them, per relay) · supervisor (heartbeats out, dead or
    silent ranks in; one watcher thread per torchrun agent) · releases (objects to free)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec

from asyncrl.actors.procs import PROCESS_ENV, raise_open_file_limit, runs, this_process
from asyncrl.actors.protocols import Layout
from asyncrl.actors.worker import Worker
from asyncrl.comm import codec, messages
from asyncrl.comm.auth import curve_available, new_curve_keys, new_secret, write_secret
from asyncrl.comm.channel import ControllerChannel
from asyncrl.comm.dataplane import pool_prefix, run_prefix
from asyncrl.comm.messages import SPAWN_ENV, Construct, Shutdown
from asyncrl.comm.refs import make_ref
from asyncrl.comm.relay import pid_of
from asyncrl.comm.shm import cleanup as cleanup_segments
from asyncrl.controller.agent_fork import AgentServer, forking_enabled, shared_server
from asyncrl.controller.checkpoint import open_to_all
from asyncrl.controller.cluster import Cluster, check_controller_address
from asyncrl.controller.declare import check_runtime_keywords, check_spawn_keywords, init_params
from asyncrl.controller.group import GroupHandle
from asyncrl.controller.inbox import Inbox
from asyncrl.controller.launcher import Agent, check_env, cluster_agents, rank_env
from asyncrl.controller.links import Links
from asyncrl.controller.logs import LogSink, check_group_name
from asyncrl.controller.lost import concurrent_sockets
from asyncrl.controller.outbox import Outbox
from asyncrl.controller.placement import Placer, check_nice
from asyncrl.controller.releases import Releases
from asyncrl.controller.supervisor import Supervisor
from asyncrl.controller.timeline import Timeline
from asyncrl.errors import (
    ClosedError,
    EncodeError,
    GroupDeadError,
    SpawnError,
    SpawnTimeout,
)

log = logging.getLogger("asyncrl")
_current: contextvars.ContextVar[Controller | None] = contextvars.ContextVar(
    "asyncrl_controller", default=None)
RELAY_MIN_RANKS = 16  # relay=None: groups this large talk to the controller through relays
MAX_IPC_PATH = 100  # a unix socket's path must fit sockaddr_un (107 bytes on Linux)


class _Reaper:
    """Kills every agent and rank for certain; runs at close, or at GC / interpreter exit."""

    def __init__(self) -> None:
        self.agents: list[Agent] = []

    def kill_all(self) -> None:
        for agent in self.agents:
            agent.signal_all(signal.SIGKILL)
            if agent.proc is not None:
                try:
                    agent.wait(timeout=5)
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass


class Controller:
    """The asyncio single controller. Use as ``async with asyncrl.Controller() as ctl:``.

    heartbeat_interval / heartbeat_timeout: both ways; a rank silent for heartbeat_timeout is
    dead; ranks exit when the controller is silent that long (one whose process runs on
    their host, its loop blocked: up to the collective timeout).
    startup_timeout: torchrun start until every rank said hello.
    construct_timeout: hello until every worker's ``__init__`` returned.
    shutdown_grace: how long ranks get to exit on close before they are killed.
    transfer_timeout: how long a rank waits for a peer's data before TransferTimeout.
    collective_timeout: how long a collective inside a group (gloo, NCCL) may wait for a
    peer; then it raises on the rank (gloo) or the NCCL watchdog ends the rank's process,
    which the supervisor reports (a hung NCCL kernel cannot be interrupted otherwise).
    transport: "auto" (CPU rows: shared memory on one host, else TCP; GPU rows: CUDA IPC
    where the consumer sees the producer's GPU, else NCCL through CuPy, else host memory),
    "tcp" to force sockets, "nccl" to send every tensor by NCCL.
    run_dir: logs (logs/<group>/rank<r>.log, torchrun's logs/<group>.log), checkpoints,
    breakpoint sessions; a temporary folder by default. A folder every user can write is
    refused.
    encrypt: CurveZMQ on every control and data-plane socket, for untrusted networks (the
    keys go to the ranks in the 0600 secret file; frames stay HMAC-signed).
    relay: a group's control messages go through one relay per host (a thread of its local
    rank 0), so a call costs the controller one message each way per host, not per rank; it
    adds a hop to every call. None: for groups of RELAY_MIN_RANKS ranks or more."""

    def __init__(self, *, host: str = "127.0.0.1", heartbeat_interval: float = 0.5,
                 heartbeat_timeout: float = 3.0, startup_timeout: float = 120.0,
                 construct_timeout: float = 600.0, shutdown_grace: float = 10.0,
                 transfer_timeout: float = 60.0, collective_timeout: float = 600.0,
                 transport: str = "auto",
                 run_dir: str | os.PathLike | None = None, die_with_controller: bool = True,
                 echo_logs: bool = True, cluster: Cluster | None = None,
                 encrypt: bool = False, relay: bool | None = None):
        if transport not in ("auto", "tcp", "nccl"):
            raise ValueError(f"transport must be 'auto', 'tcp' or 'nccl', got {transport!r}")
        check_heartbeats(heartbeat_interval, heartbeat_timeout)
        self.host = host
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.construct_timeout = construct_timeout
        self.shutdown_grace = shutdown_grace
        self.transfer_timeout = transfer_timeout
        self.collective_timeout = collective_timeout
        self.links = Links(transfer_timeout)  # NCCL communicators between groups
        self.transport = transport
        self.run_id = uuid.uuid4().hex[:16]  # names this run's shared-memory segments
        # bytes of worker-produced data that went through this controller to another group
        self.payload_bytes = 0
        self.placer = Placer()
        self.timeline: Timeline | None = None  # set by a DataFlow: records node executions
        self._own_run_dir = run_dir is None
        # absolute: ranks on other hosts (ssh starts them in $HOME) save checkpoints there
        self.run_dir = Path(run_dir).absolute() if run_dir else None
        self._die_with_controller = die_with_controller
        self.echo_logs = echo_logs
        self.cluster = cluster  # groups spread over its hosts; None: this machine only
        if cluster is not None:  # (ranks elsewhere must not connect to themselves)
            check_controller_address(cluster, host)
        if encrypt and not curve_available():
            raise RuntimeError("Controller(encrypt=True) needs a libzmq with CURVE, and this "
                               "pyzmq's has none; install pyzmq from its wheels (they bundle "
                               "one) or build libzmq with libsodium")
        self.encrypt = encrypt
        self.relay = relay
        self.relay_of: dict[bytes, bytes] = {}  # rank socket identity -> its relay's
        self.spawn_tokens: dict[str, str] = {}  # group name -> its latest spawn's token
        self._relays = itertools.count()
        if not host.startswith("127.") and host != "localhost":
            log.warning("asyncrl: the control plane listens on %s, reachable from the network "
                        "(every frame is HMAC-signed with this run's secret%s)", host,
                        ", and CURVE-encrypted" if encrypt else
                        "; Controller(encrypt=True) or `--encrypt` encrypts them too")
        self.logs: LogSink | None = None  # ranks' output: RUN_DIR/logs/<group>/rank<r>.log
        self.groups: dict[str, GroupHandle] = {}
        self.calls: dict[int, GroupHandle] = {}  # call id -> its group, until answered
        self.inbox = Inbox(self)
        self.supervisor = Supervisor(self)
        self.releases = Releases(self)
        self._tasks: list[asyncio.Task] = []
        self._reaper = _Reaper()
        self._finalizer = weakref.finalize(self, self._reaper.kill_all)
        self._started = False
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------
    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("this Controller was already started; make a new one")
        if "ASYNCRL_GROUP" in os.environ:
            raise RuntimeError(
                f"a Controller was started inside a rank of group "
                f"{os.environ['ASYNCRL_GROUP']!r}: the driver script was imported on the ranks "
                f"to find a class it defines; put the driver code in `async def main()` (run "
                f"with `asyncrl launch`) or under `if __name__ == '__main__':`")
        self._started = True
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._token = _current.set(self)
        try:
            self._start()
        except BaseException:  # (a host not of this machine's, a run_dir it cannot make):
            # nothing left behind, and no half-started controller for the next to find
            self._closed = True
            _current.reset(self._token)
            for task in self._tasks:
                task.cancel()
            self._release()
            raise

    def _start(self) -> None:
        raise_open_file_limit()  # (a socket and a log file per rank: 1024 ran out)
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="asyncrl-"))
        self.run_dir.mkdir(0o775, parents=True, exist_ok=True)  # (no write for others
        # under umask 0). Every user can write it (not another user's: root on NFS, a
        # container's bind mount): refused, as --resume would refuse its checkpoints late
        if (unsafe := open_to_all(self.run_dir)) is not None:
            raise PermissionError(unsafe)
        self.logs = LogSink(self.run_dir / "logs", echo=self.echo_logs)
        remove_orphans(Path(tempfile.gettempdir()))  # of controllers killed before closing
        self._private = Path(tempfile.mkdtemp(prefix="asyncrl-secret-"))  # 0700, removed at close
        owner = self._private / f".{OWNER_FILE}"  # whole or not there: never half read
        owner.write_text(f"{_host_here()} {this_process()}")
        owner.replace(self._private / OWNER_FILE)
        self.secret_file = self._private / "secret"
        secret = new_secret()
        keys, curve_secret = new_curve_keys() if self.encrypt else (None, None)
        write_secret(str(self.secret_file), secret, keys)
        self.channel = ControllerChannel(secret, self.host, curve_secret)
        self.channel.start(self.inbox.on_message)
        self._tasks = [self.loop.create_task(self.supervisor.run())]
        self._agent_server()  # its torch import runs while the driver goes on to its groups

    async def close(self) -> None:
        """Shut every group down (killing what does not exit in time) and stop the plane."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        try:
            await asyncio.shield(asyncio.gather(*(self._stop_group(g)
                                                  for g in self.groups.values())))
        finally:
            self._reaper.kill_all()
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            cleanup_segments(run_prefix(self.run_id))  # what killed ranks left behind
            self._release()

    def _release(self) -> None:
        """Close and remove what start() made, as far as it got."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.logs is not None:
            self.logs.close()
        if getattr(self, "_private", None) is not None:
            shutil.rmtree(self._private, ignore_errors=True)
        if self._own_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @staticmethod
    def current() -> Controller | None:
        """The Controller started in this context (None outside one)."""
        ctl = _current.get()
        return ctl if ctl is not None and not ctl._closed else None

    def outbox(self) -> Outbox:
        """Where messages for rank sockets go: `put` them, then `flush`."""
        return Outbox(self.channel, self.relay_of)

    def post(self, identity: bytes, msg: Any, raw: Sequence[Any] = ()) -> None:
        """Send one message (and the raw frames it announces) to one rank socket (through
        its relay, if it has one)."""
        box = self.outbox()
        box.put(identity, messages.encode(msg), raw)
        box.flush()

    @property
    def dropped_frames(self) -> dict[str, int]:
        """Frames the controller dropped, by reason: malformed, bad_mac, replay, undecodable,
        foreign (a relay that spoke for another group's socket), stale (a hello from a rank
        of an earlier group of that name)."""
        return self.channel.dropped

    # -- spawning ---------------------------------------------------------------------------
    def check_placements(self, groups: list[tuple[str, int, Any]]) -> None:
        """Place (name, nprocs, place) groups in order on a copy of the current placement:
        one that cannot be placed raises PlacementError before any of them starts."""
        if self.cluster is not None:  # its constraints, then its slots, as spawn takes them
            cluster = copy.deepcopy(self.cluster)
            for name, nprocs, place in groups:
                cluster.check_place(name, place)
                cluster.spread(name, nprocs)
            return
        trial = copy.deepcopy(self.placer)
        for name, nprocs, place in groups:
            trial.place(name, nprocs, place, warn=False)

    async def spawn(self, worker_cls: type, *args: Any, nprocs: int = 1, name: str | None = None,
                    mesh: dict[str, int] | None = None, place: Any = None,
                    env: dict[str, str] | None = None, relay: bool | None = None,
                    nice: int = 0, **kwargs: Any) -> GroupHandle:
        """Launch `worker_cls` as one torchrun job of `nprocs` ranks; wait until it is ready.

        `mesh` names the axes of the group's ranks (default ``{"dp": nprocs}``); `place` is a
        placement constraint or a list of them (`asyncrl.separate_from(g)`...); `env` adds
        environment variables for the ranks; `relay` overrides the controller's `relay` for
        this group; `nice` (0-19) lowers its ranks' CPU priority (see `check_nice`); other
        arguments go to ``worker_cls(...)``: their tensors of 64 KiB or more are sent from their
        own memory while this waits (do not change them in place from another task meanwhile).
        """
        if self._closed or not self._started:
            raise ClosedError("the controller is not running; use `async with Controller()`")
        name = name or getattr(worker_cls, "__name__", "").lower()  # (checked next)
        layout = self._check_spawn(worker_cls, name, nprocs, mesh, env)
        check_runtime_keywords(worker_cls, "spawn()", relay=relay, nice=nice)
        check_spawn_keywords(worker_cls, kwargs)  # (max_restarts: a DataFlow's)
        nice = check_nice(name, nice)
        relayed = self._relays_for(name, nprocs, self.relay if relay is None else relay)
        try:
            params = init_params(worker_cls)
            # large arrays as raw frames: the loop neither copies nor signs them per rank;
            # sent from their own memory, before spawn returns
            payload, frames = codec.encode_call_oob((worker_cls, *args), kwargs,
                                                    ["worker class", *params])
        except codec.ArgEncodeError as e:
            raise EncodeError(f"cannot send argument {e.name!r} of {worker_cls.__name__}(): "
                              f"{e.cause}") from None
        assert self.run_dir is not None
        # before launch: errors say why (a cluster spreads groups over its hosts' slots instead,
        # and refuses the constraints it cannot honour)
        if self.cluster is not None:
            self.cluster.check_place(name, place)
        placement_env = {} if self.cluster is not None else \
            self.placer.place(name, nprocs, place).env
        extra = {**placement_env, "ASYNCRL_ADDR": self.channel.address, "ASYNCRL_GROUP": name,
                 "ASYNCRL_SECRET_FILE": str(self.secret_file),
                 "ASYNCRL_HB_INTERVAL": str(self.heartbeat_interval),
                 "ASYNCRL_HB_TIMEOUT": str(self.heartbeat_timeout),
                 "ASYNCRL_SHUTDOWN_GRACE": str(self.shutdown_grace),
                 "ASYNCRL_TRANSFER_TIMEOUT": str(self.transfer_timeout),
                 "ASYNCRL_COLLECTIVE_TIMEOUT": str(self.collective_timeout),
                 "ASYNCRL_TRANSPORT": self.transport, "ASYNCRL_RUN_ID": self.run_id,
                 "ASYNCRL_DEBUG_DIR": str(self.run_dir / "debug"),  # breakpoint() sessions
                 "ASYNCRL_NICE": str(nice), **(env or {})}
        # every spawn its own token: a rank of an earlier group of this name, late, is
        # not taken for one of this group's
        self.spawn_tokens[name] = extra[SPAWN_ENV] = secrets.token_hex(8)
        # a silent controller that runs is busy, not gone: its ranks wait for it (on a
        # remote host its agent stands in for it: launcher.host_env)
        extra[PROCESS_ENV] = this_process()
        if relayed:  # in the private folder: only this user reaches the relays' ipc sockets
            extra["ASYNCRL_RELAY"] = f"ipc://{self._private}/relay{next(self._relays)}"
        try:
            agent = self._make_agent(name, nprocs, extra)
        except BaseException:  # (a cluster's host commands) what was placed is free again
            self._forget(name)
            raise
        group = GroupHandle(self, name, worker_cls, layout, agent)
        group.construct_msg = Construct(payload=msgspec.Raw(payload), mesh=list(layout.mesh),
                                        buffers=[a.nbytes for a in frames])
        group.construct_frames = frames
        self.groups[name] = group
        self._reaper.agents.append(agent)
        loop = self.loop

        def exited(code: int) -> None:  # on the agent's watcher thread
            with contextlib.suppress(RuntimeError):  # (the loop closed: nobody to tell)
                loop.call_soon_threadsafe(self.supervisor.agent_exited, group, code)

        # the agent server asked from a thread: busy, or still importing torch, it answers
        # in seconds, while the other groups' heartbeats must go on
        fork = getattr(agent, "fork", None)
        forking = loop.run_in_executor(None, fork) if fork is not None else None
        try:
            if forking is None:
                agent.start(exited)  # a failed start (EMFILE, no log folder) is undone too
            else:
                agent.start(exited, await asyncio.shield(forking))
            await self._wait(group, group.started, self.startup_timeout, "say hello")
            await self._wait(group, group.ready, self.construct_timeout,
                             f"build {worker_cls.__name__}")
        except GroupDeadError as e:
            await asyncio.shield(self._undo_spawn(group, forking))
            raise SpawnError(f"group {name!r} failed while starting: {e}") from e
        except BaseException:
            await asyncio.shield(self._undo_spawn(group, forking))
            raise
        return group

    async def _undo_spawn(self, group: GroupHandle, forking: asyncio.Future | None) -> None:
        if forking is not None:  # a fork under way when the spawn was cancelled: its
            await asyncio.wait([forking])  # torchrun is stopped too, not left running
            if group.agent.proc is None and not forking.cancelled() and \
                    forking.exception() is None and forking.result() is not None:
                group.agent.proc = forking.result()
        await self._stop_group(group, grace=0.0)
        # a close() that stopped the group while its torchrun was being forked found none:
        # what started after is stopped here
        group.agent.signal_all(signal.SIGKILL)
        if group.agent.proc is not None:
            await self.loop.run_in_executor(None, group.agent.wait)
        self._drop(group)

    def _relays_for(self, name: str, nprocs: int, relay: bool | None) -> bool:
        """Whether group `name` talks to the controller through host relays."""
        if relay is False or (relay is None and nprocs < RELAY_MIN_RANKS):
            return False
        longest = f"{self._private}/relay{999}-{9999}-exec"  # an ipc:// path, at most
        if len(longest) <= MAX_IPC_PATH:
            return True
        said = (f"group {name!r}: the relays' socket paths would be too long for ipc:// "
                f"({len(longest)} > {MAX_IPC_PATH} characters under {self._private.parent}); "
                f"set TMPDIR to a shorter folder")
        if relay:
            raise ValueError(f"{said}, or spawn it with relay=False")
        log.warning("asyncrl: %s; it talks to the controller without relays", said)
        return False

    def _make_agent(self, name: str, nprocs: int, extra: dict[str, str]) -> Any:
        """What starts a group's ranks: one torchrun job, or one per host of the cluster.
        `extra` is the ranks' environment beyond ours. A subclass may return any object with
        `Agent`'s interface (benchmarks/controller_scale.py starts simulated ranks)."""
        assert self.run_dir is not None
        scratch = self._private / "torchrun"  # removed at close
        if self.cluster is not None:
            return cluster_agents(self.cluster, name, nprocs, extra, self.run_dir / "logs",
                                  self.run_id, self._die_with_controller, scratch)
        return Agent(name, nprocs, rank_env(dict(os.environ), extra),
                     self.run_dir / "logs" / f"{name}.log", self._die_with_controller,
                     scratch=scratch, server=self._agent_server())

    def _agent_server(self) -> AgentServer | None:
        """The warm process torchrun agents are forked from (asyncrl.controller.agent_fork;
        one per process, shared by its controllers), or None: torchrun started anew (hosts
        files, ASYNCRL_FORK_AGENTS=0, or it cannot start)."""
        if self.cluster is not None or not forking_enabled():
            return None
        return shared_server()

    async def close_group(self, group: GroupHandle) -> None:
        """Shut one group down (its ranks exit; pending calls fail with ClosedError)."""
        try:
            await self._stop_group(group)
        except asyncio.CancelledError:  # the stop goes on: name and placement freed as it ends
            cast(asyncio.Future, group.stopping).add_done_callback(lambda _: self._drop(group))
            raise
        self._drop(group)

    def _drop(self, group: GroupHandle) -> None:  # a stopped group's name is free again
        if self.groups.get(group.name) is group:
            del self.groups[group.name]
            self._forget(group.name)

    def _forget(self, name: str) -> None:
        self.placer.forget(name)
        self.inbox.forget_stopped()  # (its ranks' registrations held the handle's arrays)
        if self.cluster is not None:
            self.cluster.forget(name)

    def _check_spawn(self, cls: type, name: str, nprocs: int, mesh: dict[str, int] | None,
                     env: Any) -> Layout:
        """Refuse what would fail after the group is placed (before it is: nothing to undo)."""
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"spawn() needs a subclass of asyncrl.Worker, got {cls!r}")
        try:
            make_ref(cls)
        except TypeError as e:
            raise EncodeError(f"worker class {cls.__qualname__}: {e}") from None
        check_group_name(name)
        if name in self.groups:
            raise ValueError(f"a group named {name!r} already exists; pass name=... to spawn()")
        if not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
        mesh = dict(mesh) if mesh else {"dp": nprocs}
        size = 1
        for axis, n in mesh.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh axis {axis!r} must be a positive int, got {n!r}")
            size *= n
        if size != nprocs:
            raise ValueError(f"mesh {mesh} has {size} ranks but nprocs={nprocs}; make the "
                             f"product of the mesh sizes equal nprocs")
        check_env(name, env)
        return Layout(name, tuple(mesh.items()))

    async def _wait(self, group: GroupHandle, waiter: asyncio.Future, timeout: float,
                    what: str) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            if waiter is group.started and self.cluster is not None:  # a respawn goes first
                # to other hosts than those none of its ranks said hello from
                self.cluster.suspect(*group.agent.blamed({i.host for i in group.ranks.values()}))
            # hello: on both its sockets (its Construct waits for every rank's two)
            missing = sorted(set(range(group.nprocs)) - {
                r for r, i in group.ranks.items() if i.ready or (
                    waiter is group.started and i.identity and i.exec_identity)})
            raise SpawnTimeout(
                f"group {group.name!r}: ranks {missing} did not {what} within {timeout:g} s "
                f"(raise Controller(startup_timeout=/construct_timeout=) if it needs longer)."
                f"\n--- last lines of its output ({group.agent.log_path}) ---\n"
                f"{group.agent.tail()}") from None

    async def _stop_group(self, group: GroupHandle, grace: float | None = None) -> None:
        """Ask the ranks to exit; kill whatever is left after `grace` seconds. A stop goes on
        if its caller is cancelled, and a second caller waits for it: the group's devices
        are free only when its processes are gone."""
        if group.stopping is None:
            group.closing = True
            group._fail_all(ClosedError(f"group {group.name!r} was shut down"))
            box = self.outbox()
            group.post_all(box, "io", messages.encode(Shutdown()))
            box.flush()
            if group.dead is None and not self._closed:  # a death was announced already;
                group.announce_gone("was shut down")     # at close every group goes
            for info in group.ranks.values():  # nothing else goes to its sockets
                for identity in (info.identity, info.exec_identity):
                    self.channel.unwatch(self.relay_of.pop(identity, identity))
                for identity, _ in concurrent_sockets(info) if info.identity else ():
                    self.channel.unwatch(identity)
            group.stopping = asyncio.ensure_future(self._reap(group, grace))
            group.stopping.add_done_callback(_retrieved)
        await asyncio.shield(group.stopping)

    async def _reap(self, group: GroupHandle, grace: float | None) -> None:
        agent = group.agent
        grace = self.shutdown_grace if grace is None else grace
        if agent.proc is not None and grace > 0:
            try:
                await asyncio.wait_for(group.exited.wait(), grace)
            except asyncio.TimeoutError:
                pass
        agent.signal_all(signal.SIGKILL)
        if agent.proc is not None:
            await self.loop.run_in_executor(None, agent.wait)
        agent.signal_all(signal.SIGKILL)  # ranks torchrun did not take with it (ours only)
        if agent in self._reaper.agents:  # gone: nothing of it is signalled again at close
            self._reaper.agents.remove(agent)
        if self.logs is not None:  # (a respawned group's ranks open them again)
            self.logs.close_group(group.name)
        name, ranks = group.name.encode(), {(str(r).encode(), str(info.pid).encode())
                                            for r, info in group.ranks.items()}
        self.channel.forget(lambda route: _rank_route(route, name, ranks))
        here = {socket.gethostname(), *(self.cluster.here() if self.cluster else ())}
        for rank, info in group.ranks.items():  # what its killed ranks left in /dev/shm
            if info.host in here:
                cleanup_segments(pool_prefix(self.run_id, group.name, rank, info.pid) + "-")


OWNER_FILE = "owner"  # in a controller's private folder: "HOST/PID-NAMESPACE PID:BIRTH"


def check_heartbeats(interval: float, timeout: float) -> None:
    if timeout <= interval:
        raise ValueError(f"heartbeat_timeout ({timeout:g} s) must be longer than "
                         f"heartbeat_interval ({interval:g} s)")


def _host_here() -> str:
    """This host, and its PID namespace: containers that share a host name and a TMPDIR
    but not their processes see none of each other's."""
    try:
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        space = "?"
    return f"{socket.gethostname()}/{space}"


def remove_orphans(tmp: Path) -> None:
    """Remove the private folders (the run's secret, torchrun's files) of controllers that
    died without closing (SIGKILL): this host's only, since a shared TMPDIR holds other
    hosts' too; a folder without an owner (being made, or another user's) stays."""
    here = _host_here()
    for folder in tmp.glob("asyncrl-secret-*"):
        try:
            host, process = (folder / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if host == here and not runs(process):
            shutil.rmtree(folder, ignore_errors=True)


def _rank_route(route: bytes, group: bytes, ranks: set[tuple[bytes, bytes]]) -> bool:
    """Whether `route` is a socket of one of `ranks` ((rank, pid)) of `group`: their
    identities are group/rank/role/pid.nonce."""
    parts = route.split(b"/")
    return len(parts) == 4 and parts[0] == group and (parts[1], pid_of(parts[3])) in ranks


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # its awaiter may have gone: not "never retrieved"
