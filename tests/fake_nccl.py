"""A stand-in for cupy.cuda.nccl on CPU machines (ASYNCRL_NCCL_MODULE=fake_nccl): the same
calls asyncrl/comm/nccl.py makes — get_unique_id, NcclCommunicator(world, uid, rank) with
send/recv(ptr, count, dtype, peer, stream) and abort, groupStart/groupEnd, NCCL_UINT8 — with
the bytes at `ptr` (a CPU tensor's memory) carried over ZeroMQ sockets between the ranks.

Like NCCL: communicator creation blocks until all ranks joined; the operations between
groupStart and groupEnd are issued together at groupEnd; sends and receives run in the
background, in order, on the communicator's one "stream" (a thread); a receive takes the next
message from its peer and a send is done only once its receiver took it (as NCCL's, whose
kernels end when the peer's matching receive has the bytes): a send to a receiver that never
posts one waits until the communicator is aborted. asyncrl waits for a CPU stream with
`wait_all(timeout)`, which only this module has (on GPUs it records a CUDA event instead).

FAKE_NCCL_HOLD=PATH (tests): a receive of more than a byte waits until PATH exists, and
writes PATH.waiting meanwhile: its sender stays in the middle of its send.
"""

from __future__ import annotations

import ctypes
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from collections import deque

import zmq

NCCL_UINT8 = 1
CALLS: list[tuple[str, int, int, int]] = []  # this process's sends and receives, posted
def _root() -> str:
    """Where communicators meet: a test's own folder (its fixture sets it), removed with it
    (read when a communicator is made: a process forked from one that imported this)."""
    return os.environ.get("ASYNCRL_FAKE_NCCL_ROOT") or os.path.join(tempfile.gettempdir(),
                                                                    "asyncrl-fake-nccl")
_group = threading.local()


def get_unique_id() -> bytes:  # CuPy >= 14 (before: a tuple of signed chars)
    return secrets.token_bytes(128)


def groupStart() -> None:  # noqa: N802 - cupy's name
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.ops = []


def groupEnd() -> None:  # noqa: N802 - cupy's name
    _group.depth -= 1
    if _group.depth == 0:
        ops, _group.ops = _group.ops, []
        for op in sorted(ops, key=lambda o: o[0] != "send"):
            op[1]()


def _run(kind: str, fn) -> None:
    if getattr(_group, "depth", 0) > 0:
        _group.ops.append((kind, fn))
    else:
        fn()


class NcclCommunicator:
    def __init__(self, world: int, uid: bytes, rank: int):
        if not isinstance(uid, bytes):  # as CuPy >= 14's typed argument
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(uid).__name__})")
        self.world, self.rank = world, rank
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
        self._early: dict[tuple[bytes, int], deque[bytes]] = {}  # (kind, peer) -> arrived
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
        CALLS.append(("send", self.rank, peer, count))
        data = ctypes.string_at(ptr, count)  # copied now, as a stream would read it

        def put() -> None:
            self._deliver(peer, data)
            self._next(b"ack", peer)  # done once the receiver has the bytes
        _run("send", lambda: self._issue(put))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        CALLS.append(("recv", self.rank, peer, count))

        def take() -> None:
            hold = os.environ.get("FAKE_NCCL_HOLD")
            if hold and count > 1:  # (rows: not the byte a link's set-up sends each pair)
                _publish(hold + ".waiting", "1")
                while not os.path.exists(hold):
                    if self._aborted.wait(0.05):
                        raise RuntimeError("the communicator was aborted")
            data = self._next(b"data", peer)
            try:  # best effort: a sender that died meanwhile needs none (as with NCCL)
                self._push[peer].send_multipart([b"ack", str(self.rank).encode(), b""],
                                                zmq.NOBLOCK)
            except zmq.Again:
                pass
            if len(data) != count:
                raise RuntimeError(f"{len(data)} bytes from {peer}, {count} posted")
            ctypes.memmove(ptr, data, count)
        _run("recv", lambda: self._issue(take))

    def _issue(self, op) -> None:
        with self._idle:
            self._queued += 1
        self._stream.put(op)

    def _deliver(self, peer: int, data: bytes) -> None:
        frames = [b"data", str(self.rank).encode(), data]
        while True:  # a peer that went away: no blocking send, so an abort still ends it
            try:
                self._push[peer].send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._aborted.wait(0.05):
                    raise RuntimeError("the communicator was aborted") from None

    def _next(self, kind: bytes, peer: int) -> bytes:
        queue = self._early.setdefault((kind, peer), deque())
        while not queue:
            if self._aborted.is_set():
                raise RuntimeError("the communicator was aborted")
            if self._pull.poll(50):  # a socket belongs to one thread: this one closes it
                got, src, data = self._pull.recv_multipart()
                self._early.setdefault((got, int(src)), deque()).append(data)
        return queue.popleft()

    def abort(self) -> None:
        self._aborted.set()
        self._stream.put(None)


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
