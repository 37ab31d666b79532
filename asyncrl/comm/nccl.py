"""NCCL through CuPy: GPU rows sent from a producer rank to a consumer rank on another host.

    controller: first call of group B that pulls GPU columns from group A's results
      └─ uid from A's rank 0 (get_unique_id there: its NCCL bootstrap root runs where the
         ranks reach it, and the controller needs no CuPy); every rank of A and B joins one
         communicator
         (A's ranks first, then B's), kept per ordered pair of groups: A sends, B receives;
         each of A's ranks sends each of B's a byte there (NCCL connects a pair at its
         first transfer, where the host waits unbounded: here, while the controller waits
         for the joins within its timeout)
    consumer (B rank c): Pull(nccl=[columns], nccl_key) to producer rank p, then posts the
      receives for every bucket it asked for, as one NCCL group (no order between producers
      can deadlock it)
    producer (A rank p, the data server's thread for this link): sends the rows to c, waits
      for the link's stream with a bound, then answers Pulled (so an answer means the bytes
      are there)

Each end of a communicator has its own CUDA stream, as torch's ProcessGroupNCCL does: it
waits for the work queued so far on the caller's stream (which made the rows, or last used
the memory received into), never for work queued later, so a sync neither waits behind nor
holds up the generation or training that keeps running on the default stream.

One communicator per direction: one thread of the producer's data server only sends on it
(a thread per communicator, one send at a time in the process: a send waiting for a
receiver that gave up holds up no pull by shared memory or sockets), the consumer's call
threads only receive (under a lock). NCCL allows no two threads to issue calls at once to
one communicator, nor to two on one device (its guide, "Thread Safety"), and CuPy's abort
frees the communicator with no lock: so every group, groupStart to groupEnd, holds one lock
of the process (`_calls`), and so does every abort. That lock is held for a bounded time
only: a groupEnd may wait on the host for a peer (NCCL connects a pair there, at its first
transfer), so each group has a watchdog that aborts its link past the transfer timeout, and
an abort of the very link whose groupEnd has held the lock over a second does not wait for
the lock (an abort is the one way NCCL ends that wait; nothing else runs NCCL meanwhile:
the lock is still held). Waits for a lock are bounded too (TransferTimeout naming the link).
A send or receive that does not finish within the transfer timeout aborts the communicator
(NCCL cannot be interrupted otherwise), and a transfer still waiting on the aborted one fails
(its kernels end without moving the bytes). A rank's error reply names the links it aborted
(`aborted()`, each with the id it was made from): the controller sets up those again, and
keeps the others, which calls may still be using. A pull names the making of the link it
was posted for (its uid): a producer never sends one left in its queue on a link set up
again since (it would take a later pull's receives), and a link is used by no call before
its set-up byte moved. When the controller announces a group dead or closed (PeersGone),
every link with it is aborted at once: a send to a receiver that died ends then, not at the
timeout. A transfer failed by an abort says why the link was aborted.

Imports CuPy only when a communicator is made. `ASYNCRL_NCCL_MODULE` names another module
with the same API (cupy.cuda.nccl's get_unique_id, NcclCommunicator, groupStart/groupEnd,
NCCL_UINT8): the CPU tests use one that moves bytes over sockets. On a GPU only a 1-rank
CuPy communicator has run (one H200, session 26); NCCL between two GPUs never has: no machine
with two GPUs was lent.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.comm.codec import byte_view
from asyncrl.errors import TransferTimeout

MODULE_ENV = "ASYNCRL_NCCL_MODULE"


def backend() -> Any:
    """cupy.cuda.nccl, or the module ASYNCRL_NCCL_MODULE names."""
    name = os.environ.get(MODULE_ENV, "cupy.cuda.nccl")
    hint = "GPU transfers between hosts use NCCL through CuPy: install cupy-cuda12x (or " \
           "cupy-cuda13x) and nvidia-nccl-cu12 (or -cu13)"
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{hint} ({e})") from e
    if not getattr(module, "available", True):  # CuPy imports it even without libnccl
        raise ImportError(f"{hint}: {name} imported, but found no NCCL library")
    return module


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (CuPy >= 14 gives bytes; older CuPy a tuple of signed chars)."""
    uid = backend().get_unique_id()
    return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)


