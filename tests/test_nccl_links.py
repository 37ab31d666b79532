"""NCCL links across their lifetime, on stubs in this process: a link's making that a pull
is bound to, its set-up, why it was aborted, the data server's sender thread per link; and
CUDA IPC rows a dead producer left (asyncrl/comm/nccl.py, dataserver.py, dataplane.py,
cuda_ipc.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
from helpers import wait_until

import asyncrl
from asyncrl.comm import cuda_ipc, dataplane, dataserver, messages, nccl
from asyncrl.comm.auth import Signer, Verifier
from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.channel import open_frame
from asyncrl.comm.gone import GonePeers
from asyncrl.comm.messages import Column, IpcRows, PeersGone, Pull, Pulled
from asyncrl.comm.remote import Piece, RemoteBatch, Shard

SECRET = b"k" * 32
ROWS = IpcRows(0, b"h", 64, 0, b"r", 0, None, False, "float32", (2,), (1,), 0, "GPU-x")


class Comm:
    """A communicator that records what is posted on it; its transfers are done at once."""

    def __init__(self, on_post=None):
        self.posted: list[tuple[str, int, int]] = []
        self.aborts = 0
        self.on_post = on_post

    def send(self, ptr, count, dtype, peer, stream):
        self._post("send", count, peer)

    def recv(self, ptr, count, dtype, peer, stream):
        self._post("recv", count, peer)

    def _post(self, kind: str, count: int, peer: int) -> None:
        self.posted.append((kind, count, peer))
        if self.on_post is not None:
            self.on_post()

    def wait_all(self, timeout):
        return True

    def abort(self):
        self.aborts += 1


@pytest.fixture
def stub_nccl(monkeypatch):
    """NCCL as nccl.backend(): groups that do nothing, communicators of Comm; every link
    made in the test dropped after it."""
    stub = SimpleNamespace(groupStart=lambda: None, groupEnd=lambda: None, NCCL_UINT8=1,
                           NcclCommunicator=lambda world, uid, rank: Comm())
    monkeypatch.setattr(nccl, "backend", lambda: stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (CPU ends)
    yield stub
    nccl._links.clear()
    nccl._aborted.clear()


def made(key: str, uid: bytes) -> nccl.Link:
    """`key`'s end on this rank (the producer, rank 0 of 2), set up from `uid`."""
    end = nccl.Link(Comm(), {"A": 0, key.split("->")[1]: 1}, threading.Lock(), uid=uid)
    end.connected.set()
    nccl._links[key] = end
    return end


class Puller:
    """A consumer rank's socket to a data server, that sends pulls and reads answers."""

    def __init__(self, ctx: zmq.Context, server: dataserver.DataServer, identity: bytes):
        self.sock, self.identity, self.addr = ctx.socket(zmq.DEALER), identity, server.address
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(server.address)
        self.signer, self.verifier = Signer(SECRET), Verifier(SECRET)

    def send(self, req: Pull) -> None:
        self.sock.send_multipart(self.signer.sign(self.identity + b"@" + self.addr.encode(),
                                                  messages.encode(req)))

    def answer(self, req: Pull) -> Pulled:
        assert self.sock.poll(20_000), f"no answer to pull {req.xfer_id}"
        reply = open_frame(self.verifier, b">" + self.identity, self.sock.recv_multipart())
        assert isinstance(reply, Pulled) and reply.xfer_id == req.xfer_id, reply
        return reply

    def pull(self, req: Pull) -> Pulled:
        self.send(req)
        return self.answer(req)


def term(ctx: zmq.Context) -> None:
    """End the context: it waits for every socket of it to be closed (bounded here)."""
    ending = threading.Thread(target=ctx.term, daemon=True)
    ending.start()
    ending.join(10)
    assert not ending.is_alive(), "a socket of the data server was left open"


