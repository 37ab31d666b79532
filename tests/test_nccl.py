"""The NCCL transport's logic (asyncrl/comm/nccl.py, controller/links.py) on CPUs: real
groups with `Controller(transport="nccl")` and tests/fake_nccl.py standing in for
cupy.cuda.nccl (the bytes at each tensor's pointer travel over sockets). The communicator
set-up from a unique id made on the producer's rank 0, its reuse per pair of groups, the
order of sends and receives across buckets and producers, and the timeout are checked; NCCL
on GPUs is not (no machine with two GPUs here: see the README)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl import Dispatch, TensorBatch

TESTS = os.path.dirname(os.path.abspath(__file__))


class Maker(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, batch: TensorBatch, width: int = 3) -> TensorBatch:
        i = batch["i"]
        return TensorBatch({
            "x": i.double() * 10,
            "v": (i[:, None] * 100 + torch.arange(width)).to(torch.bfloat16),
            "name": [f"row{k}" for k in i.tolist()],
            "src": [self.rank] * len(i)})


def posted() -> list:
    import fake_nccl  # (the ranks' own: ASYNCRL_NCCL_MODULE)

    return list(fake_nccl.CALLS)


class PostingMaker(Maker):
    @asyncrl.register
    def posted(self) -> list:
        return posted()


class Taker(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def take(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": batch["x"] + 0, "v": batch["v"].float(),
                            "name": batch["name"], "src": batch["src"],
                            "taker": [self.rank] * len(batch)})

    @asyncrl.register
    def posted(self) -> list:
        return posted()

    @asyncrl.register(dispatch=Dispatch.DP)
    def take_and_refuse(self, batch: TensorBatch) -> None:
        raise ValueError(f"refused {len(batch)} rows")  # after its rows came by NCCL


@pytest.fixture
def fake_nccl(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_NCCL_MODULE", "fake_nccl")
    monkeypatch.setenv("ASYNCRL_FAKE_NCCL_ROOT", str(tmp_path / "nccl"))  # (not in /tmp)


def spawn_env() -> dict[str, str]:
    return {"PYTHONPATH": TESTS}  # where the ranks find fake_nccl


def test_rows_go_by_nccl_between_groups_in_order(fake_nccl):
    n = 11

    async def main():
        async with asyncrl.Controller(transport="nccl") as ctl:
            maker = await ctl.spawn(Maker, nprocs=2, env=spawn_env())
            taker = await ctl.spawn(Taker, nprocs=2, env=spawn_env())
            batch = TensorBatch({"i": torch.arange(n)})
            first = await taker.take(maker.make(batch))
            setups = ctl.links.setups
            again = await taker.take(maker.make(batch, width=2_000_000))  # 2 buckets a shard
            return first, again, setups, ctl.links.setups, ctl.payload_bytes
    first, again, setups, setups_after, payload = run(main())
    for out, width in ((first, 3), (again, 2_000_000)):
        assert out["x"].tolist() == [10.0 * k for k in range(n)]
        expected = (torch.arange(n)[:, None] * 100 + torch.arange(width)).to(torch.bfloat16)
        assert torch.equal(out["v"], expected.float())
        assert out["name"] == [f"row{k}" for k in range(n)]
        assert out["src"] == [0] * 6 + [1] * 5 and out["taker"] == [0] * 6 + [1] * 5
    assert (setups, setups_after) == (1, 1)  # one communicator for the pair, kept
    assert payload == 0


def test_one_consumer_receives_from_two_producers(fake_nccl):
    async def main():
        async with asyncrl.Controller(transport="nccl") as ctl:
            maker = await ctl.spawn(Maker, nprocs=2, env=spawn_env())
            taker = await ctl.spawn(Taker, nprocs=1, env=spawn_env())
            return await taker.take(maker.make(TensorBatch({"i": torch.arange(7)})))
    out = run(main())
    assert out["x"].tolist() == [10.0 * k for k in range(7)]
    assert out["src"] == [0] * 4 + [1] * 3


def test_stopped_producer_gives_transfer_timeout_and_drops_the_link(fake_nccl):
    async def main():
        async with asyncrl.Controller(transport="nccl", transfer_timeout=5,
                                      heartbeat_timeout=60) as ctl:
            maker = await ctl.spawn(Maker, nprocs=1, env=spawn_env())
            taker = await ctl.spawn(Taker, nprocs=1, env=spawn_env())
            made = maker.make(TensorBatch({"i": torch.arange(4)}))
            await taker.take(made)  # the link is up
            os.kill(maker.pids[0], signal.SIGSTOP)
            try:
                with pytest.raises(asyncrl.TransferTimeout) as info:
                    await taker.take(made)
                return str(info.value), dict(ctl.links._made)
            finally:
                os.kill(maker.pids[0], signal.SIGCONT)
    msg, made = run(main())
    assert "maker:0" in msg and "within 5 s" in msg
    assert made == {}  # set up again for the next call


def test_a_call_failing_after_its_pull_keeps_the_link_and_an_aborted_one_is_made_again(
        fake_nccl):
    """A call's failure set up its links again: the new communicator aborted the old one
    under other calls still receiving on it. Now only a link a rank aborted (its error reply
    names it) is made again, and only the making of it that was aborted."""
    async def main():
        async with asyncrl.Controller(transport="nccl") as ctl:
            maker = await ctl.spawn(Maker, nprocs=1, env=spawn_env())
            taker = await ctl.spawn(Taker, nprocs=2, env=spawn_env())
            made = maker.make(TensorBatch({"i": torch.arange(6)}))
            with pytest.raises(asyncrl.RemoteError, match="refused 3 rows"):
                await taker.take_and_refuse(made)
            out = await taker.take(made)
            assert out["x"].tolist() == [10.0 * k for k in range(6)]
            assert ctl.links.setups == 1  # the link was kept
            key, (_, _, uid) = next(iter(ctl.links._made.items()))
            ctl.links.aborted({key: b"an earlier making"})  # a late report: kept
            stale_kept = key in ctl.links._made
            ctl.links.aborted({key: uid})
            return stale_kept, key in ctl.links._made
    stale_kept, still = run(main())
    assert stale_kept and not still


def test_a_links_set_up_connects_every_producer_consumer_pair_first(fake_nccl):
    """NCCL connects a pair at its first transfer, inside groupEnd, where the host waits
    unbounded: a send's first groupEnd held every NCCL send of its process while a peer
    that gave up never came. Each pair moves a byte as the link is set up, within the
    transfer timeout."""
    async def main():
        async with asyncrl.Controller(transport="nccl") as ctl:
            maker = await ctl.spawn(PostingMaker, nprocs=1, env=spawn_env(), name="maker")
            taker = await ctl.spawn(Taker, nprocs=2, env=spawn_env())
            await taker.take(maker.make(TensorBatch({"i": torch.arange(4)})))
            return await maker.posted(), await taker.posted()
    made, taken = run(main())
    assert [tuple(c) for c in made[0][:2]] == [("send", 0, 1, 1), ("send", 0, 2, 1)]
    for rank, calls in zip((1, 2), taken, strict=True):
        assert tuple(calls[0]) == ("recv", rank, 0, 1)  # its byte first, then the rows
        assert all(c[3] > 1 for c in calls[1:])


def test_a_send_to_a_consumer_that_died_ends_at_once_and_frees_the_producer(fake_nccl,
                                                                           tmp_path):
    """An NCCL send waits for its receiver, and a process sends one at a time. A consumer
    killed in the middle of a pull left its producer's send waiting until the transfer
    timeout, and every other NCCL pull from that producer behind it. The controller's
    announcement of the death now aborts the producer's links with the dead group: another
    group's pull goes through at once."""
    hold = tmp_path / "hold"  # the doomed consumer's receive waits for this file: forever

    async def main():
        async with asyncrl.Controller(transport="nccl", transfer_timeout=120) as ctl:
            maker, doomed, other = await asyncio.gather(
                ctl.spawn(Maker, nprocs=1, env=spawn_env(), name="maker"),
                ctl.spawn(Taker, nprocs=1, env={**spawn_env(), "FAKE_NCCL_HOLD": str(hold)},
                          name="doomed"),
                ctl.spawn(Taker, nprocs=1, env=spawn_env(), name="other"))
            pids = group_pids(maker) + group_pids(doomed) + group_pids(other)
            made = maker.make(TensorBatch({"i": torch.arange(4)}))
            pending = asyncio.ensure_future(doomed.take(made))
            await poll_until(lambda: os.path.exists(f"{hold}.waiting"), 60,
                             "the doomed consumer's receive")
            os.kill(doomed.pids[0], signal.SIGKILL)
            with pytest.raises(asyncrl.GroupDeadError):
                await pending
            out = await asyncio.wait_for(other.take(made), 30)  # not the 120 s timeout
            return out, pids
    out, pids = run(main())
    assert_gone(pids)
    assert out["x"].tolist() == [0.0, 10.0, 20.0, 30.0] and out["taker"] == [0] * 4


