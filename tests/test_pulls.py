"""A rank's data client against a scripted producer on a real socket: late replies, replies
to pulls given up, frames of the wrong size, a producer whose group died."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq
from helpers import assert_gone, group_pids, poll_until, run, wait_until
from zmq.utils.monitor import recv_monitor_message

import asyncrl
from asyncrl.comm import codec, dataplane, dataserver, messages
from asyncrl.comm.auth import Signer, Verifier
from asyncrl.comm.channel import open_frame
from asyncrl.comm.gone import GonePeers
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue, Shard

SECRET = b"k" * 32
GPU_ROWS = messages.IpcRows(0, b"h", 64, 0, b"r", 0, None, False, "float32", (2,), (1,), 0,
                            "GPU-x")


class Producer:
    """A ROUTER socket playing a producer rank's data server, its script on a thread."""

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.signer, self.verifier = Signer(SECRET), Verifier(SECRET)
        self.shard = Shard("prod", 0, 1, self.addr, "127.0.0.1")
        self.thread: threading.Thread | None = None

    def pull(self) -> tuple[bytes, messages.Pull]:
        who, *frames = self.sock.recv_multipart()
        return who, open_frame(self.verifier, who + b"@" + self.addr.encode(), frames)

    def answer(self, who: bytes, reply: messages.Pulled, *raw: bytes) -> None:
        self.sock.send_multipart([who, *self.signer.sign(b">" + who, messages.encode(reply)),
                                  *raw])

    def play(self, script: Callable[[], None]) -> None:
        self.thread = threading.Thread(target=script, daemon=True)
        self.thread.start()


@pytest.fixture
def scripted() -> Iterator[tuple[zmq.Context, Producer, list]]:
    """A context, a scripted producer, and the clients a test makes (closed after it)."""
    ctx = zmq.Context()
    producer = Producer(ctx)
    clients: list[dataplane.DataClient] = []
    yield ctx, producer, clients
    if producer.thread is not None:
        producer.thread.join(10)
    for client in clients:
        client.close()
    producer.sock.close(0)
    ctx.term()


def client_of(scripted, timeout: float, gone: GonePeers | None = None) -> dataplane.DataClient:
    ctx, _, clients = scripted
    clients.append(dataplane.DataClient(ctx, SECRET, "cons/0", "127.0.0.1", None,
                                        timeout=timeout, gone=gone))
    return clients[-1]


def test_gpu_rows_in_a_reply_after_a_transfer_timeout_are_released(monkeypatch, scripted):
    """A producer that answers a CUDA IPC pull only after the consumer's TransferTimeout:
    the reply's rows are still opened and closed (at the consumer's next pull), so the
    producer's GPU block is freed; then that socket is closed. A timed-out pull of bytes is
    not waited for: its socket is closed at once."""
    released: list = []
    monkeypatch.setattr(dataplane.cuda_ipc, "release", released.append)
    _, producer, _ = scripted
    timed_out, stop = [threading.Event(), threading.Event()], threading.Event()

    def script():
        for late in timed_out:  # a pull of bytes, then one of GPU rows: both answered late
            who, req = producer.pull()
            late.wait(30)
            producer.answer(who, messages.Pulled(req.xfer_id,
                                                 ipc={"x": GPU_ROWS} if req.ipc else {}))
        while not stop.is_set():  # later fetches, answered at once
            if producer.sock.poll(100):
                who, req = producer.pull()
                producer.answer(who, messages.Pulled(req.xfer_id,
                                                     value=msgspec.Raw(codec.encode(7))))

    producer.play(script)
    client = client_of(scripted, timeout=0.3)
    try:
        for n, ipc in enumerate(([], ["x"])):
            req = messages.Pull(100 + n, 1, 0, 1, ipc=ipc)
            with pytest.raises(asyncrl.TransferTimeout, match="no answer from prod"):
                client._exchange([(Piece(producer.shard, 0, 1), req)], lambda *_: None)
            timed_out[n].set()  # the late reply goes to the socket given up
            assert len(client._late) == n  # kept only for the IPC pull
        client._timeout = 10  # the later pulls must succeed, on a loaded host too
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:  # each later pull drains it
            assert client.fetch_value(RemoteValue(producer.shard)) == 7  # a socket of its own
        assert released == [GPU_ROWS] and client._late == []  # all answered: closed
    finally:
        stop.set()