def _communicator(nccl: Any, world: int, uid: bytes, rank: int) -> Any:
    try:
        return nccl.NcclCommunicator(world, uid, rank)
    except TypeError:  # CuPy < 14 takes the id as a tuple of C chars (converted before it
        pass  # calls NCCL, so a refused one set nothing up)
    try:  # signed where char is (x86-64)
        return nccl.NcclCommunicator(world, tuple(b - 256 if b > 127 else b for b in uid),
                                     rank)
    except OverflowError:  # unsigned where char is (aarch64: cupy#9430)
        return nccl.NcclCommunicator(world, tuple(uid), rank)


@dataclass
class Link:
    """One rank's end of the communicator of an ordered pair of groups."""

    comm: Any
    offsets: dict[str, int]  # group -> the communicator rank of its rank 0
    lock: threading.Lock
    stream: Any = None  # its torch.cuda.Stream on a GPU (None on CPUs: the stand-in's own)
    aborted: bool = False  # an aborted communicator's kernels end without moving the bytes
    uid: bytes = b""  # the unique id it was made from: which making of the link it is
    # set once its set-up transfer is done (only then do calls use it), or it is aborted
    connected: threading.Event = field(default_factory=threading.Event)
    why: str = ""  # why it was aborted (said by the transfers it fails)


_links: dict[str, Link] = {}  # key ("A->B") -> this rank's end
_aborted: dict[str, bytes] = {}  # key -> uid: ends this rank gave up and has not made again
_guard = threading.Lock()
_sending = threading.Lock()  # one send at a time in the process, held until its wait ends
_calls = threading.Lock()  # every NCCL group of the process, groupStart to groupEnd, and aborts
_ending_guard = threading.Lock()
_ending: tuple[Link, float] | None = None  # the link whose groupEnd holds _calls, since when
STUCK_S = 1.0  # a groupEnd this long waits for a peer: only an abort of its link ends it


def join(key: str, uid: bytes, world: int, rank: int, offsets: dict[str, int]) -> None:
    """Make this rank's end of communicator `key` (blocks until all `world` ranks joined)."""
    nccl = backend()
    stream = None
    if torch.cuda.is_available():  # the communicator is on this thread's device (bind_gpu)
        stream = torch.cuda.Stream(torch.cuda.current_device())
    comm = _communicator(nccl, world, uid, rank)
    end = Link(comm, dict(offsets), threading.Lock(), stream, uid=uid)
    with _guard:  # has() and link() say no until its set-up byte moved: a receive posted
        # before it would take that byte, and its pull's rows would come a bucket late
        old = _links.pop(key, None)
        _links[key] = end
        _aborted.pop(key, None)
    if old is not None:
        _abort(old, "set up again for another call")
    _connect(key, end, rank, world)


def _connect(key: str, end: Link, me: int, world: int) -> None:
    """A byte from each producer rank to each consumer rank: NCCL connects a pair at its
    first transfer, inside groupEnd, where the host waits for the peer; done here, within
    the transfer timeout (the group's watchdog), no later send waits there. A link whose
    set-up failed is dropped: its pairs may not all be connected."""
    timeout = _transfer_timeout()
    first = end.offsets[key.split("->")[1]]  # the consumer group's first communicator rank
    sends = me < first
    peers = range(first, world) if sends else range(0, min(first, world))
    move = end.comm.send if sends else end.comm.recv
    device = torch.device("cuda", torch.cuda.current_device()) if end.stream is not None \
        else torch.device("cpu")
    bytes_ = [torch.zeros(1, dtype=torch.uint8, device=device) for _ in peers]
    nccl = backend()
    try:  # (one send at a time in a process, as send(): two communicators' kernels at
        # once may deadlock each other)
        with _held(_sending, timeout, key, "connecting", _SENDS_HELD) if sends \
                else contextlib.nullcontext():
            with _on_stream(end, bytes_) as stream, _group(nccl, key, end, "connecting",
                                                            timeout):
                for peer, byte in zip(peers, bytes_, strict=True):
                    move(byte.data_ptr(), 1, nccl.NCCL_UINT8, peer, stream)
            _wait(key, end, "connecting", timeout)
            end.connected.set()
    except BaseException:
        forget(key, end, "its set-up failed")
        raise


def _transfer_timeout() -> float:
    return float(os.environ.get("ASYNCRL_TRANSFER_TIMEOUT", "60"))


def has(key: str, connecting: bool = False) -> bool:
    """Whether this rank's end of `key` is set up (its set-up transfer done; `connecting`:
    or still being set up)."""
    with _guard:
        found = _links.get(key)
    return found is not None and (connecting or found.connected.is_set())


def link(key: str) -> Link:
    with _guard:
        found = _links.get(key)
    if found is None or not found.connected.is_set():
        raise no_link(key)
    return found