class Both(Maker, Taker):
    pass


def test_links_both_ways_between_two_groups_are_set_up_one_after_the_other(fake_nccl):
    """A rank's NCCL groups hold a lock of its process, and a link's set-up waits in one for
    its peers: A->B and B->A set up at once each held one end's lock, waiting for the other
    (until the transfer timeout aborted both). The controller sets links up one at a time."""
    async def main():
        async with asyncrl.Controller(transport="nccl", transfer_timeout=15) as ctl:
            env = {**spawn_env(), "FAKE_NCCL_CONNECT_S": "1"}  # (the set-ups overlap)
            a, b = await asyncio.gather(ctl.spawn(Both, nprocs=1, env=env, name="a"),
                                        ctl.spawn(Both, nprocs=1, env=env, name="b"))
            batch = TensorBatch({"i": torch.arange(4)})
            return await asyncio.gather(b.take(a.make(batch)), a.take(b.make(batch))), \
                ctl.links.setups
    (ab, ba), setups = run(main())
    assert ab["x"].tolist() == ba["x"].tolist() == [0.0, 10.0, 20.0, 30.0] and setups == 2


def test_a_link_with_two_ranks_on_one_gpu_is_refused_before_nccl_is_asked():
    from types import SimpleNamespace

    from asyncrl.controller.links import _check_gpus

    def group(name, *gpus):
        return SimpleNamespace(name=name, ranks={r: SimpleNamespace(gpu=g)
                                                 for r, g in enumerate(gpus)})

    _check_gpus(group("train", "GPU-a", "GPU-b"), group("gen", "GPU-c"))  # apart: fine
    _check_gpus(group("train", "", ""), group("gen", ""))  # CPU ranks: nothing to check
    with pytest.raises(asyncrl.PlacementError) as info:
        _check_gpus(group("train", "GPU-a", "GPU-b"), group("gen", "GPU-c", "GPU-b"))
    assert "ranks train:1 and gen:1 are on the same GPU (GPU-b)" in str(info.value)
    assert "separate_from" in str(info.value)