def test_a_pull_left_queued_for_an_old_making_of_a_link_never_goes_on_the_new_one(
        stub_nccl):
    """A consumer whose pull failed part-way aborts its end; the producer, not told, kept
    the pull's other buckets queued on its sender thread, and sent them on whatever link had
    the name by then: set up again, its communicator took them ahead of the next pull's
    (counts mismatched: a hang, or every bucket shifted by one). A pull now names the making
    of the link it was posted for (its uid); one made since refuses it, sending nothing."""
    old = made("A->B", b"old")
    nccl._links.pop("A->B")
    nccl._abort(old, "set up again for another call")
    new = made("A->B", b"new")
    store = {1: TensorBatch({"x": torch.arange(4.0)})}
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", SECRET, store.__getitem__, "A:0",
                                  "asyncrl-test-", timeout=5.0)
    puller = Puller(ctx, server, b"B/0/pull0")
    try:
        stale = puller.pull(Pull(1, 1, 0, 2, nccl=["x"], nccl_key="A->B", nccl_uid=b"old"))
        assert "set up again since this pull" in stale.error and new.comm.posted == []
        fresh = puller.pull(Pull(2, 1, 0, 2, nccl=["x"], nccl_key="A->B", nccl_uid=b"new"))
        assert not fresh.error and new.comm.posted == [("send", 8, 1)]  # 2 float32 rows
        assert old.comm.posted == []
        legacy = puller.pull(Pull(3, 1, 2, 4, nccl=["x"], nccl_key="A->B"))  # no uid: any
        assert not legacy.error and new.comm.posted[-1] == ("send", 8, 1)
    finally:
        puller.sock.close(0)
        server.group_gone("B")
        term(ctx)


def test_a_pull_without_a_link_uid_decodes_as_one_for_any_making():
    """A Pull as a rank of before the uid sends it (its fields by position) decodes."""
    older = msgspec.msgpack.encode(["Pull", 4, 1, 0, 2, "", 0, [], [], ["x"], "A->B", True])
    assert messages.decode(older) == Pull(4, 1, 0, 2, nccl=["x"], nccl_key="A->B",
                                          no_lists=True, nccl_uid=b"")
    bound = Pull(4, 1, 0, 2, nccl=["x"], nccl_key="A->B", nccl_uid=b"\x01u")
    assert messages.decode(messages.encode(bound)).nccl_uid == b"\x01u"


def test_a_link_is_used_by_no_call_before_its_set_up_byte_moved(stub_nccl):
    """join() put the new link where calls find it before its set-up transfer: a call
    already running could post its receives first, and the set-up byte met a bucket's
    receive. Calls now see the link only once its set-up is done."""
    seen: list[tuple[bool, str]] = []

    def look() -> None:  # at the set-up's own transfer
        try:
            found = f"found {nccl.link('A->B').uid!r}"
        except LookupError as e:
            found = str(e)
        seen.append((nccl.has("A->B"), found))
    comm = Comm(look)
    stub_nccl.NcclCommunicator = lambda world, uid, rank: comm
    nccl.join("A->B", b"uid", 3, 0, {"A": 0, "B": 1})  # this rank: A's, sending to B's two
    assert comm.posted == [("send", 1, 1), ("send", 1, 2)]
    assert all(not has and "no NCCL communicator 'A->B'" in found for has, found in seen), seen
    assert len(seen) == 2
    assert nccl.has("A->B") and nccl.link("A->B").uid == b"uid"