def test_gpu_rows_in_a_reply_to_a_pull_given_up_are_released(monkeypatch, scripted):
    """A reply that arrives after its pull was given up (another pull of the same fetch
    failed) may hold CUDA IPC handles: the consumer still releases them, or the producer
    keeps their GPU block until it exits. The failed fetch gives the other pulls' socket up
    (it stayed in use, a late reply waiting in it for whichever pull came next); a socket
    that owes no GPU rows is closed at once."""
    released: list = []
    monkeypatch.setattr(dataplane.cuda_ipc, "release", released.append)
    _, producer, _ = scripted
    stop = threading.Event()

    def script():
        for ipc in (["x"], []):
            (who, first), (_, second) = producer.pull(), producer.pull()  # one fetch, two
            # an error that came with rows exported before it: released at once
            producer.answer(who, messages.Pulled(first.xfer_id, error="LookupError: gone",
                                                 ipc={"x": GPU_ROWS} if ipc else {}))
            producer.answer(who, messages.Pulled(second.xfer_id,  # after it
                                                 ipc={"x": GPU_ROWS} if ipc else {}))
        while not stop.is_set():  # later fetches, answered at once
            if producer.sock.poll(100):
                who, req = producer.pull()
                producer.answer(who, messages.Pulled(req.xfer_id,
                                                     value=msgspec.Raw(codec.encode(7))))

    producer.play(script)
    client = client_of(scripted, timeout=10)
    try:
        for n, ipc in enumerate((["x"], [])):
            two = [(Piece(producer.shard, 0, 1), messages.Pull(10 + 2 * n, 1, 0, 1, ipc=ipc)),
                   (Piece(producer.shard, 1, 2), messages.Pull(11 + 2 * n, 1, 1, 2, ipc=ipc))]
            with pytest.raises(RuntimeError, match="LookupError: gone"):
                client._exchange(two, lambda *_: None)
            assert producer.addr not in client._socks  # given up, not reused
            if n == 0:  # the error's rows released; the socket kept for the late reply's
                assert released == [GPU_ROWS] and [r.owed for r in client._late] == [{11}]
            else:  # one that owes no GPU rows: closed (the first may be drained by now)
                assert all(r.owed <= {11} for r in client._late)
        deadline = time.monotonic() + 10
        while len(released) < 2 and time.monotonic() < deadline:  # each pull drains it
            assert client.fetch_value(RemoteValue(producer.shard)) == 7  # a socket of its own
        assert released == [GPU_ROWS, GPU_ROWS] and client._late == []
    finally:
        stop.set()


def test_pulled_frames_must_fill_their_rows_and_no_pool_means_process_memory(scripted):
    """A client without a segment pool builds its columns in its own memory (they were left
    uninitialised), and a frame of the wrong size is refused (numpy would have broadcast a
    short one over the rows), and so is a reply that leaves a column out."""
    _, producer, _ = scripted
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)

    def script():
        for short in (False, True):
            who, req = producer.pull()
            rows = x[req.start:req.stop].numpy().tobytes()
            producer.answer(who, messages.Pulled(req.xfer_id, buffers=["x"]),
                            rows[:4] if short else rows)
        who, req = producer.pull()  # a column left out: its rows would be stale bytes
        producer.answer(who, messages.Pulled(req.xfer_id, buffers=[]))

    producer.play(script)
    client = client_of(scripted, timeout=10)
    batch = RemoteBatch([Piece(producer.shard, 0, 3)], [messages.Column("x", "float32", (2,))])
    assert torch.equal(client.fetch_batch(batch)["x"], x)
    with pytest.raises(RuntimeError, match="column 'x' came with 4 bytes, 24 expected"):
        client.fetch_batch(batch)
    with pytest.raises(RuntimeError, match=r"the reply lacks column\(s\) \['x'\]"):
        client.fetch_batch(batch)


