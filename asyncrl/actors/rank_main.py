"""The program every rank runs (torchrun starts it as ``-m asyncrl.actors.rank_main``).

    main thread: "io" socket                   exec thread: "exec" socket
    ────────────────────────                   ──────────────────────────
    init torch.distributed, Hello              Hello
    Heartbeat out every interval               Construct ──▶ build the worker ──▶ Ready
    no controller heartbeat → exit             Call ──▶ run (in order) ──▶ Result
    Shutdown → exit
    concurrent=True Call ──▶ thread pool (each thread has its own socket for Results)

In-order calls reach the thread that runs them without a hand-off between threads, and the
io thread never runs user code, so heartbeats flow while a call computes for minutes.
"""

from __future__ import annotations

import asyncio
import datetime
import faulthandler
import inspect
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq
from torch.distributed import distributed_c10d as c10d

from asyncrl.actors import debugger
from asyncrl.actors.failures import failure as _failure
from asyncrl.actors.gloo_interface import set_gloo_interface
from asyncrl.actors.gpu_slots import bind_gpu, check_gpus, gpu_index, select_gpus
from asyncrl.actors.output import OutputCapture
from asyncrl.actors.procs import PROCESS_ENV, raise_open_file_limit, runs
from asyncrl.actors.protocols import DP_AXIS, DPRows, mesh_coords, take_dp_rows
from asyncrl.actors.rank_client import STAND_IN
from asyncrl.actors.rank_fork import set_title
from asyncrl.actors.register import registered_methods
from asyncrl.actors.sigterm import stop_on_sigterm
from asyncrl.actors.worker import Worker, construct
from asyncrl.comm import codec, nccl
from asyncrl.comm.auth import read_curve, read_secret
from asyncrl.comm.channel import MAX_PARTS, RankSocket, in_parts
from asyncrl.comm.cuda_ipc import device_uuid
from asyncrl.comm.dataplane import DataClient, own_pool_prefix, run_prefix
from asyncrl.comm.dataserver import DataServer, check_reachable
from asyncrl.comm.gone import GonePeers
from asyncrl.comm.messages import (
    CONCURRENT_THREADS,
    NONE,
    SPAWN_ENV,
    Call,
    Construct,
    Fetch,
    Fetched,
    Heartbeat,
    Hello,
    Log,
    MethodSpec,
    PeersGone,
    Ready,
    Release,
    Result,
    Shutdown,
)
from asyncrl.comm.relay import RELAY_ROLES, HostRelay, relay_address, relay_identity
from asyncrl.comm.shm import SegmentPool
from asyncrl.futures.store import ObjectStore, schema_of, storable

EXIT_CONTROLLER_LOST = 75
INLINE_LIMIT = 64 * 1024  # results up to this size also travel with their Result
CALLS_SETTLE_S = 5.0  # at close, the longest on_close waits for calls under way
MAX_FETCHED_ARRAYS = MAX_PARTS - 3  # the controller's reader keeps no more of a message