def test_gpu_columns_need_nccl_across_hosts_and_gpus_but_not_within_shared_gpus():
    from types import SimpleNamespace as NS

    from asyncrl.controller.links import Links

    def group(host, *gpus):
        return NS(ranks={r: NS(host=host, gpu=g) for r, g in enumerate(gpus)})

    def ref(producer, device="cuda"):
        schema = NS(columns=[NS(dtype="float32", device=device), NS(dtype="list", device="")])
        return NS(group=producer, parts=lambda: [(NS(host=i.host, gpu=i.gpu), schema)
                                                 for i in producer.ranks.values()])

    needed = Links(1.0).needed
    trainer = group("h1", "GPU-0", "GPU-1")
    assert needed(ref(trainer), group("h1", "GPU-2", "GPU-3"), "auto")  # apart on one host
    assert needed(ref(trainer), group("h2", "GPU-0"), "auto")  # another host
    assert not needed(ref(trainer), group("h1", "GPU-0", "GPU-1"), "auto")  # colocated: IPC
    assert not needed(ref(trainer), group("h1", "GPU-1", "GPU-2"), "auto")  # a shared GPU
    assert not needed(ref(trainer, "cpu"), group("h1", "GPU-2"), "auto")  # CPU columns
    assert not needed(ref(trainer), trainer, "auto")  # a group's own rows
    assert not needed(ref(trainer), group("h2", "GPU-0"), "tcp")  # sockets, as asked
    cpus = group("h1", "", "")
    assert needed(ref(cpus, "cpu"), group("h1", ""), "nccl")  # every tensor column
    assert not needed(ref(cpus, "cpu"), group("h1", ""), "auto")


