"""asyncrl/comm/nccl.py's groups, locks and aborts across threads, on tests/fake_nccl.py in
this process: this process's end of each link is asyncrl's (device 0), and each peer rank is
a thread standing in for its own process (its own device). NCCL forbids two threads in calls
at once on one device, a group left open swallows the thread's later calls, and a pair's
first groupEnd waits on the host for its peer: the fake does all three."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import fake_nccl
import pytest
import torch
from helpers import wait_until

import asyncrl
from asyncrl.comm import nccl

ROWS = torch.arange(16, dtype=torch.uint8) * 3


@pytest.fixture
def peers(monkeypatch, tmp_path):
    """Start peer ranks; every communicator is aborted after the test."""
    monkeypatch.setenv("ASYNCRL_NCCL_MODULE", "fake_nccl")
    monkeypatch.setenv("ASYNCRL_FAKE_NCCL_ROOT", str(tmp_path / "nccl"))
    monkeypatch.setenv("ASYNCRL_TRANSFER_TIMEOUT", "2")  # a set-up's bound
    fake_nccl.OVERLAPS.clear()
    fake_nccl._inside.clear()  # (a thread an earlier test left in a group is gone)
    made: list[Peer] = []
    yield made
    for key in list(nccl._links):
        nccl.forget(key)
    for peer in made:
        peer.comm_made.wait(5)
        if peer.comm is not None:
            peer.comm.abort()
    nccl._aborted.clear()


class TriedLock:
    """nccl._calls as it is, noting each thread that tries to take it: a test waits for a
    thread to be at the lock (not a sleep); one that skips the lock never shows up."""

    def __init__(self, lock: threading.Lock):
        self.lock, self.tried, self.changed = lock, set(), threading.Condition()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self.changed:
            self.tried.add(threading.current_thread().name)
            self.changed.notify_all()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def wait_tried(self, thread: str, timeout: float = 10) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: thread in self.tried, timeout)


@pytest.fixture
def calls(monkeypatch) -> TriedLock:
    """Installed before any link is made: every holder of the lock goes through it."""
    tried = TriedLock(nccl._calls)
    monkeypatch.setattr(nccl, "_calls", tried)
    return tried


class Peer:
    """One rank of the other group, on a thread of its own device: makes its end of the
    communicator, then runs `script(peer, comm)`."""

    def __init__(self, made: list, device: int, uid: bytes, rank: int,
                 script: Callable[[Peer, fake_nccl.NcclCommunicator], None]):
        self.comm: fake_nccl.NcclCommunicator | None = None
        self.comm_made, self.errors = threading.Event(), []
        self.received = torch.zeros_like(ROWS)
        made.append(self)

        def run() -> None:
            fake_nccl.use_device(device)
            try:
                self.comm = fake_nccl.NcclCommunicator(2, uid, rank)
                self.comm_made.set()
                script(self, self.comm)
            except BaseException as e:  # noqa: BLE001 - the test reads it
                self.errors.append(e)
            finally:
                self.comm_made.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> list:
        self.thread.join(20)
        assert not self.thread.is_alive(), "the peer is stuck"
        return self.errors


def one_group(comm, move: str, ptr: int, count: int, peer: int) -> None:
    fake_nccl.groupStart()
    try:
        getattr(comm, move)(ptr, count, fake_nccl.NCCL_UINT8, peer, 0)
    finally:
        fake_nccl.groupEnd()
    assert comm.wait_all(10), f"{move} from/to {peer} not done"


def receiver(rows: bool) -> Callable:
    """A consumer rank (1): its link's set-up byte from rank 0, then (if `rows`) ROWS."""
    def script(peer: Peer, comm) -> None:
        byte = torch.zeros(1, dtype=torch.uint8)
        one_group(comm, "recv", byte.data_ptr(), 1, 0)
        if rows:
            one_group(comm, "recv", peer.received.data_ptr(), ROWS.numel(), 0)
    return script


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def link_to(made, key: str, device: int, rows: bool = True) -> Peer:
    """`key` ("A->B") made with this process as rank 0 (the producer) and a consumer peer."""
    uid = nccl.new_unique_id()
    peer = Peer(made, device, uid, 1, receiver(rows))
    nccl.join(key, uid, 2, 0, {key.split("->")[0]: 0, key.split("->")[1]: 1})
    return peer


def paused_sends(end: nccl.Link) -> tuple[threading.Event, threading.Event]:
    """`end`'s next send stops inside its NCCL group until `go` is set."""
    inside, go = threading.Event(), threading.Event()
    real = end.comm.send

    def send(*args) -> None:
        inside.set()
        assert go.wait(20)
        real(*args)
    end.comm.send = send
    return inside, go


def test_a_send_that_raises_inside_its_group_still_ends_the_group(peers):
    """A call raising inside a group (CuPy's on an aborted communicator, ncclRemoteError, a
    bad argument) skipped groupEnd: the data server's sender thread for that link stayed a
    group deep, and its later sends were queued there, never launched (each pull timed out,
    its link aborted and made again, for ever). Now groupEnd always runs: the same thread's
    send on the link made again gets through."""
    def producer() -> None:  # one thread, as a link's sender thread
        link_to(peers, "A->B", 1, rows=False)
        nccl.link("A->B").comm.abort()  # behind the link's back: its sends raise
        with pytest.raises(RuntimeError, match="aborted"):
            nccl.send("A->B", [ROWS], ("B", 0), 5)
        again = link_to(peers, "A->B", 2)  # set up again, as the controller does
        nccl.send("A->B", [ROWS], ("B", 0), 5)
        return again
    thread, out = in_thread(producer)
    thread.join(30)
    assert not thread.is_alive() and "error" not in out, out
    assert out["value"].done() == [] and torch.equal(out["value"].received, ROWS)