class TriedEvent(threading.Event):
    """A link's `connected`, with an event set once some thread waited on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


class TriedLock:
    """nccl._sending as it is, with an event set once some thread tried to take it."""

    def __init__(self) -> None:
        self.lock, self.tried = threading.Lock(), threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.tried.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()


def test_a_pull_that_comes_while_its_link_is_set_up_waits_for_the_set_up(stub_nccl,
                                                                          monkeypatch):
    """A consumer may finish its end's set-up before this producer does (its byte came),
    and pull: the pull waits on the link's sender thread for the set-up (which holds the
    send lock), then goes; a pull naming no link of this rank is refused at once."""
    sending = TriedLock()
    monkeypatch.setattr(nccl, "_sending", sending)
    end = made("A->B", b"u")
    end.connected = TriedEvent()  # its set-up in progress, holding this process's send
    store = {1: TensorBatch({"x": torch.arange(4.0)})}
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", SECRET, store.__getitem__, "A:0",
                                  "asyncrl-test-", timeout=5.0)
    puller = Puller(ctx, server, b"B/0/pull0")
    sending.lock.acquire()
    try:
        assert "no NCCL communicator 'A->C'" in puller.pull(
            Pull(1, 1, 0, 2, nccl=["x"], nccl_key="A->C")).error
        assert "A->C" not in server._senders  # (no thread for it)
        req = Pull(2, 1, 0, 2, nccl=["x"], nccl_key="A->B", nccl_uid=b"u")
        puller.send(req)
        assert end.connected.waited.wait(20)  # the send waits for the set-up
        assert not sending.tried.is_set()  # (it did not take the send lock before it)
        end.connected.set()
        sending.lock.release()
        assert not puller.answer(req).error and end.comm.posted == [("send", 8, 1)]
    finally:
        if sending.lock.locked() and not end.connected.is_set():
            sending.lock.release()
        puller.sock.close(0)
        server.group_gone("B")
        term(ctx)


def test_a_data_servers_sender_threads_end_with_the_group_of_their_link(stub_nccl):
    """A producer's data server made a thread (and a socket) per link it sent on, and kept
    them for good: a long run that makes and closes groups piled them up. The threads of a
    gone group's links now end, their sockets closed (the context could not end else)."""
    store = {1: TensorBatch({"x": torch.arange(4.0)})}
    for key in ("A->B", "A->C", "A->D"):
        made(key, b"u")
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", SECRET, store.__getitem__, "A:0",
                                  "asyncrl-test-", timeout=5.0)
    pullers = [Puller(ctx, server, f"{g}/0/pull0".encode()) for g in "BCD"]
    try:
        for xfer, (g, puller) in enumerate(zip("BCD", pullers, strict=True)):
            assert not puller.pull(Pull(xfer, 1, 0, 2, nccl=["x"], nccl_key=f"A->{g}")).error
        threads = {k: list(e._threads) for k, e in server._senders.items()}
        assert sorted(threads) == ["A->B", "A->C", "A->D"]
        server.group_gone("B")
        server.group_gone("C")
        for thread in threads["A->B"] + threads["A->C"]:
            thread.join(10)
            assert not thread.is_alive(), "a gone group's sender thread is still there"
        assert list(server._senders) == ["A->D"] and all(t.is_alive() for t in threads["A->D"])
        assert not pullers[2].pull(Pull(9, 1, 2, 4, nccl=["x"], nccl_key="A->D")).error
    finally:
        for puller in pullers:
            puller.sock.close(0)
        server.group_gone("D")
    term(ctx)  # (each sender thread's socket closed)


def test_why_a_link_was_aborted_is_what_its_transfers_say(stub_nccl):
    """A transfer on an aborted link always said it was "set up again for another call",
    also when its peer group was gone or a transfer timed out on it: each abort now says
    why, and so do the transfers it fails."""
    gone = made("A->B", b"u")
    nccl.forget_group("B")  # (the controller said B is gone: aborted on a thread)
    wait_until(lambda: gone.comm.aborts == 1, 10, "the abort of A->B")
    with pytest.raises(RuntimeError, match=r"aborted during it \(group 'B' is gone"):
        nccl._wait("A->B", gone, "receive", 1.0)
    late = made("A->C", b"u")
    late.comm.wait_all = lambda timeout: False
    with pytest.raises(asyncrl.TransferTimeout):
        nccl.send("A->C", [torch.ones(2)], ("C", 0), 0.5)
    with pytest.raises(RuntimeError, match=r"aborted \(its send to C:0 was not done within "
                                           r"0.5 s\); nothing was posted"):
        with nccl._group(stub_nccl, "A->C", late, "receive", 1.0):
            pass
    replaced = made("A->D", b"u")
    nccl._abort(replaced, "set up again for another call")
    with pytest.raises(RuntimeError, match=r"\(set up again for another call\)"):
        nccl._wait("A->D", replaced, "receive", 1.0)


