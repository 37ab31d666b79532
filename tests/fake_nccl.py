"""A stand-in for cupy.cuda.nccl on CPU machines (ASYNCRL_NCCL_MODULE=fake_nccl): the same
calls asyncrl/comm/nccl.py makes — get_unique_id, NcclCommunicator(world, uid, rank) with
send/recv(ptr, count, dtype, peer, stream) and abort, groupStart/groupEnd, NCCL_UINT8 — with
the bytes at `ptr` (a CPU tensor's memory) carried over ZeroMQ sockets between the ranks.

Like NCCL (through CuPy):
- creation blocks until all ranks joined (NCCL waits for ever; this gives up after 60 s, so
  a test whose peer never comes fails instead of hanging);
- groups nest per thread: the calls between groupStart and groupEnd are issued at the
  outermost groupEnd; a call that fails inside a group fails that group's groupEnd too,
  which drops its calls and still closes the group (NCCL's group error); a thread left
  inside a group (a groupEnd missed) has its later calls queued there, never issued;
- a pair of ranks connects at its first transfer, inside groupEnd, where the host waits
  until the peer posts its own first transfer of that pair (until an abort ends it);
- sends and receives run in the background, in order, on the communicator's one "stream" (a
  thread); a send reads its bytes when it runs there (as a kernel would), not when posted;
  a receive takes the next message from its peer, and a send is done only once its
  receiver took it (as NCCL's, whose kernels end when the peer's matching receive has the
  bytes): a send to a receiver that never posts one waits until the communicator is aborted;
- both sides must agree on count and datatype: a receive that does not match its send waits
  until an abort, as NCCL may hang (the mismatch is noted in MISMATCHES and on stderr);
- calls on an aborted communicator, a peer out of range or an unknown datatype raise
  NcclError (CuPy passes a null communicator once aborted: NCCL refuses it);
- thread safety: NCCL allows no two threads in calls at once on one device (its guide's
  "Thread Safety"). Each communicator is on the device its creating thread `use_device`d
  (0 unless a test says otherwise: threads standing in for other processes); a group started
  while another thread of that device is in one raises, and an abort while another thread
  is in a group (except one waiting in that communicator's own groupEnd, which only an abort
  ends) is noted in OVERLAPS.
asyncrl waits for a CPU stream with `wait_all(timeout)`, which only this module has (on GPUs
it records a CUDA event instead).

FAKE_NCCL_CONNECT_S=S (tests): a pair's connection in groupEnd takes S seconds more.
FAKE_NCCL_HOLD=PATH (tests): a receive of more than a byte waits until PATH exists, and
writes PATH.waiting meanwhile: its sender stays in the middle of its send.
"""

from __future__ import annotations

import ctypes
import os
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import deque

import zmq

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_FLOAT16, NCCL_FLOAT32 = 0, 1, 2, 6, 7
_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}  # CuPy's NCCL_* codes
CALLS: list[tuple[str, int, int, int]] = []  # this process's sends and receives, posted
MISMATCHES: list[str] = []  # receives whose send had another count or datatype
OVERLAPS: list[str] = []  # NCCL calls of two threads of one device at once
_group = threading.local()
_device = threading.local()
_inside: dict[int, tuple[int, list]] = {}  # thread -> (device, comms in its groupEnd)
_inside_lock = threading.Lock()


def _root() -> str:
    """Where communicators meet: a test's own folder (its fixture sets it), removed with it
    (read when a communicator is made: a process forked from one that imported this)."""
    return os.environ.get("ASYNCRL_FAKE_NCCL_ROOT") or os.path.join(tempfile.gettempdir(),
                                                                    "asyncrl-fake-nccl")


class NcclError(RuntimeError):  # CuPy's, with the cause instead of NCCL's generic text
    def __init__(self, status: int, why: str):
        self.status = status
        names = {2: "SYSTEM_ERROR", 4: "INVALID_ARGUMENT", 5: "INVALID_USAGE"}
        super().__init__(f"NCCL_ERROR_{names[status]}: {why}")


def use_device(index: int) -> None:
    """The calling thread's current device (tests: a thread standing in for another rank)."""
    _device.index = index


def get_unique_id() -> bytes:  # CuPy >= 14 (before: a tuple of signed chars)
    return secrets.token_bytes(128)


def groupStart() -> None:  # noqa: N802 - cupy's name
    depth = getattr(_group, "depth", 0)
    if depth == 0:
        _enter()
        _group.ops, _group.error = [], None
    _group.depth = depth + 1