def test_no_two_threads_of_a_process_are_in_nccl_groups_at_once(peers, calls):
    """NCCL forbids issuing calls from two threads at once to communicators of one device;
    a producer's sender thread and a call thread receiving on another link did. Every
    group now holds the process's NCCL lock from groupStart to groupEnd."""
    link_to(peers, "A->B", 1)
    uid = nccl.new_unique_id()

    def producer_c(peer: Peer, comm) -> None:  # group C's rank 0: the set-up byte, then its rows
        byte = torch.zeros(1, dtype=torch.uint8)
        one_group(comm, "send", byte.data_ptr(), 1, 1)
        one_group(comm, "send", ROWS.data_ptr(), ROWS.numel(), 1)
    c = Peer(peers, 2, uid, 0, producer_c)
    nccl.join("C->A", uid, 2, 1, {"C": 0, "A": 1})  # this process consumes from C
    inside, go = paused_sends(nccl.link("A->B"))
    sending, sent = in_thread(lambda: nccl.send("A->B", [ROWS], ("B", 0), 10))
    assert inside.wait(10)  # the send is in its group
    dst = torch.zeros_like(ROWS)
    end = nccl.link("C->A")

    def receive() -> None:
        nccl.receive("C->A", end, [(("C", 0), dst)])
        nccl.finish("C->A", end, 10)
    receiving, received = in_thread(receive)
    try:  # the receive waits for the lock the send holds (one that did not take it would
        # have overlapped the send, and failed at once)
        assert calls.wait_tried(receiving.name), "the receive did not wait for the NCCL lock"
    finally:
        go.set()
    for thread in (sending, receiving):
        thread.join(20)
    assert sent == {"value": None} and received == {"value": None}, (sent, received)
    assert fake_nccl.OVERLAPS == [] and torch.equal(dst, ROWS)
    assert c.done() == [] and peers[0].done() == []


def test_an_abort_waits_for_another_threads_group_to_end(peers, calls):
    """A dead group's links were aborted from a thread of their own while the sender thread
    could be in an NCCL call on the same communicator: CuPy's abort frees it under that
    call. The abort now waits for the group in progress (bounded: every group is)."""
    link_to(peers, "A->B", 1)
    end = nccl.link("A->B")
    inside, go = paused_sends(end)
    sending, _ = in_thread(lambda: nccl.send("A->B", [ROWS], ("B", 0), 10))
    assert inside.wait(10)
    nccl.forget_group("B")  # the controller said B is gone: its links are aborted
    try:  # on a thread of its own, which waits for the lock the send holds (an abort that
        # did not would never be seen at it)
        assert calls.wait_tried("asyncrl-nccl-abort"), "the abort did not wait for the lock"
        aborted_inside = end.comm._aborted.is_set()
    finally:
        go.set()
    wait_until(end.comm._aborted.is_set, 10, "the abort")
    sending.join(20)
    assert not aborted_inside and fake_nccl.OVERLAPS == []
    assert "A->B" in nccl.aborted()


def test_a_link_whose_peer_never_connects_holds_no_other_send(peers):
    """A link's set-up waits in groupEnd until each peer posts its first transfer, and
    held this process's one NCCL send meanwhile, with no bound: every later send, to any
    consumer, waited behind it for ever. Now the set-up's groupEnd is aborted at the
    transfer timeout, and a send waits for its turn within its own timeout: it goes through
    once the set-up gave up, or fails with TransferTimeout naming its link."""
    link_to(peers, "A->B", 1)

    def stuck(key: str, device: int):  # a consumer that makes its end and never connects
        uid = nccl.new_unique_id()
        Peer(peers, device, uid, 1, lambda peer, comm: None)
        joining = in_thread(lambda: nccl.join(key, uid, 2, 0, {"A": 0, key[3:]: 1}))
        wait_until(lambda: any(comms for _, comms in fake_nccl._inside.values()), 10,
                   f"{key}'s set-up in its groupEnd")
        return joining

    (joining, joined) = stuck("A->C", 2)
    t0 = time.monotonic()
    sending, sent = in_thread(lambda: nccl.send("A->B", [ROWS], ("B", 0), 10))
    sending.join(15)
    took = time.monotonic() - t0
    assert not sending.is_alive(), "the send waited behind the stuck set-up"
    assert sent == {"value": None} and took < 8, (sent, took)
    assert peers[0].done() == [] and torch.equal(peers[0].received, ROWS)
    joining.join(10)
    assert isinstance(joined.get("error"), asyncrl.TransferTimeout), joined
    assert "'A->C'" in str(joined["error"]) and "A->C" in nccl.aborted()

    (joining, joined) = stuck("A->D", 3)
    t0 = time.monotonic()
    with pytest.raises(asyncrl.TransferTimeout, match=r"send to B:0 on 'A->B' could not "
                                                      r"start within 0.5 s"):
        nccl.send("A->B", [ROWS], ("B", 0), 0.5)
    assert time.monotonic() - t0 < 3
    joining.join(10)
    assert isinstance(joined.get("error"), asyncrl.TransferTimeout), joined