def answer_once(server: zmq.Socket, addr: str, error: str) -> None:
    """A producer's data server that answers one pull with `error`."""
    who, *frames = server.recv_multipart()
    req = open_frame(Verifier(SECRET), who + b"@" + addr.encode(), frames)
    server.send_multipart([who, *Signer(SECRET).sign(
        b">" + who, messages.encode(Pulled(req.xfer_id, error=error)))])


def test_a_producers_transfer_timeout_is_a_transfer_timeout_where_it_pulled():
    """A producer whose NCCL send timed out answers "TransferTimeout: ...": the consumer
    raised it as a RuntimeError, which `except asyncrl.TransferTimeout` missed."""
    ctx = zmq.Context()
    client = dataplane.DataClient(ctx, SECRET, "B/0", "127.0.0.1", None, timeout=10)
    server = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    answer = threading.Thread(target=answer_once, args=(
        server, addr, "TransferTimeout: NCCL send to B:0 on 'A->B' not done within 5 s"))
    answer.start()
    try:
        with pytest.raises(asyncrl.TransferTimeout, match="pull from A:0 failed: "
                                                          "TransferTimeout: NCCL send"):
            client._exchange([(Piece(Shard("A", 0, 1, addr, "127.0.0.1"), 0, 2),
                               Pull(5, 1, 0, 2, nccl=["x"], nccl_key="A->B"))],
                             lambda *_: None)
    finally:
        answer.join(10)
        client.close()
        server.close(0)
        ctx.term()


@pytest.fixture
def ipc_here(monkeypatch):
    """CUDA IPC as on a host with GPU-x, untried in this process; `opens` records each
    open of rows, which fails where `refuse` says why."""
    for name, value in (("_failed", None), ("_open_failed", False), ("_opened", False),
                        ("_visible", ["GPU-x"])):
        monkeypatch.setattr(cuda_ipc, name, value, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    opens = SimpleNamespace(tried=0, refuse="")

    def open_rows(*args):
        opens.tried += 1
        if opens.refuse:
            raise RuntimeError(opens.refuse)
        return torch.UntypedStorage(64)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(open_rows))
    return opens