def test_a_pull_from_a_producer_declared_dead_fails_at_once_naming_it(scripted):
    """The producer never answers (its rank died); once the rank hears of the death
    (`PeersGone`, from the controller, on another thread) a pull already waiting gives up
    with InputLostError naming the group and the cause, long before its transfer timeout,
    and so does a later one. The announcement covers only objects of earlier calls, and only
    that group: a respawned group on the same port, or another group, is still pulled."""
    _, producer, _ = scripted
    gone = GonePeers()
    waiting = threading.Event()

    def script():
        producer.pull()  # the pull is on its way; never answered
        waiting.set()
        who, req = producer.pull()  # a respawned group's object, on the same port
        producer.answer(who, messages.Pulled(req.xfer_id, value=msgspec.Raw(codec.encode(7))))
        who, req = producer.pull()  # another group's, on the same port
        producer.answer(who, messages.Pulled(req.xfer_id, value=msgspec.Raw(codec.encode(8))))

    producer.play(script)
    client = client_of(scripted, timeout=60, gone=gone)
    announcer = threading.Thread(target=lambda: waiting.wait(30) and gone.add(
        messages.PeersGone("prod", [producer.addr], 5, "is dead: its process is gone")))
    announcer.start()
    with pytest.raises(asyncrl.InputLostError) as info:  # not a TransferTimeout after 60 s
        client.fetch_value(RemoteValue(producer.shard))  # object 1, below 5
    announcer.join()
    assert str(info.value) == ("cannot pull a whole value of object 1 from prod:0: group 'prod' "
                               "is dead: its process is gone; its results are gone with it: "
                               "make them again")
    # a later pull of that group's objects is not even sent (the script would answer it)
    with pytest.raises(asyncrl.InputLostError, match="rows 0:2 of object 3 from prod:0"):
        client.fetch_batch(RemoteBatch([Piece(Shard("prod", 0, 3, producer.addr, "h"), 0, 2)],
                                       [messages.Column("x", "list")]))
    assert client.fetch_value(RemoteValue(Shard("prod", 0, 5, producer.addr, "h"))) == 7
    assert client.fetch_value(RemoteValue(Shard("other", 0, 2, producer.addr, "h"))) == 8


def test_a_dead_groups_sockets_are_closed_at_the_next_pull(scripted):
    """A rank kept a socket to every producer it ever pulled from: a dead group's went on
    reconnecting, and a long run's restarts piled them up towards zmq's socket limit."""
    _, producer, _ = scripted
    gone = GonePeers()

    def script():
        for value in (7, 9):
            who, req = producer.pull()
            producer.answer(who, messages.Pulled(req.xfer_id,
                                                 value=msgspec.Raw(codec.encode(value))))

    producer.play(script)
    client = client_of(scripted, timeout=60, gone=gone)
    assert client.fetch_value(RemoteValue(producer.shard)) == 7
    old = client._socks[producer.addr][0]
    ctx, _, _ = scripted  # and one kept for a timed-out CUDA IPC pull's late reply
    retired = dataplane._Retired(ctx.socket(zmq.DEALER), Verifier(SECRET), b"x", {3},
                                 producer.addr)
    client._late.append(retired)
    gone.add(messages.PeersGone("prod", [producer.addr], 5, "is dead: its process is gone"))
    # a respawned group's object on the same port: pulled through a socket of its own
    assert client.fetch_value(RemoteValue(Shard("prod", 0, 6, producer.addr, "h"))) == 9
    assert old.closed and client._socks[producer.addr][0] is not old
    assert retired.sock.closed and client._late == []


def test_the_data_server_drops_a_peer_that_sends_an_oversized_frame():
    """Pulls are small: a frame over the limit closes its connection before it is buffered
    whole (no MAC is checked before the whole message is in), and the server goes on."""
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", SECRET, {}.__getitem__, "maker:0",
                                   "asyncrl-test-")
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    events = big.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        big.connect(server.address)
        assert events.poll(10_000) and recv_monitor_message(events)["event"] == \
            zmq.EVENT_CONNECTED
        big.send_multipart([b"x" * (dataserver.MAX_PULL_BYTES + 1), b"mac", b"body"])
        assert events.poll(10_000), "the server kept the connection of an oversized frame"
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        small.connect(server.address)
        small.send_multipart([b"not", b"signed", b"right"])
        wait_until(lambda: server.dropped == 1, 10, "the small frame to be dropped")
        assert server.rejected == 0
    finally:
        big.disable_monitor()
        for sock in (events, big, small):
            sock.close(0)
        server.close()