def test_without_nccl_gpu_rows_fall_back_to_host_memory_unless_nccl_was_asked_for():
    import asyncio
    from types import SimpleNamespace as NS

    from asyncrl.controller.links import Links

    asked: list[str] = []

    def caller(name, error=None):
        async def call(method, *args):
            asked.append(name)
            if error:
                raise asyncrl.RemoteError(name, 0, method, "ImportError", error, "")
            return b"id"
        return NS(name=name, ranks={}, nprocs=1, call=call)

    producer, consumer = caller("train"), caller("gen", "install cupy-cuda12x")

    async def main():
        links = Links(5.0)
        first = await links.ensure(producer, consumer)
        again = await links.ensure(producer, consumer)  # remembered: nothing asked
        return first, again, list(asked)
    assert asyncio.run(main()) == (None, None, ["train", "gen"])
    with pytest.raises(asyncrl.RemoteError, match="install cupy"):
        asyncio.run(Links(5.0).ensure(producer, consumer, required=True))


def test_transport_nccl_without_nccl_fails_the_call_with_the_install_hint():
    async def main():
        async with asyncrl.Controller(transport="nccl") as ctl:
            maker = await ctl.spawn(Maker, nprocs=1)
            taker = await ctl.spawn(Taker, nprocs=1)
            with pytest.raises(asyncrl.RemoteError) as info:
                await taker.take(maker.make(TensorBatch({"i": torch.arange(3)})))
            return str(info.value), group_pids(maker) + group_pids(taker)
    msg, pids = run(main())
    assert_gone(pids)
    assert "ImportError" in msg and "install cupy-cuda12x" in msg, msg


def test_an_nccl_send_waiting_for_its_receiver_holds_up_no_other_pull(monkeypatch):
    """A producer's NCCL send may wait for a receiver that gave up until the transfer
    timeout. It waits on a thread of its communicator, so the data server answers other
    pulls meanwhile (they waited behind it), and answers the NCCL pull once the send is
    done. A real DataServer; a stand-in send that blocks until the test lets it go."""
    import threading

    import zmq

    from asyncrl.comm import dataplane, dataserver, messages
    from asyncrl.comm.auth import Signer, Verifier
    from asyncrl.comm.channel import open_frame
    from asyncrl.comm.remote import RemoteValue, Shard

    sending, done = threading.Event(), threading.Event()
    sent: list = []

    def send(key, tensors, to, timeout, uid):
        sending.set()
        assert done.wait(30)
        sent.append((key, [t.tolist() for t in tensors], to))

    monkeypatch.setattr(dataserver.nccl, "send", send)
    monkeypatch.setattr(dataserver.nccl, "has", lambda key, connecting=False: True)
    secret = b"k" * 32
    stored = {1: TensorBatch({"x": torch.arange(4.0)}), 2: {"whole": 7}}
    ctx = zmq.Context()
    server = dataserver.DataServer(ctx, "127.0.0.1", secret, stored.__getitem__, "maker:0",
                                  "asyncrl-test-")
    client = dataplane.DataClient(ctx, secret, "taker/0", "127.0.0.1", None, timeout=10)
    puller = ctx.socket(zmq.DEALER)
    identity = b"taker/0/pull-nccl"
    puller.setsockopt(zmq.IDENTITY, identity)
    puller.connect(server.address)
    try:
        pull = messages.Pull(1, 1, 1, 3, nccl=["x"], nccl_key="maker->taker")
        puller.send_multipart(Signer(secret).sign(identity + b"@" + server.address.encode(),
                                                  messages.encode(pull)))
        assert sending.wait(30)
        shard = Shard("maker", 0, 2, server.address, "127.0.0.1")
        assert client.fetch_value(RemoteValue(shard)) == {"whole": 7}  # while it sends
        assert not puller.poll(0) and sent == []
        done.set()
        assert puller.poll(30_000)
        reply = open_frame(Verifier(secret), b">" + identity, puller.recv_multipart())
        assert isinstance(reply, messages.Pulled) and reply.xfer_id == 1 and not reply.error
        assert sent == [("maker->taker", [[1.0, 2.0]], ("taker", 0))]
    finally:
        done.set()
        puller.close(0)
        client.close()
        server.close()