class _Executor:
    """Runs calls on the thread that owns it, with its own socket, event loop and data-plane
    client (inputs that live on other ranks are pulled before the method runs)."""

    def __init__(self, rank_main: RankMain, sock: RankSocket):
        self.main = rank_main
        self.sock = sock
        self.loop = asyncio.new_event_loop()
        self.data = rank_main.data_client()

    def run_call(self, call: Call) -> None:
        main = self.main
        if not main.call_starts():  # the group closes: no call starts now (the controller
            return  # failed every pending one)
        try:
            self._run(call)
        finally:
            main.call_ended()

    def _run(self, call: Call) -> None:
        main = self.main
        start = time.perf_counter()
        try:
            fn = getattr(main.worker, call.method)
            args, kwargs = codec.decode_call(call.payload, call.frames)
            call.frames = []  # the arguments hold what they use of them
            if call.dp_rows is not None:  # this host's rows of the batches: take our chunk
                rows, first = call.dp_rows
                args, kwargs = take_dp_rows(args, kwargs, DPRows(rows, main.dp_size), first,
                                            main.dp_rank)
            args, kwargs = self.data.materialize(args), self.data.materialize(kwargs)
            value = fn(*args, **kwargs)
            del args, kwargs  # pulled inputs go back to their pool as soon as possible
            if inspect.isawaitable(value):
                value = self.loop.run_until_complete(value)
            kept = call.collect is None or main.rank in call.collect
            result = main.keep(call, value) if kept else Result(call.call_id, main.rank)
        except BaseException as e:  # noqa: BLE001 - user code: every failure goes back
            result = Result(call.call_id, main.rank, error=_failure(e),
                            aborted_links=nccl.aborted())
        result.busy = time.perf_counter() - start
        try:
            self.sock.send(result)
        except (TypeError, ValueError, OverflowError) as e:  # its description (a column
            main.store.free([call.call_id])  # name not UTF-8) msgpack refuses: nothing went,
            try:  # and the call waited for ever
                raise TypeError(f"{call.method}'s result cannot be described to the "
                                f"controller: {e}") from e
            except TypeError as said:
                self.sock.send(Result(call.call_id, main.rank, error=_failure(said),
                                      busy=result.busy))