def test_buckets_that_come_as_frames_are_asked_for_a_window_at_a_time(monkeypatch, scripted):
    """Over a socket, a producer's buckets are asked FRAMES_WINDOW at a time (each answer
    asks the next): all at once, every frame would wait in ZeroMQ's queue beside the batch
    being filled, twice the batch's memory."""
    monkeypatch.setattr(dataplane, "BUCKET_BYTES", 8)  # one 8-byte row a bucket
    monkeypatch.setattr(dataplane, "FRAMES_WINDOW", 2)
    _, producer, _ = scripted
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    most: list[int] = []

    def script():
        asked = [producer.pull() for _ in range(2)]
        # nothing answered: a third ask breaks the window whenever it comes (a wide margin)
        most.append(len(asked) + producer.sock.poll(1500))
        received = 2
        while asked:
            most.append(len(asked) + producer.sock.poll(100))  # a third would be here by now
            who, req = asked.pop(0)
            producer.answer(who, messages.Pulled(req.xfer_id, buffers=["x"]),
                            x[req.start:req.stop].numpy().tobytes())
            if received < 6:  # the answer asks the next
                asked.append(producer.pull())
                received += 1

    producer.play(script)
    client = client_of(scripted, timeout=10)
    batch = RemoteBatch([Piece(producer.shard, 0, 6)], [messages.Column("x", "float32", (2,))])
    assert torch.equal(client.fetch_batch(batch)["x"], x)
    assert most == [2, 2, 2, 2, 2, 2, 1]  # never more than two asked and unanswered


def test_rows_pulled_over_a_slow_link_are_given_time_for_their_bytes(monkeypatch, scripted):
    """A reply of many bytes (a wide row: a weight pack) is heard of only once all of it
    came; the pull timed out at transfer_timeout of silence however many were on their
    way (a 14 GB pack over 1 GbE needs ~2 minutes, the timeout is 60 s)."""
    _, producer, _ = scripted
    rows = 1000  # 8000 bytes: 5 s worth at the slowest rate counted on (here)
    monkeypatch.setattr(dataplane, "LINK_MIN_RATE", rows * 8 / 5)
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)

    def script():
        who, req = producer.pull()
        time.sleep(0.6)  # the slow link: its bytes still on their way past the timeout
        producer.answer(who, messages.Pulled(req.xfer_id, buffers=["x"]),
                        x[req.start:req.stop].numpy().tobytes())

    producer.play(script)
    client = client_of(scripted, timeout=0.2)
    batch = RemoteBatch([Piece(producer.shard, 0, rows)],
                        [messages.Column("x", "float32", (2,))])
    assert torch.equal(client.fetch_batch(batch)["x"], x)


def test_a_whole_value_pulled_over_a_slow_link_is_given_time_for_its_bytes(monkeypatch,
                                                                          scripted):
    """A whole value (not a batch) pulled from another group was given transfer_timeout of
    silence however many bytes were on their way: gigabytes over a slow link timed out
    every time, still arriving. Its bytes come with its reference (schema.nbytes)."""
    from types import SimpleNamespace

    from asyncrl.controller.objects import ObjectRef

    _, producer, _ = scripted
    monkeypatch.setattr(dataplane, "LINK_MIN_RATE", 1000.0)  # its 5000 bytes: worth 5 s
    group = SimpleNamespace(name="prod", ranks={0: SimpleNamespace(
        data_addr=producer.addr, host="127.0.0.1", gpu="")}, _ctl=SimpleNamespace(
        releases=SimpleNamespace(later=lambda *_: None)))
    stored = ObjectRef(group, 1, lambda parts: parts[0],
                       {0: messages.Schema(-1, nbytes=5000)}, {})
    ref = codec.decode(codec.encode(stored.view()))  # as the controller sends it on
    assert ref.shard == producer.shard and ref.nbytes == 5000

    def script():
        who, req = producer.pull()
        time.sleep(0.6)  # the slow link: its bytes still on their way past the timeout
        body, frames = codec.encode_oob([1, 2])
        producer.answer(who, messages.Pulled(req.xfer_id, value=msgspec.Raw(body)), *frames)

    producer.play(script)
    client = client_of(scripted, timeout=0.2)
    assert client.fetch_value(ref) == [1, 2]