def test_a_transfer_on_a_communicator_replaced_meanwhile_fails_and_spares_the_new_one():
    """Set up again for another call, the old communicator is aborted: its kernels end, so a
    transfer still waiting on it looked done (rows never received taken as received). And a
    send that timed out on the old one must not abort the new one under the same key."""
    import threading

    from asyncrl.comm import nccl

    class Comm:
        aborts = 0

        def wait_all(self, timeout):
            return True

        def abort(self):
            Comm.aborts += 1

    old = nccl.Link(Comm(), {}, threading.Lock())
    nccl._wait("maker->taker", old, "receive", 1.0)  # done, not aborted: fine
    new = nccl.Link(Comm(), {}, threading.Lock())
    nccl._links["maker->taker"] = new
    try:
        nccl._abort(old, "set up again for another call")  # as join() does to the old one
        with pytest.raises(RuntimeError, match="aborted during it .* did not complete"):
            nccl._wait("maker->taker", old, "receive", 1.0)
        nccl.forget("maker->taker", old)  # a late give-up on the old one
        assert nccl._links["maker->taker"] is new and Comm.aborts == 1
        nccl.forget("maker->taker", new)
        assert "maker->taker" not in nccl._links and Comm.aborts == 2
    finally:
        nccl._links.pop("maker->taker", None)


def test_a_pull_mixing_this_ranks_own_rows_with_rows_by_nccl_needs_no_key_for_its_own(
        monkeypatch):
    """asyncrl.concat(a_future, b_future) passed to group B, linked to A by NCCL: B's own
    rows are copied, never sent by NCCL, yet each bucket looked up an NCCL key for its
    group (there is none for B itself): KeyError, the call failed."""
    import threading
    from types import SimpleNamespace

    import zmq

    from asyncrl.comm import dataplane, nccl
    from asyncrl.comm.messages import Column
    from asyncrl.comm.remote import Piece, RemoteBatch, Shard

    monkeypatch.setattr(nccl, "has", lambda key: True)  # the controller linked A -> B
    monkeypatch.setattr(nccl, "link", lambda key: SimpleNamespace(lock=threading.Lock(),
                                                                  uid=b"u"))
    monkeypatch.setattr(nccl, "finish", lambda key, end, timeout: None)
    asked = []
    monkeypatch.setattr(dataplane.DataClient, "_exchange",
                        lambda self, requests, take, sent=None, window=0, nbytes=None: asked.extend(
                            req for _, req in requests))
    own = TensorBatch({"x": torch.arange(4.0)})
    ctx = zmq.Context()
    client = dataplane.DataClient(ctx, b"s" * 32, "B/0", "h", None, 5.0, transport="nccl",
                                  own=("tcp://h:2", {7: own}.__getitem__))
    try:
        out = client.fetch_batch(RemoteBatch([
            Piece(Shard("A", 0, 3, "tcp://h:1", "h"), 0, 2),
            Piece(Shard("B", 0, 7, "tcp://h:2", "h"), 0, 2)], (Column("x", "float32"),)))
    finally:
        client.close()
        ctx.term()
    assert out["x"][2:].tolist() == [0.0, 1.0]  # its own rows, copied
    # A's, by NCCL, bound to the link's making it was posted for
    assert [(r.obj_id, r.nccl_key, r.nccl_uid) for r in asked] == [(3, "A->B", b"u")]