def no_link(key: str) -> LookupError:
    return LookupError(f"no NCCL communicator {key!r} on this rank: the controller sets one "
                       f"up before the first call that needs it")


def forget(key: str, end: Link | None = None, why: str = "given up on this rank") -> None:
    """Drop this rank's end of `key`, aborted for the reason `why` (only if it is still
    `end`: a send that timed out on a communicator that was replaced meanwhile must not
    abort the new one)."""
    with _guard:
        old = _links.get(key)
        if old is None or (end is not None and old is not end):
            return
        del _links[key]
        _aborted[key] = old.uid
    _abort(old, why)


def aborted() -> dict[str, bytes]:
    """The links this rank aborted and has not joined again, by key, with their uids."""
    with _guard:
        return dict(_aborted)


def forget_group(group: str) -> None:
    """Drop every link to or from `group`, dead or closed: its ranks will never post the
    matching calls, so a send or receive waiting on one ends now (its communicator aborted),
    not at the transfer timeout, and frees this process's one NCCL send for other links."""
    with _guard:  # dropped now (a late pull of the group finds no link, starts no sender)
        ends = [(k, end) for k, end in _links.items() if group in k.split("->")]
        for key, end in ends:
            del _links[key]
            _aborted[key] = end.uid

    def abort_them() -> None:
        for _, end in ends:
            _abort(end, f"group {group!r} is gone (dead or closed)")

    if ends:  # the ends as they are now; aborted beside the caller (the rank's io thread,
        # which keeps its heartbeats going: an abort may take a while)
        threading.Thread(target=abort_them, daemon=True, name="asyncrl-nccl-abort").start()


def _abort(found: Link, why: str) -> None:
    """Abort `found`'s communicator, holding _calls (CuPy frees it: no NCCL call of this
    process may run meanwhile). A groupEnd of `found` itself that holds _calls over
    STUCK_S waits for a peer: aborted at once, the only way out (nothing else runs NCCL:
    the lock is held; its thread clears `_ending` only once the abort is done)."""
    if not found.aborted:
        found.why = why
    found.aborted = True  # no new group starts on it
    found.connected.set()  # (a send waiting for its set-up goes on, to fail)
    while not _calls.acquire(timeout=0.1):  # (every holder lets go within its timeout)
        with _ending_guard:
            if _ending is not None and _ending[0] is found and \
                    time.monotonic() - _ending[1] > STUCK_S:
                _abort_comm(found)
                return
    try:
        _abort_comm(found)
    finally:
        _calls.release()


def _abort_comm(found: Link) -> None:
    try:
        found.comm.abort()
    except Exception:  # noqa: BLE001 - a broken communicator may refuse even that
        pass


_SENDS_HELD = "this process's NCCL send (one at a time) was busy all that time: another " \
              "link's send or set-up waited for its peer"
_GROUP_HELD = "another thread of this process was in an NCCL group all that time (one at a " \
              "time per process: NCCL's thread safety), waiting for its peer"


@contextmanager
def _held(lock: threading.Lock, timeout: float, key: str, what: str,
          why: str) -> Iterator[None]:
    if not lock.acquire(timeout=max(0.0, timeout)):
        raise TransferTimeout(f"NCCL {what} on {key!r} could not start within {timeout:g} s: "
                              f"{why}")
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _group(nccl: Any, key: str, end: Link, what: str, timeout: float) -> Iterator[None]:
    """One NCCL group on `end`, groupStart to groupEnd (always ended: a call that raised
    inside would leave this thread's later groups nested in it, never launched), holding
    _calls; a groupEnd past `timeout` has its link aborted (TransferTimeout)."""
    global _ending
    with _held(_calls, timeout, key, what, _GROUP_HELD):
        if end.aborted:
            raise RuntimeError(f"NCCL {what} on {key!r}: the communicator was aborted "
                               f"({end.why}); nothing was posted")
        nccl.groupStart()
        try:
            yield
        finally:
            fired = threading.Event()

            def give_up() -> None:
                fired.set()
                forget(key, end, f"its {what} waited for its peer over {timeout:g} s")
            watchdog = threading.Timer(timeout, give_up)
            watchdog.daemon = True
            with _ending_guard:
                _ending = (end, time.monotonic())
            watchdog.start()
            try:
                nccl.groupEnd()
            except Exception as e:
                if fired.is_set():
                    raise TransferTimeout(f"NCCL {what} on {key!r}: its groupEnd waited for "
                                          f"its peer over {timeout:g} s; the communicator "
                                          f"was aborted") from e
                raise
            finally:
                watchdog.cancel()
                with _ending_guard:
                    _ending = None