def test_a_big_result_fetched_over_a_slow_link_is_given_time_for_its_bytes():
    """The driver's fetch timed out at transfer_timeout however many bytes were still on
    their way; the answer came, was decoded and thrown away, and the next await asked for
    it all again."""
    import asyncio

    from asyncrl.comm import codec
    from asyncrl.comm.channel import LINK_MIN_RATE
    from asyncrl.controller.fetches import Fetches

    async def main():
        loop = asyncio.get_running_loop()
        fetches = Fetches("g", loop, lambda rank, msg: None, timeout=0.05)
        with pytest.raises(asyncrl.TransferTimeout, match="no answer within 0.05 s"):
            await fetches.get(0, 1)  # small: the transfer timeout alone
        body, frames = codec.encode_oob([1, 2])
        loop.call_later(0.3, fetches.answered, messages.Fetched(
            2, 0, value=msgspec.Raw(body), buffers=[f.nbytes for f in frames]))
        return await fetches.get(0, 2, nbytes=int(LINK_MIN_RATE))  # a second's worth
    assert asyncio.run(main()) == [1, 2]


def test_a_fetch_timed_out_by_its_last_awaiter_is_let_go_and_asked_again_when_awaited():
    """A timed-out fetch kept its waiter until the group's end (one per timeout); one
    awaiter's timeout beside another still waiting keeps it, and the next await asks again."""
    import asyncio

    from asyncrl.comm import codec
    from asyncrl.controller.fetches import Fetches

    async def main():
        loop = asyncio.get_running_loop()
        asked = []
        fetches = Fetches("g", loop, lambda rank, msg: asked.append(msg.obj_id), timeout=0.05)
        with pytest.raises(asyncrl.TransferTimeout):
            await fetches.get(0, 1)
        assert fetches._waiters == {} and fetches._awaiting == {}  # let go
        patient = loop.create_task(asyncio.wait_for(fetches.get(0, 2, nbytes=10**9), 30))
        with pytest.raises(asyncrl.TransferTimeout):  # (the patient one awaits meanwhile)
            await fetches.get(0, 2)  # one awaiter gives up, the other still waits
        assert list(fetches._waiters) == [(0, 2)]
        body, frames = codec.encode_oob("late")
        fetches.answered(messages.Fetched(2, 0, value=msgspec.Raw(body),
                                          buffers=[f.nbytes for f in frames]))
        assert await patient == "late" and fetches._waiters == {}
        return asked
    assert asyncio.run(main()) == [1, 2]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_row_of_a_column_sliced_out_of_a_matrix_is_pulled(transport):
    """scores[:, 0][1:2] is contiguous to torch (a size-1 dimension's stride does not
    count) but keeps stride 4, which view(uint8) refused: a one-row piece of such a column
    (a DP chunk of one row, take() of rows apart) failed to pull on every raw transport."""
    scores = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    half = scores.to(torch.bfloat16)
    store = {1: asyncrl.TensorBatch({"r": scores[:, 0], "h": half[:, 1]})}
    with served(store, "strided", transport) as (shard, client):
        cols = [messages.Column("r", "float32", ()), messages.Column("h", "bfloat16", ())]
        for start, stop in [(1, 2), (0, 3), (2, 3)]:
            got = client.fetch_batch(RemoteBatch([Piece(shard, start, stop)], cols))
            assert got["r"].tolist() == scores[start:stop, 0].tolist()
            assert got["h"].tolist() == half[start:stop, 1].tolist()


@contextlib.contextmanager
def served(store: dict[int, Any], run: str, transport: str
           ) -> Iterator[tuple[Shard, dataplane.DataClient]]:
    """A real data server holding `store`, and a client pulling from it over tcp, or on
    "shm" into a pool of its own; closed after, nothing left in /dev/shm."""
    import os

    from asyncrl.comm.shm import SegmentPool, cleanup

    run_id = f"{run}{os.getpid()}{transport}"
    prefix = dataplane.run_prefix(run_id)
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", SECRET, store.__getitem__, "p:0", prefix)
    pool = SegmentPool(dataplane.pool_prefix(run_id, "c", 0, os.getpid())) \
        if transport == "shm" else None
    client = dataplane.DataClient(ctx, SECRET, "c/0/exec/1", "h", pool, timeout=10.0,
                                  transport="tcp" if pool is None else "auto")
    try:
        yield Shard("p", 0, 1, server.address, "h"), client
    finally:
        client.close()
        server.close()
        if pool is not None:
            pool.close()
        ctx.term()
        assert cleanup(prefix) == []  # nothing left in /dev/shm