class RankMain:
    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.group = env["ASYNCRL_GROUP"]
        self.address = env["ASYNCRL_ADDR"]
        self.secret = read_secret(env["ASYNCRL_SECRET_FILE"])
        self.curve = read_curve(env["ASYNCRL_SECRET_FILE"])  # None: the run is not encrypted
        self.hb_interval = float(env.get("ASYNCRL_HB_INTERVAL", "0.5"))
        self.hb_timeout = float(env.get("ASYNCRL_HB_TIMEOUT", "3.0"))
        self.controller = env.get(PROCESS_ENV, "")  # on this host: "pid:birth"
        # the controller took this rank: it sent it something (its Construct, a heartbeat)
        self.taken = False
        self.ctx = zmq.Context()
        self.transfer_timeout = float(env.get("ASYNCRL_TRANSFER_TIMEOUT", "60"))
        self.transport = env.get("ASYNCRL_TRANSPORT", "auto")
        # the host name the controller launched this rank on (several "hosts" may share a
        # machine when imitating a cluster on loopback), else the machine's
        self.host = env.get("ASYNCRL_HOST_NAME") or socket.gethostname()
        # the last part of this rank's socket identities: its pid, and a part nobody can
        # guess, so no other local process can connect first under the name and take what
        # is sent to it (a ROUTER routes by the name the peer gives; the first one keeps it)
        self.tag = f"{os.getpid()}.{secrets.token_hex(8)}"
        self.relays: list[HostRelay] = []
        self.relay_addresses: dict[str, str] = {}  # "exec" / "io" -> its relay; empty: none
        self.control_curve = self.curve
        if env.get("ASYNCRL_RELAY"):  # the group's control messages go through a host relay
            self.start_relay(env["ASYNCRL_RELAY"], int(env.get("GROUP_RANK", "0")))
        self.io = self.socket("io")
        self.exec = self.socket("exec")  # handed to the exec thread (heartbeats read counts)
        # (since when its thread waits for a message, 0: it runs one; its heard, received)
        self.exec_seen: tuple[float, int, int] = (0.0, 0, 0)
        self.stamp_heard = 0.0  # the controller's last heartbeat's stamp
        self.store = ObjectStore()
        self.gone = GonePeers()  # groups the controller declared dead: pulls from them fail
        run_id = env.get("ASYNCRL_RUN_ID", str(os.getpid()))
        self.segments = SegmentPool(own_pool_prefix())
        check_reachable(env.get("ASYNCRL_DATA_HOST", "127.0.0.1"), self.address)
        # the data plane's own context: CURVE encrypts a part whole on its context's I/O
        self.data_ctx = zmq.Context()  # thread, and a GiB there held the heartbeats for seconds
        self.data = DataServer(self.data_ctx, env.get("ASYNCRL_DATA_HOST", "127.0.0.1"),
                               self.secret, self.store.get, f"{self.group}:{self.rank}",
                               run_prefix(run_id),
                               on_start=bind_gpu, timeout=self.transfer_timeout,
                               curve=self.curve)
        self.worker: Any = None
        self.calls_loop: asyncio.AbstractEventLoop | None = None  # the in-order calls' loop
        self._running = 0  # calls under way (in order, and concurrent ones)
        self._settled = threading.Condition()
        self.closing = False  # set: no call starts any more
        self.dp_rank, self.dp_size = 0, 1  # this rank's place on the mesh's "dp" axis
        self.methods: dict[str, MethodSpec] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.beside: list[tuple[Call, Future[None]]] = []  # concurrent calls (io thread's)
        self.fetch_sock: RankSocket | None = None  # owned by the fetcher's one thread
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-fetch")
        self.local = threading.local()
        self.concurrent_socks: list[RankSocket] = []  # one per pool thread
        self.log_ctx = zmq.Context()
        self.log_socket: RankSocket | None = None  # the output thread's (main sets it)

    def socket(self, role: str, ctx: zmq.Context | None = None) -> RankSocket:
        identity = f"{self.group}/{self.rank}/{role}/{self.tag}".encode()
        address = self.relay_addresses.get("exec" if role == "exec" else "io", self.address)
        return RankSocket(ctx or self.ctx, address, identity, self.secret,
                          curve=self.control_curve)

    def start_relay(self, prefix: str, node: int) -> None:
        """Local rank 0 runs the host's relays; every local rank's control sockets connect
        to them (over ipc://, within this host: no CURVE on that hop)."""
        self.relay_addresses = {role: relay_address(prefix, node, role) for role in RELAY_ROLES}
        if self.local_rank == 0:
            self.relays = [HostRelay(self.address, address,
                                     relay_identity(self.group, self.rank, role, self.tag),
                                     self.secret, self.curve).start()
                           for role, address in self.relay_addresses.items()]
        self.control_curve = None

    @property
    def dropped(self) -> int:
        relayed = sum(relay.dropped for relay in self.relays)
        return self.io.dropped + self.exec.dropped + self.data.dropped + relayed

    def hello(self, role: str) -> Hello:
        gpu = device_uuid(gpu_index()) if torch.cuda.is_available() else ""
        launched = int(os.environ.get(STAND_IN, os.getpid()))  # what torchrun started
        return Hello(self.group, self.rank, self.world_size, self.local_rank, os.getpid(),
                     self.host, role, self.data.address, gpu, launched,
                     os.environ.get(SPAWN_ENV, ""))

    def data_client(self) -> DataClient:
        # named without this rank's tag: every producer it pulls from sees the name, and the
        # tag is what the controller takes for proof that a socket is this rank's
        identity = f"{self.group}/{self.rank}/pull/{secrets.token_hex(8)}"
        return DataClient(self.data_ctx, self.secret, identity, self.host, self.segments,
                          self.transfer_timeout, self.transport, self.curve,
                          own=(self.data.address, self.store.get), gone=self.gone)

    def keep(self, call: Call, value: Any) -> Result:
        """Keep a result in the object store (it may be passed to another group) and send
        the controller its schema, with the value itself when it is small."""
        if value is None:
            return Result(call.call_id, self.rank)
        value = storable(value)
        try:
            schema = schema_of(value)  # (a batch's column the data plane cannot move)
        except TypeError as e:
            raise TypeError(f"{call.method} returned a value that cannot be sent: {e}") from e
        raw, inline = NONE, not codec.encodes_past(value, INLINE_LIMIT)  # (not by encoding)
        if inline:
            try:
                raw = msgspec.Raw(codec.encode(value))
            except (TypeError, ValueError, OverflowError) as e:  # (an int past 64 bits)
                raise TypeError(f"{call.method} returned a value that cannot be sent: {e}") \
                    from e
            if len(raw) > INLINE_LIMIT:  # long lists, strings...: measured encoded
                raw, inline = NONE, False
        self.store.put(call.call_id, value, schema.nbytes)
        return Result(call.call_id, self.rank, value=raw, schema=schema, inline=inline)

    def send_fetched(self, obj_id: int) -> None:
        """A stored value for a driver that awaits it, on the fetch thread. Its large arrays
        go as raw frames, neither copied nor hashed, on a socket of their own (and a ZeroMQ
        context of its own: CURVE encrypts on the context's I/O thread): the io thread's
        heartbeats never wait for a GPU copy or queue behind gigabytes."""
        frames: list[Any] = []
        if self.fetch_sock is None:
            bind_gpu()  # before any copy off a GPU: else a context on GPU 0 for every rank
        try:
            body, frames = codec.encode_oob(self.store.get(obj_id))
            reply = Fetched(obj_id, self.rank, value=msgspec.Raw(body),
                            buffers=[f.nbytes for f in frames])
            parts = len(in_parts(frames)) if self.curve else len(frames)  # (as sent)
            if parts > MAX_FETCHED_ARRAYS:  # the controller's reader would drop it (the
                reply = Fetched(obj_id, self.rank, error=(  # driver then waited for a
                    f"object {obj_id} holds {len(frames)} arrays of "  # TransferTimeout)
                    f"{codec.OOB_MIN_BYTES} bytes or more, {parts} parts as sent, past the "
                    f"{MAX_FETCHED_ARRAYS} one value may send to the driver; stack them into "
                    f"fewer arrays"))
                frames = []
        except KeyError:
            reply = Fetched(obj_id, self.rank, missing=True, error=(
                f"object {obj_id} is not held by {self.group}:{self.rank}"))
        except Exception as e:  # noqa: BLE001 - e.g. a value that cannot be sent
            reply = Fetched(obj_id, self.rank, error=f"{type(e).__name__}: {e}")
        try:
            self._fetch_socket().send(reply, frames)
        except Exception as e:  # noqa: BLE001 - the driver's await must hear of it (frames
            traceback.print_exc()  # that could not be sent; else this raises too, printed)
            self._fetch_socket().send(Fetched(obj_id, self.rank, error=(
                f"sending it failed on {self.group}:{self.rank}: {type(e).__name__}: {e}")))

    def _fetch_socket(self) -> RankSocket:
        if self.fetch_sock is None:  # straight to the controller: a host relay forwards
            # signed messages only, and this is the one that has raw frames
            bind_gpu()
            identity = f"{self.group}/{self.rank}/fetch/{self.tag}".encode()
            self.fetch_sock = RankSocket(zmq.Context(), self.address, identity, self.secret,
                                         curve=self.curve)
        return self.fetch_sock

    # -- exec thread ----------------------------------------------------------------------
    def exec_loop(self) -> None:
        bind_gpu()
        ex = _Executor(self, self.exec)
        self.calls_loop = ex.loop
        ex.sock.send(self.hello("exec"))
        sock = ex.sock
        while True:
            # one tuple, so the io thread's heartbeat reads a consistent picture
            self.exec_seen = (time.monotonic(), sock.heard, sock.received)
            msg = sock.recv(-1)
            self.exec_seen = (0.0, sock.heard, sock.received)
            try:
                if isinstance(msg, Call):
                    ex.run_call(msg)
                elif isinstance(msg, Construct):
                    self.taken = True  # (its heartbeats may not have come yet: a loop busy
                    ex.sock.send(self.build(msg))  # right after the spawn sends none)
            except Exception:  # noqa: BLE001 - one message must not end the in-order calls
                traceback.print_exc()

    def build(self, msg: Construct) -> Ready:
        try:
            mesh = dict(msg.mesh)
            if any(size < 1 for size in mesh.values()) or \
                    math.prod(mesh.values()) != self.world_size or len(mesh) != len(msg.mesh):
                raise ValueError(f"mesh {msg.mesh} does not lay out the group's "
                                 f"{self.world_size} ranks")
            coords = mesh_coords(tuple(msg.mesh), self.rank)
            self.dp_rank, self.dp_size = coords.get(DP_AXIS, 0), mesh.get(DP_AXIS, 1)
            (cls, *args), kwargs = codec.decode_call(msg.payload, msg.frames)
            attrs = dict(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                         group_name=self.group, mesh=mesh, coords=coords)
            self.worker = construct(cls, args, kwargs, attrs)
            self.methods = registered_methods(cls)
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            return Ready(self.rank, error=_failure(e))
        return Ready(self.rank, methods=self.methods, coords=coords)

    def run_concurrent(self, call: Call) -> None:
        ex = getattr(self.local, "executor", None)
        if ex is None:
            ex = self.local.executor = _Executor(self, self.concurrent_socket())
        ex.run_call(call)

    def concurrent_socket(self) -> RankSocket:
        """This pool thread's socket, made once (kept even when its executor failed to
        start): the ROUTER ignores a second socket of the same identity, and a Result sent
        on one would never be read."""
        sock = getattr(self.local, "sock", None)
        if sock is None:
            bind_gpu()
            sock = self.local.sock = self.socket(f"c{threading.get_ident()}")
            if not self.relay_addresses:  # (its heartbeats say how many it sent: lost.py)
                self.concurrent_socks.append(sock)
        return sock

    def call_starts(self) -> bool:
        with self._settled:
            if self.closing:
                return False
            self._running += 1
            return True

    def call_ended(self) -> None:
        with self._settled:
            self._running -= 1
            self._settled.notify_all()

    def settle(self, timeout: float) -> bool:
        """Let no call start, and wait up to `timeout` for those under way to end."""
        with self._settled:
            self.closing = True
            return self._settled.wait_for(lambda: self._running == 0, timeout)

    # -- I/O thread -----------------------------------------------------------------------
    def run_beside(self, call: Call) -> None:
        """A concurrent=True call: run it on the pool, beside the in-order calls."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(CONCURRENT_THREADS,
                                           thread_name_prefix="asyncrl-concurrent")
        ran = self.pool.submit(self.run_concurrent, call)
        ran.add_done_callback(_said_if_failed)
        self.beside.append((call, ran))

    def answer_unstarted(self) -> None:
        """Concurrent calls that failed before they ran (their thread's GPU or socket): no
        Result went from their thread, and the call waited for ever; one goes from here."""
        for call, ran in [(c, r) for c, r in self.beside if r.done()]:
            self.beside.remove((call, ran))
            if (e := ran.exception()) is not None:
                self.io.send(Result(call.call_id, self.rank, error=_failure(e)))

    def on_io(self, msg: Any) -> None:
        """A message on the io socket (not Shutdown)."""
        if isinstance(msg, Call):
            self.run_beside(msg)
        elif isinstance(msg, Release):
            self.store.free(msg.obj_ids)
        elif isinstance(msg, Fetch):
            self.fetcher.submit(self.send_fetched, msg.obj_id)
        elif isinstance(msg, Heartbeat):
            self.stamp_heard = msg.stamp
        elif isinstance(msg, PeersGone):
            self.gone.add(msg)
            # links with it too (links made later, with a respawned group of that name,
            # are joined by calls that come after this on the same socket)
            nccl.forget_group(msg.group)
            self.data.group_gone(msg.group)

    def heartbeat(self, now: float) -> Heartbeat:
        waiting_since, heard, received = self.exec_seen
        return Heartbeat(self.dropped, len(self.store), self.store.nbytes, heard, received,
                         now - waiting_since if waiting_since else 0.0, self.exec.sent,
                         stamp_heard=self.stamp_heard, io_heard=self.io.heard,
                         io_received=self.io.received,
                         relays=[relay.counts for relay in self.relays],
                         concurrent=[(s.identity.split(b"/")[2].decode(), s.sent)
                                     for s in list(self.concurrent_socks)])

    def serve(self) -> int:
        self.io.send(self.hello("io"))
        threading.Thread(target=self.exec_loop, name="asyncrl-exec", daemon=True).start()
        interval_ms = max(1, int(self.hb_interval * 1000))
        last_heard = next_beat = time.monotonic()
        waiting = False  # for a controller that is silent but runs (said once)
        while True:
            msg = self.io.recv(max(0, int((next_beat - time.monotonic()) * 1000)) or 0)
            now = time.monotonic()
            if msg is not None:
                last_heard, self.taken = now, True
                if isinstance(msg, Shutdown):
                    return 0
                try:
                    self.on_io(msg)
                except Exception:  # noqa: BLE001 - one message's failure (no thread to be
                    traceback.print_exc()  # had) must not end the heartbeats and Shutdown
            if self.beside:
                self.answer_unstarted()
            if now >= next_beat:
                self.io.send(self.heartbeat(now))
                next_beat = now + interval_ms / 1000
            if now - last_heard > self.hb_timeout:
                # a controller here that runs, and that took this rank (it has heard from
                # it): its loop is busy (a node's own work on it), not gone; for a while
                if self.taken and self.controller and runs(self.controller) and \
                        now - last_heard < max(self.hb_timeout, collective_timeout()):
                    if not waiting:
                        print(f"[asyncrl] {self.group}:{self.rank}: no heartbeat from the "
                              f"controller for {now - last_heard:.1f}s, but its process runs: "
                              f"waiting for it", file=sys.stderr, flush=True)
                    waiting = True
                    continue
                limit = max(self.hb_timeout, collective_timeout()) if waiting else \
                    self.hb_timeout  # (its process ran: it waited up to the longer)
                gone = "" if now - last_heard >= limit else ", and its process is gone"
                print(f"[asyncrl] {self.group}:{self.rank}: no heartbeat from the controller for "
                      f"{now - last_heard:.1f}s (limit {limit:g}s){gone}; exiting",
                      file=sys.stderr, flush=True)
                return EXIT_CONTROLLER_LOST
            waiting = False


def collective_timeout() -> float:
    """Seconds a collective may wait (the Controller's collective_timeout)."""
    return float(os.environ.get("ASYNCRL_COLLECTIVE_TIMEOUT", "600"))


def _init_distributed() -> None:
    timeout = datetime.timedelta(seconds=collective_timeout())
    # groups made later (a device mesh's dimensions, a user's new_group) take these, not
    # torch's 30 minutes
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    if torch.cuda.is_available():
        bind_gpu()
        # a collective past its timeout ends this process (the NCCL watchdog): the
        # supervisor reports the death, instead of a rank blocked in a kernel forever
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def pin_cpus() -> int:
    """Keep this rank on the cores its group was placed on (ASYNCRL_CPUS): its share of
    them, or one it shares when the group has fewer cores than ranks. Returns how many."""
    cores = [int(c) for c in os.environ.get("ASYNCRL_CPUS", "").split(",") if c]
    if not cores or not hasattr(os, "sched_setaffinity"):
        return 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    nprocs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = cores[local::nprocs] or [cores[local % len(cores)]]
    os.sched_setaffinity(0, mine)
    return len(mine)


def main() -> None:
    # a SIGINT ends the rank (torchrun passes one on at Ctrl-C), also where the process was
    # started with it ignored (a background job of a shell: Python then leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_on_sigterm()
    # as `ps` shows every rank, forked (asyncrl/actors/rank_fork.py) or started anew
    set_title(f"{sys.executable} -m asyncrl.actors.rank_main [{os.environ.get('ASYNCRL_GROUP')}"
              f" rank {os.environ.get('RANK')}]")
    os.nice(int(os.environ.get("ASYNCRL_NICE", "0")))  # the group's `nice`: 0 by default
    raise_open_file_limit()  # a segment kept costs two descriptors (1024 ran out at ~450)
    check_gpus(select_gpus())  # a cluster group's GPUs on this host, before CUDA reads it
    cores = pin_cpus()
    torch.set_num_threads(int(os.environ.get("ASYNCRL_THREADS", str(cores))))
    set_gloo_interface(os.environ)  # a group over hosts: gloo on the host's address
    _init_distributed()
    rank = RankMain()
    # used by the output thread alone; a context of its own, ended at exit: its last lines
    # leave before os._exit (which ends zmq's I/O thread with what it still holds)
    log_socket = rank.log_socket = rank.socket("log", rank.log_ctx)
    # never blocking: with the controller gone, a full queue must not stop the prints
    output = OutputCapture(lambda lines, dropped: log_socket.send(Log(lines, dropped),
                                                                  block=False))
    output.start()
    faulthandler.enable(all_threads=False)  # a crash's traceback: through the tee to the log
    debugger.install()  # breakpoint() waits for `asyncrl attach` instead of hanging silently
    code = 1
    try:  # every way out goes through _exit (a SIGINT torchrun passes on, sys.exit in
        code = rank.serve()  # on_close): this rank's shared memory unlinked, its last lines
        _close(rank, code, output)  # sent, and no pool thread waited for
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:  # as Python: sys.exit() is 0, sys.exit("why") says it, 1
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001 - said in its log, then out
        traceback.print_exc()
    finally:
        _exit(rank, code, output)


def _close(rank: RankMain, code: int, output: OutputCapture) -> None:
    """Let the calls under way settle, then the worker's on_close."""
    # no call starts now; on_close comes after the last one (a reward's pool closed under a
    # running score), a call that runs on (a collective whose peers are gone) waited for
    # within half the controller's shutdown grace (on_close gets the other half)
    closes = rank.worker is not None and type(rank.worker).on_close is not Worker.on_close
    wait = min(CALLS_SETTLE_S, float(os.environ.get("ASYNCRL_SHUTDOWN_GRACE", "10")) / 2)
    settled = rank.settle(wait if closes else 0.0)
    if not settled and closes:
        print(f"[asyncrl] {rank.group}:{rank.rank}: a call still ran {wait:g} s after the "
              f"group closed; on_close() runs beside it", file=sys.stderr, flush=True)
    if rank.worker is not None:
        # on_close may wait in a collective whose peers are gone (and with the controller
        # gone nobody kills this rank): past the collective timeout, it exits all the same
        watchdog = threading.Timer(collective_timeout(), _on_close_hung, (rank, code, output))
        watchdog.daemon = True
        watchdog.start()
        try:
            closed = rank.worker.on_close()
            if inspect.isawaitable(closed):  # async def: on the calls' loop, idle once they
                # settled (one still running: a loop of its own)
                loop = rank.calls_loop if settled and rank.calls_loop else asyncio.new_event_loop()
                loop.run_until_complete(closed)
        except Exception:  # noqa: BLE001 - the rank exits anyway: say why in its log
            traceback.print_exc()
        watchdog.cancel()


def _said_if_failed(done: Any) -> None:
    """A concurrent call that failed outside the call itself (its thread's GPU or socket):
    no Result could go, so its traceback goes to the rank's log (the pool dropped it)."""
    if done.exception() is not None:
        traceback.print_exception(done.exception())


def _on_close_hung(rank: RankMain, code: int, output: OutputCapture) -> None:
    print(f"[asyncrl] {rank.group}:{rank.rank}: on_close() did not return within "
          f"{collective_timeout():g} s; exiting", file=sys.stderr, flush=True)
    _exit(rank, code, output)


def _exit(rank: RankMain, code: int, output: OutputCapture | None = None) -> None:
    try:
        rank.segments.close()  # unlink this rank's shared memory: os._exit runs no finalizer
        sys.stdout.flush()
        sys.stderr.flush()
        # the last lines are sent, and leave (within the socket's linger, 2 s) once the
        # output thread, the socket's only user, has ended
        if output is not None and output.close() and rank.log_socket is not None:
            rank.log_socket.close()
            rank.log_ctx.term()
        for relay in rank.relays:
            relay.close()
    finally:  # (a second SIGINT, a failure above: still no wait for user threads)
        os._exit(code)  # user threads may be blocked in collectives: do not wait for them


if __name__ == "__main__":
    main()