def groupEnd() -> None:  # noqa: N802 - cupy's name
    if getattr(_group, "depth", 0) == 0:
        raise NcclError(5, "groupEnd without groupStart")
    _group.depth -= 1
    if _group.depth:
        return
    ops, error = _group.ops, _group.error
    _group.ops, _group.error = [], None
    comms = list({id(op[1]): op[1] for op in ops}.values())
    with _inside_lock:
        _inside[threading.get_ident()] = (_inside[threading.get_ident()][0], comms)
    try:
        if error is not None:  # the group's calls are dropped, as NCCL does
            raise NcclError(4, f"a call in this group failed: {error}")
        for comm in comms:
            comm._connect({(op[0], op[2]) for op in ops if op[1] is comm})
        for op in sorted(ops, key=lambda o: o[0] != "send"):
            op[1]._issue(op[3])
    finally:
        with _inside_lock:
            _inside.pop(threading.get_ident(), None)


def _enter() -> None:
    me, device = threading.get_ident(), getattr(_device, "index", 0)
    with _inside_lock:
        others = [t for t, (d, _) in _inside.items() if d == device and t != me]
        if others:
            OVERLAPS.append(f"a group started on device {device} while another thread was "
                            f"in one")
            raise RuntimeError("fake NCCL: two threads in NCCL calls at once on one device "
                               "(NCCL's thread safety forbids it)")
        _inside[me] = (device, [])