class Maker(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, batch: asyncrl.TensorBatch) -> asyncrl.TensorBatch:
        return asyncrl.TensorBatch({"x": batch["i"].double() * 10})


class Sink(asyncrl.Worker):
    @asyncrl.register
    def total(self, batch: asyncrl.TensorBatch) -> float:
        return float(batch["x"].sum())


def test_a_closed_consumers_segments_are_unmapped_by_its_producer():
    """The producer writes pulled rows into the consumer's shared memory and keeps the
    mapping; the consumer closed unlinks its pool, but the producer's mapping pinned the
    memory in /dev/shm until it mapped some new segment (maybe never)."""
    from asyncrl.comm.dataplane import run_prefix

    def mapped(pid: int, prefix: str) -> list[str]:
        with open(f"/proc/{pid}/maps") as f:
            return [line.split(maxsplit=5)[-1] for line in f if prefix in line]

    async def main():
        async with asyncrl.Controller() as ctl:
            producer = await ctl.spawn(Maker, name="producer")
            sink = await ctl.spawn(Sink, name="sink")
            pids = group_pids(producer) + group_pids(sink)
            made = producer.make(asyncrl.TensorBatch({"i": torch.arange(1 << 20)}))
            assert await sink.total(made) == [float(torch.arange(1 << 20).double().sum() * 10)]
            [pid] = producer.pids.values()
            prefix = f"{run_prefix(ctl.run_id)}sink+"
            before = mapped(pid, prefix)
            await ctl.close_group(sink)
            await poll_until(lambda: not mapped(pid, prefix), 20,
                             "the producer to unmap the closed consumer's segments")
            return pids, before
    pids, before = run(main())
    assert_gone(pids)
    assert before, "the producer should have mapped the consumer's segment"


def test_a_data_host_name_that_is_loopback_is_refused_where_the_controller_is_elsewhere():
    """A host listed by a name its own /etc/hosts maps to 127.0.1.1 bound its ranks' data
    servers there: pulls from other hosts timed out, unexplained."""
    from asyncrl.comm.dataserver import check_reachable

    with pytest.raises(RuntimeError, match=r"'localhost' resolves to a loopback address .* "
                                           r"give the host's IP address"):
        check_reachable("localhost", "tcp://10.1.2.3:5000")
    check_reachable("localhost", "tcp://127.0.0.1:5000")  # one machine: fine
    check_reachable("10.0.0.5", "tcp://10.1.2.3:5000")  # an address: as given
    check_reachable("no-such-host.invalid", "tcp://10.1.2.3:5000")  # zmq's own error later


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_row_wider_than_a_bucket_comes_a_group_of_columns_at_a_time(monkeypatch, transport):
    """A weight pack (one row, a column per parameter) came as one message over a socket:
    held whole by ZeroMQ beside the batch it was copied into (twice its memory), heard of
    only once all of it came. Its columns come in groups of at most a bucket now (into
    shared memory, the producer writes them in place: one pull per bucket of rows)."""
    monkeypatch.setattr(dataplane, "BUCKET_BYTES", 100)
    cols = {k: torch.arange(2 * 10, dtype=torch.float32).reshape(2, 10) + i * 100
            for i, k in enumerate("abcde")}  # 40 bytes a row each: 200 a row
    store = {1: asyncrl.TensorBatch({**cols, "name": ["p", "q"]})}
    sent: list[list[str]] = []
    real_send = dataserver.DataServer._send

    def send(self, identity, body, buffers):
        reply = messages.decode(body)
        sent.append(list(reply.buffers) if isinstance(reply, messages.Pulled) else [])
        real_send(self, identity, body, buffers)
    monkeypatch.setattr(dataserver.DataServer, "_send", send)
    with served(store, "wide", transport) as (shard, client):
        columns = [*(messages.Column(k, "float32", (10,)) for k in cols),
                   messages.Column("name", "list", ())]
        got = client.fetch_batch(RemoteBatch([Piece(shard, 0, 2)], columns))
        for k, v in cols.items():
            assert torch.equal(got[k], v)
        assert got["name"] == ["p", "q"]  # once each: with the first group of its row only
        if transport == "tcp":  # a row a bucket, two columns (80 bytes) a group
            assert sent == [["a", "b"], ["c", "d"], ["e"]] * 2
        else:
            assert sent == [[], []]  # written into the segment: one pull a row