@contextmanager
def _on_stream(end: Link, tensors: list[torch.Tensor]) -> Iterator[int]:
    """Run NCCL calls on the link's stream, after the work the caller's stream has queued on
    `tensors`; yields the stream's handle for CuPy (0 on CPUs)."""
    if end.stream is None:
        yield 0
        return
    end.stream.wait_stream(torch.cuda.current_stream())
    for t in tensors:  # their memory stays reserved until the link's stream is done
        if t.is_cuda:
            t.record_stream(end.stream)
    with torch.cuda.stream(end.stream):
        yield end.stream.cuda_stream


def _wait(key: str, end: Link, what: str, timeout: float) -> None:
    """Wait for the link's stream with a bound; abort the communicator past it. One aborted
    meanwhile (set up again for another call) fails the transfer: its bytes did not move."""
    if end.stream is not None:
        event = torch.cuda.Event()
        event.record(end.stream)
        deadline = time.monotonic() + timeout
        while not event.query():
            if time.monotonic() > deadline:
                break
            time.sleep(0.0005)
        else:
            _check_not_aborted(key, end, what)
            return
    elif end.comm.wait_all(timeout):  # the CPU stand-in's stream (tests/fake_nccl.py)
        _check_not_aborted(key, end, what)
        return
    forget(key, end, f"its {what} was not done within {timeout:g} s")
    raise TransferTimeout(f"NCCL {what} on {key!r} not done within {timeout:g} s; the "
                          f"communicator was aborted")


def _check_not_aborted(key: str, end: Link, what: str) -> None:
    if end.aborted:
        raise RuntimeError(f"NCCL {what} on {key!r}: the communicator was aborted during it "
                           f"({end.why}); the transfer did not complete")


def send(key: str, tensors: list[torch.Tensor], to: tuple[str, int], timeout: float,
         uid: bytes = b"") -> None:
    """Producer side: send `tensors` (rows already cut) to rank `to` = (group, rank), on
    the making of link `key` from `uid` (the one the pull was posted for; b"": any). One
    send at a time in a process, whatever its communicator: NCCL kernels of two
    communicators live on one GPU at once may deadlock each other (NCCL's guide)."""
    what = f"send to {to[0]}:{to[1]}"
    with _guard:
        found = _links.get(key)
    if found is None:  # refused at once, not once the send lock is free
        raise no_link(key)
    if not found.connected.wait(timeout):  # a consumer may pull once its own end is set up
        raise TransferTimeout(f"NCCL {what} on {key!r}: its set-up on this rank was not done "
                              f"within {timeout:g} s; nothing sent")
    with _held(_sending, timeout, key, what, _SENDS_HELD):
        end, nccl = link(key), backend()
        if uid and end.uid != uid:  # a pull its consumer gave up, left in this rank's
            # queue: on the new communicator its rows would take a later pull's receive
            raise RuntimeError(f"NCCL {what} on {key!r}: the link was set up again since "
                               f"this pull was made (its consumer gave it up); nothing sent")
        peer = end.offsets[to[0]] + to[1]
        with _on_stream(end, tensors) as stream:
            flats = [byte_view(t) for t in tensors]  # alive until the stream is done with them
            with _group(nccl, key, end, what, timeout):
                for flat in flats:
                    if flat.numel():
                        end.comm.send(flat.data_ptr(), flat.numel(), nccl.NCCL_UINT8, peer,
                                      stream)
        _wait(key, end, what, timeout)


def receive(key: str, end: Link, wanted: list[tuple[tuple[str, int], torch.Tensor]],
            timeout: float | None = None) -> None:
    """Consumer side, holding `end.lock` from before its pulls were sent until `finish`: post
    a receive for each (producer (group, rank), destination rows), as one NCCL group (within
    `timeout`, by default the rank's transfer timeout)."""
    nccl, timeout = backend(), _transfer_timeout() if timeout is None else timeout
    with _on_stream(end, [dst for _, dst in wanted]) as stream, \
            _group(nccl, key, end, "receive", timeout):
        for (group, rank), dst in wanted:
            if dst.numel():
                flat = dst.view(-1).view(torch.uint8)  # contiguous rows of a fresh tensor
                end.comm.recv(flat.data_ptr(), flat.numel(), nccl.NCCL_UINT8,
                              end.offsets[group] + rank, stream)


def finish(key: str, end: Link, timeout: float) -> None:
    """After every producer answered: wait for the receives, with a bound (the host waits,
    so the caller's stream may use the rows at once)."""
    _wait(key, end, "receive", timeout)