def test_rows_a_dead_producer_left_fail_that_transfer_not_cuda_ipc(ipc_here, monkeypatch):
    """Any open that failed turned CUDA IPC off in the whole process: rows of a producer
    that had died (a late reply's, released) left every later pull in host memory, and no
    later reply's rows were released. Once an open succeeded here, a failure that names no
    pidfd is the rows' own: a plain error for that transfer (with expandable segments set
    too: an open went through them)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cuda_ipc._open(ROWS)  # CUDA IPC works in this process
    ipc_here.refuse = "CUDA error: invalid resource handle"
    with pytest.raises(RuntimeError, match="died or freed them") as info:
        cuda_ipc._open(ROWS)
    assert not isinstance(info.value, cuda_ipc.IpcUnavailable)
    assert cuda_ipc.usable() and not cuda_ipc._open_failed
    ipc_here.refuse = "pidfd_getfd: Operation not permitted"  # the process's own trouble
    with pytest.raises(cuda_ipc.IpcUnavailable, match="expandable_segments"):
        cuda_ipc._open(ROWS)
    assert cuda_ipc._open_failed


def test_a_first_open_that_fails_still_turns_cuda_ipc_off(ipc_here):
    ipc_here.refuse = "CUDA error: invalid argument"  # no open ever worked here
    with pytest.raises(cuda_ipc.IpcUnavailable, match="could not open"):
        cuda_ipc._open(ROWS)
    assert cuda_ipc._open_failed


def test_late_rows_of_a_dead_producer_are_not_opened(ipc_here):
    """A pull's late replies were drained (their rows opened, to be released) before the
    sockets of dead producers were closed: their rows, freed with the producer, failed to
    open. The dead producers' sockets are now closed first."""
    gone = GonePeers()
    ctx = zmq.Context()
    client = dataplane.DataClient(ctx, SECRET, "B/0", "127.0.0.1", None, timeout=10,
                                  gone=gone)
    server = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        sock, signer, _, identity = client._socket(addr)
        req = Pull(7, 1, 0, 2, ipc=["x"])
        sock.send_multipart(signer.sign(identity + b"@" + addr.encode(), messages.encode(req)))
        who, *_ = server.recv_multipart()
        client._give_up_socket(addr, [req])  # timed out: kept for its late reply
        server.send_multipart([who, *Signer(SECRET).sign(b">" + who, messages.encode(
            Pulled(7, ipc={"x": ROWS})))])
        assert sock.poll(10_000)  # the late reply is in
        gone.add(PeersGone("A", [addr], 10, "died"))
        ipc_here.refuse = "CUDA error: invalid resource handle"
        client._exchange([], lambda *_: None)
        assert ipc_here.tried == 0 and client._late == []
    finally:
        client.close()
        server.close(0)
        ctx.term()


@pytest.mark.parametrize("failure", [cuda_ipc.IpcUnavailable, RuntimeError])
def test_cuda_ipc_is_not_given_up_for_a_producer_that_died(ipc_here, monkeypatch, failure):
    """A pull whose CUDA IPC failed was made again through host memory, and CUDA IPC given
    up for the process, even when its producer had just died: InputLostError now (also
    where the open failed as the rows' own trouble, a plain RuntimeError)."""
    gone, ctx = GonePeers(), zmq.Context()
    client = dataplane.DataClient(ctx, SECRET, "B/0", "h", None, 10, gone=gone)
    shard = Shard("A", 0, 3, "tcp://h:1", "h", "GPU-x")
    gone.add(PeersGone("A", [shard.addr], 10, "died"))

    def pull(self, rb):
        raise failure("CUDA IPC could not open GPU rows")
    monkeypatch.setattr(dataplane.DataClient, "_pull_rows", pull)
    rb = RemoteBatch([Piece(shard, 0, 2)], (Column("x", "float32", (), "cuda"),))
    try:
        with pytest.raises(asyncrl.InputLostError, match="group 'A' died"):
            client._fetch_rows(rb)
        assert cuda_ipc.usable()
    finally:
        client.close()
        ctx.term()


def test_a_gone_groups_links_are_dropped_before_their_abort_runs(stub_nccl, monkeypatch):
    """forget_group dropped the links on the thread that aborts them: a late pull of the gone
    group, before that thread ran, found its link and started a sender thread that nothing
    ended (group_gone had run). The links go at once now; only the abort is left behind."""
    started: list = []

    class Held:  # the abort thread, not started: the links as the caller leaves them
        def __init__(self, target, **_):
            started.append(target)

        def start(self) -> None:
            pass
    monkeypatch.setattr(nccl.threading, "Thread", Held)
    gone = made("A->B", b"u")
    made("A->C", b"v")
    nccl.forget_group("B")
    assert not nccl.has("A->B", connecting=True) and nccl.has("A->C")
    assert nccl.aborted() == {"A->B": b"u"} and len(started) == 1
    started[0]()  # the abort itself, as its thread runs it
    assert gone.aborted and "group 'B' is gone" in gone.why
    assert not nccl._links["A->C"].aborted