class NcclCommunicator:
    def __init__(self, world: int, uid: bytes, rank: int):
        if not isinstance(uid, bytes):  # as CuPy >= 14's typed argument
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(uid).__name__})")
        self.world, self.rank = world, rank
        self.device = getattr(_device, "index", 0)
        folder = os.path.join(_root(), uid[:16].hex())
        os.makedirs(folder, exist_ok=True)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        _publish(os.path.join(folder, f"rank{rank}"), f"tcp://127.0.0.1:{port}")
        addrs = [_await_file(os.path.join(folder, f"rank{r}")) for r in range(world)]
        self._push = {}  # used by the stream's thread only
        for r, addr in enumerate(addrs):
            if r != rank:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                self._push[r] = sock
        _publish(os.path.join(folder, f"done{rank}"), "1")
        if rank == 0:  # the rendezvous folder goes once everyone has read it
            for r in range(world):
                _await_file(os.path.join(folder, f"done{r}"))
            shutil.rmtree(folder, ignore_errors=True)
        self._early: dict[tuple[bytes, int], deque[tuple[bytes, bytes]]] = {}  # arrived
        self._connected: set[tuple[str, int]] = set()  # (kind, peer) pairs set up
        self._stream: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._queued = 0
        self._error: BaseException | None = None
        self._aborted = threading.Event()
        threading.Thread(target=self._run_stream, daemon=True).start()

    def _run_stream(self) -> None:
        while True:
            op = self._stream.get()
            if op is None:
                for sock in [self._pull, *self._push.values()]:
                    sock.close(0)
                self._ctx.term()
                return
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - reported by wait_all
                self._error = e
            with self._idle:
                self._queued -= 1
                self._idle.notify_all()

    def wait_all(self, timeout: float) -> bool:
        """Every send and receive issued so far is done (False: not within `timeout`)."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._queued == 0, timeout)
        if self._error is not None:
            raise RuntimeError(f"fake NCCL: {self._error}")
        return done

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        nbytes = self._check("send", count, dtype, peer)
        CALLS.append(("send", self.rank, peer, count))
        meta = f"{dtype} {count}".encode()

        def put() -> None:
            if self._aborted.is_set():  # (its memory may be gone: the sender gave up)
                raise RuntimeError("the communicator was aborted")
            data = ctypes.string_at(ptr, nbytes)  # read as the stream runs it, not at send()
            self._deliver(peer, b"data", meta, data)
            self._next(b"ack", peer)  # done once the receiver has the bytes
        _run(("send", self, peer, put))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        nbytes = self._check("recv", count, dtype, peer)
        CALLS.append(("recv", self.rank, peer, count))
        meta = f"{dtype} {count}".encode()

        def take() -> None:
            hold = os.environ.get("FAKE_NCCL_HOLD")
            if hold and count > 1:  # (rows: not the byte a link's set-up sends each pair)
                _publish(hold + ".waiting", "1")
                while not os.path.exists(hold):
                    if self._aborted.wait(0.05):
                        raise RuntimeError("the communicator was aborted")
            sent, data = self._next(b"data", peer)
            if sent != meta:  # NCCL needs the same count and datatype on both sides
                MISMATCHES.append(f"rank {self.rank} from {peer}: {sent!r} sent, {meta!r} "
                                  f"received")
                print(f"fake NCCL: rank {self.rank} posted a receive of (datatype count) "
                      f"{meta.decode()} from rank {peer}, which sent {sent.decode()}: it "
                      f"waits until an abort (NCCL may hang)", file=sys.stderr)
                self._aborted.wait()
                raise RuntimeError("the communicator was aborted")
            try:  # best effort: a sender that died meanwhile needs none (as with NCCL)
                self._push[peer].send_multipart([b"ack", str(self.rank).encode(), b"", b""],
                                                zmq.NOBLOCK)
            except zmq.Again:
                pass
            ctypes.memmove(ptr, data, nbytes)
        _run(("recv", self, peer, take))

    def _check(self, kind: str, count: int, dtype: int, peer: int) -> int:
        """The call's bytes, or NcclError as NCCL (through CuPy) refuses it (in a group:
        its groupEnd fails too)."""
        why = ""
        if self._aborted.is_set():
            why = f"{kind} on an aborted communicator (CuPy passes it as null)"
        elif dtype not in _SIZES or count < 0:
            why = f"{kind} of {count} items of datatype {dtype}"
        elif not 0 <= peer < self.world or peer == self.rank:  # (NCCL allows itself)
            why = f"{kind} with peer {peer} on rank {self.rank} of {self.world}"
        if why:
            if getattr(_group, "depth", 0):
                _group.error = why
            raise NcclError(4, why)
        return count * _SIZES[dtype]

    def _connect(self, pairs: set[tuple[str, int]]) -> None:
        """In groupEnd: NCCL connects a pair at its first transfer, the host waiting until
        the peer posts its own (a send's pair connects with the peer's receive)."""
        new = sorted(pairs - self._connected)
        if not new:
            return
        done = threading.Event()

        def hello() -> None:
            try:
                for kind, peer in new:
                    self._deliver(peer, b"hello-" + kind.encode(), b"", b"")
                for kind, peer in new:
                    self._next(b"hello-" + (b"recv" if kind == "send" else b"send"), peer)
            finally:
                done.set()
        time.sleep(float(os.environ.get("FAKE_NCCL_CONNECT_S", "0")))  # (a slow network)
        self._issue(hello)
        while not done.wait(0.05):
            pass
        if self._aborted.is_set():
            raise NcclError(2, "the communicator was aborted while connecting")
        self._connected.update(new)

    def _issue(self, op) -> None:
        with self._idle:
            if self._aborted.is_set():
                raise NcclError(4, "the communicator was aborted")
            self._queued += 1
            self._stream.put(op)

    def _deliver(self, peer: int, kind: bytes, meta: bytes, data: bytes) -> None:
        frames = [kind, str(self.rank).encode(), meta, data]
        while True:  # a peer that went away: no blocking send, so an abort still ends it
            try:
                self._push[peer].send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._aborted.wait(0.05):
                    raise RuntimeError("the communicator was aborted") from None

    def _next(self, kind: bytes, peer: int) -> tuple[bytes, bytes]:
        arrived = self._early.setdefault((kind, peer), deque())
        while not arrived:
            if self._aborted.is_set():
                raise RuntimeError("the communicator was aborted")
            if self._pull.poll(50):  # a socket belongs to one thread: this one closes it
                got, src, meta, data = self._pull.recv_multipart()
                self._early.setdefault((got, int(src)), deque()).append((meta, data))
        return arrived.popleft()

    def abort(self) -> None:
        me = threading.get_ident()
        with _inside_lock:
            if any(d == self.device and t != me and self not in comms
                   for t, (d, comms) in _inside.items()):
                OVERLAPS.append(f"an abort on device {self.device} while another thread "
                                f"was in a group")
        with self._idle:
            if self._aborted.is_set():
                return
            self._aborted.set()
            self._stream.put(None)


def _run(op: tuple) -> None:
    """A send or receive: into the thread's group, or issued now (a group of its own)."""
    if getattr(_group, "depth", 0) == 0:
        groupStart()
        try:
            _run(op)
        finally:
            groupEnd()
        return
    _group.ops.append(op)


def _publish(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _await_file(path: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake NCCL: {path} never appeared")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()