def test_a_row_of_many_columns_is_asked_for_in_pulls_a_data_server_takes(monkeypatch):
    """Into shared memory, one pull named every column of a piece: a weight pack of an MoE
    model (~19k columns) made a pull past what a data server takes, which cut the puller
    off (TransferTimeout, every time). Its columns are asked for a group at a time now; GPU
    columns, still named in one pull, are refused before it is sent."""
    monkeypatch.setattr(dataserver, "MAX_PULL_BYTES", 4096)  # (the server takes it at start)
    cols = {f"layer{i:03d}": torch.full((1, 2), float(i)) for i in range(300)}
    store = {1: asyncrl.TensorBatch({**cols, "name": ["pack"]})}
    with served(store, "many", "shm") as (shard, client):
        columns = [*(messages.Column(k, "float32", (2,)) for k in cols),
                   messages.Column("name", "list", ())]
        got = client.fetch_batch(RemoteBatch([Piece(shard, 0, 1)], columns))
        assert all(torch.equal(got[k], v) for k, v in cols.items()) and got["name"] == ["pack"]
    by_ipc = messages.Pull(1, 1, 0, 1, ipc=[f"{k}.mlp.experts.weight" for k in cols])
    with pytest.raises(ValueError, match=r"names 300 GPU columns and 0 others in \d+ bytes, "
                                         r"past the 4096 a data server takes"):
        dataplane._encoded(by_ipc)


def test_gone_peers_match_a_piece_by_address_group_and_object():
    """Indexed by address (a pull polls for each piece it waits on, and a long run closing an
    evaluation group every few steps hears of thousands): what matches is unchanged."""
    gone = GonePeers()
    for i in range(1000):  # groups closed long ago, elsewhere
        gone.add(messages.PeersGone(f"eval{i}", [f"tcp://10.0.0.{i % 250}:1"], 5, "is closed"))
    gone.add(messages.PeersGone("prod", ["tcp://a:1", "tcp://b:1"], 10, "is dead: killed"))

    def piece(group: str, addr: str, obj: int) -> Piece:
        return Piece(Shard(group, 0, obj, addr, "h"), 0, 1)
    err = gone.lost(piece("prod", "tcp://b:1", 9))
    assert isinstance(err, asyncrl.InputLostError) and "group 'prod' is dead: killed" in str(err)
    assert gone.lost(piece("prod", "tcp://b:1", 10)) is None  # made after: a respawn's
    assert gone.lost(piece("prod", "tcp://c:1", 9)) is None  # another rank's address
    assert gone.lost(piece("other", "tcp://a:1", 9)) is None  # another group there now
    assert gone.lost(piece("eval7", "tcp://10.0.0.7:1", 4)) is not None
    assert len(gone.since(1000)) == 1


def test_gpu_rows_are_still_released_after_another_producers_export_failed(monkeypatch):
    """One producer could not export its rows (CUDA IPC off in this process from then on),
    and the releases of the other producers' exported rows were skipped too: their blocks
    stayed held until they exited. Only a failure to open here stops the releases."""
    from asyncrl.comm import cuda_ipc

    opened: list[int] = []
    monkeypatch.setattr(cuda_ipc, "_failed", None)
    monkeypatch.setattr(cuda_ipc, "_open_failed", False, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: [0])
    monkeypatch.setattr(cuda_ipc, "_open", lambda info: opened.append(info.gpu))
    rows = type("Rows", (), {"gpu": 0})()
    cuda_ipc.give_up(cuda_ipc.IpcUnavailable("CUDA IPC could not export GPU rows (there)"))
    cuda_ipc.release(rows)
    assert opened == [0] and not cuda_ipc.usable()
    monkeypatch.setattr(cuda_ipc, "_open_failed", True)  # opening failed here: not again
    cuda_ipc.release(rows)
    assert opened == [0]