def test_an_id_for_cupy_before_14_goes_as_chars_of_the_platforms_sign():
    """CuPy < 14 takes the unique id as a tuple of C chars, range-checked as it converts
    them, before NCCL is called: signed on x86-64, unsigned on aarch64 (cupy#9430), where
    the signed tuple given after the TypeError of bytes raised OverflowError."""
    from types import SimpleNamespace

    from asyncrl.comm import nccl

    def old_cupy(lo: int, hi: int) -> SimpleNamespace:
        def make(world, uid, rank):
            if not isinstance(uid, tuple):
                raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got "
                                f"{type(uid).__name__})")
            for b in uid:
                if not lo <= b <= hi:
                    raise OverflowError("value too large to convert to char" if b > hi
                                        else "can't convert negative value to char")
            return uid
        return SimpleNamespace(NcclCommunicator=make)

    uid = bytes(range(64, 192))  # either side of 127
    for lo, hi in ((-128, 127), (0, 255)):  # x86-64, aarch64
        made = nccl._communicator(old_cupy(lo, hi), 2, uid, 0)
        assert bytes(b & 0xFF for b in made) == uid


def test_gpu_rows_that_cuda_ipc_cannot_share_here_come_through_host_memory(monkeypatch,
                                                                          caplog):
    """torch shares memory in expandable segments through pidfd_getfd, which containers
    without ptrace rights refuse (pytorch#165685): the pull failed inside its copy with
    "Operation not permitted". The failure now names the cause and its fix, the pull is made
    again through host memory, and this process uses CUDA IPC no more (said once). A
    producer whose export failed answers IpcUnavailable, taken the same way."""
    import logging
    import threading

    import zmq

    from asyncrl.comm import cuda_ipc, dataplane, messages
    from asyncrl.comm.remote import Piece, RemoteBatch, Shard

    monkeypatch.setattr(cuda_ipc, "_failed", None, raising=False)  # (IPC not given up yet)
    monkeypatch.setattr(cuda_ipc, "_visible", ["GPU-x"])
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)

    def refuse(*args):
        raise RuntimeError("pidfd_getfd: Operation not permitted")
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(refuse))
    rows = messages.IpcRows(0, b"h", 64, 0, b"r", 0, None, False, "float32", (2,), (1,), 0,
                            "GPU-x")
    with pytest.raises(RuntimeError, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments") \
            as info:
        cuda_ipc.copy_rows_into(rows, torch.empty(2))
    assert isinstance(info.value, cuda_ipc.IpcUnavailable)
    tried: list[bool] = []

    def pull(self, rb):  # the pull as _fetch_rows makes it: by CUDA IPC while usable
        tried.append(cuda_ipc.usable())
        if cuda_ipc.usable():
            cuda_ipc.copy_rows_into(rows, torch.empty(2))
        return TensorBatch({"x": torch.ones(2)})
    monkeypatch.setattr(dataplane.DataClient, "_pull_rows", pull)
    secret, ctx = b"k" * 32, zmq.Context()
    client = dataplane.DataClient(ctx, secret, "taker/0", "127.0.0.1", None, timeout=10)
    server = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl"):
            for _ in range(2):
                assert client._fetch_rows(RemoteBatch([], ()))["x"].tolist() == [1.0, 1.0]
        assert tried == [True, False, False]
        warned = [r.getMessage() for r in caplog.records if "CUDA IPC" in r.getMessage()]
        assert len(warned) == 1 and "through host memory" in warned[0], warned
        req = messages.Pull(5, 1, 0, 2, ipc=["x"])
        answer = threading.Thread(target=lambda: answer_with(
            server, addr, secret, "IpcUnavailable: CUDA IPC could not export GPU rows"))
        answer.start()
        with pytest.raises(cuda_ipc.IpcUnavailable, match="could not export"):
            client._exchange([(Piece(Shard("maker", 0, 1, addr, "127.0.0.1"), 0, 2), req)],
                             lambda *_: None)
        answer.join(10)
    finally:
        client.close()
        server.close(0)
        ctx.term()


def answer_with(server, addr: str, secret: bytes, error: str) -> None:
    from asyncrl.comm import messages
    from asyncrl.comm.auth import Signer, Verifier
    from asyncrl.comm.channel import open_frame

    who, *frames = server.recv_multipart()
    req = open_frame(Verifier(secret), who + b"@" + addr.encode(), frames)
    server.send_multipart([who, *Signer(secret).sign(
        b">" + who, messages.encode(messages.Pulled(req.xfer_id, error=error)))])


def test_the_fake_nccl_refuses_reads_and_hangs_where_nccl_does(fake_nccl):
    """tests/fake_nccl.py as cupy.cuda.nccl: a bad datatype or peer and any call on an
    aborted communicator raise; a call refused in a group fails its groupEnd, which still
    closes the group; a send reads its bytes when its stream runs it, not when posted; a
    receive whose count differs from its send's waits (NCCL may hang) rather than fail."""
    import threading

    import fake_nccl as stub

    uid, comms = stub.get_unique_id(), {}

    def on_device_1(fn) -> None:  # rank 1: a thread standing in for another process
        def run() -> None:
            stub.use_device(1)
            fn()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(30)
    made = threading.Thread(target=lambda: comms.setdefault(0, stub.NcclCommunicator(2, uid, 0)))
    made.start()
    on_device_1(lambda: comms.setdefault(1, stub.NcclCommunicator(2, uid, 1)))
    made.join(30)
    a, b, u8 = comms[0], comms[1], stub.NCCL_UINT8
    src, later, byte = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), \
        torch.ones(1, dtype=torch.uint8)
    got = [torch.zeros(8, dtype=torch.uint8) for _ in range(3)]
    try:
        for dtype, peer in ((99, 1), (u8, 2), (u8, 0)):  # no such datatype; no such peer
            with pytest.raises(stub.NcclError, match="INVALID_ARGUMENT"):
                a.send(src.data_ptr(), 8, dtype, peer, 0)
        stub.groupStart()
        with pytest.raises(stub.NcclError):
            a.send(src.data_ptr(), 8, u8, 5, 0)
        with pytest.raises(stub.NcclError, match="a call in this group failed"):
            stub.groupEnd()
        assert stub._group.depth == 0
        connecting = threading.Thread(target=lambda: on_device_1(
            lambda: b.recv(byte.data_ptr(), 1, u8, 0, 0)))
        connecting.start()
        a.send(byte.data_ptr(), 1, u8, 1, 0)  # the pair connects (groupEnd waits for b)
        connecting.join(30)
        assert a.wait_all(10)
        a.send(src.data_ptr(), 8, u8, 1, 0)  # runs, waiting for b's receive
        a.send(later.data_ptr(), 8, u8, 1, 0)  # waits behind it on a's stream
        later.fill_(7)  # before the stream reads it, as a kernel would
        on_device_1(lambda: [b.recv(g.data_ptr(), 8, u8, 0, 0) for g in got[:2]])
        assert b.wait_all(10) and a.wait_all(10)
        assert torch.equal(got[0], src) and got[1].tolist() == [7] * 8
        a.send(src.data_ptr(), 8, u8, 1, 0)
        on_device_1(lambda: b.recv(got[2].data_ptr(), 4, u8, 0, 0))  # 4 for 8 sent
        assert not b.wait_all(1) and not a.wait_all(0.1) and got[2].tolist() == [0] * 8
        assert stub.MISMATCHES[-1] == "rank 1 from 0: b'1 8' sent, b'1 4' received"
    finally:
        a.abort()
        b.abort()
    with pytest.raises(stub.NcclError, match="aborted"):
        a.send(src.data_ptr(), 8, u8, 1, 0)
