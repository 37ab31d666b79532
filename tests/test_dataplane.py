"""The data plane: futures passed between groups move worker to worker, never through the
controller. Every plan shape is checked row by row on real torchrun groups."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
import torch
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl import Dispatch, TensorBatch
from asyncrl.comm import messages
from asyncrl.comm.auth import Signer, Verifier, read_secret
from asyncrl.hybrid.weight_sync import GATHER_TO_ZERO


def rows(n: int) -> TensorBatch:
    return TensorBatch({"i": torch.arange(n)})


def _by_rank_split(layout, args, kwargs):  # a user's own DP: one chunk per rank
    (batch,) = args
    ranks = list(range(layout.world_size))
    return asyncrl.Split({r: ((c,), kwargs) for r, c in enumerate(batch.chunk(len(ranks)))},
                         ranks)


# collect sees references to the rows when the result is passed on, not TensorBatches
asyncrl.register_protocol("my_dp", split=_by_rank_split, collect=lambda layout, results, state:
                          TensorBatch.concat([results[r] for r in sorted(results)]))


class Producer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, batch: TensorBatch, width: int = 3) -> TensorBatch:
        i = batch["i"]
        return TensorBatch({
            "i": i.clone(),
            "x": i.double() * 10,
            "v": (i[:, None] * 100 + torch.arange(width)).to(torch.bfloat16),
            "name": [f"row{k}" for k in i.tolist()],
            "src": [self.rank] * len(i)})

    @asyncrl.register
    def info(self, k: int) -> dict:
        return {"rank": self.rank, "k": k}

    @asyncrl.register
    def fail(self):
        raise ValueError("boom in the producer")

    @asyncrl.register
    def whole(self, batch: TensorBatch) -> dict:  # every row: its own and its peers'
        return {"i": batch["i"].tolist(), "v": batch["v"].tolist(), "name": batch["name"],
                "src": batch["src"]}

    @asyncrl.register(dispatch=Dispatch.DP)
    def again(self, batch: TensorBatch) -> TensorBatch:  # its own rows only
        return batch.union(TensorBatch({"by": [self.rank] * len(batch)}))

    @asyncrl.register(dispatch=Dispatch.DP)
    def lazy(self, batch: TensorBatch) -> TensorBatch:  # x as a view with the negative bit
        made = self.make(batch)
        return TensorBatch({**made.to_dict(), "x": (-made["x"])._neg_view()})

    @asyncrl.register(dispatch=Dispatch.DP)
    def nest(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"i": batch["i"].clone(), "tags": [[k] for k in batch["i"].tolist()]})

    @asyncrl.register
    def touch(self, batch: TensorBatch) -> list:  # every row (own and peers'), changed here
        for tags in batch["tags"]:
            tags.append(-1)
        return batch["tags"]

    @asyncrl.register(dispatch="my_dp")
    def make_mine(self, batch: TensorBatch) -> TensorBatch:
        return self.make(batch)

    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def unsendable(self) -> TensorBatch:  # too big to come inline, and a list it cannot send
        return TensorBatch({"x": torch.zeros(2, 40_000), "obj": [2**70, 2**70]})


def _half_split(layout, args, kwargs):
    (batch,) = args
    return asyncrl.Split({0: ((batch.slice(len(batch) // 2, len(batch)),), {})}, [0])


asyncrl.register_protocol("second_half", split=_half_split,
                          collect=lambda layout, results, state: results[0])


class Consumer(asyncrl.Worker):
    def __init__(self):
        self.seen: list = []

    @asyncrl.register(dispatch=Dispatch.DP)
    def echo(self, batch: TensorBatch) -> TensorBatch:
        self.seen.append((batch["i"].tolist(), sorted(set(batch["src"]))))
        out = batch.select(["i", "x", "v", "name", "src"])
        out = out.union(TensorBatch({"by": [self.rank] * len(batch)}))
        return out

    @asyncrl.register
    def total(self, batch: TensorBatch) -> tuple:
        return (len(batch), float(batch["x"].sum()), batch["name"][-1])

    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def ids(self, batch: TensorBatch) -> list:
        return batch["i"].tolist()

    @asyncrl.register(dispatch="second_half")
    def second_half(self, batch: TensorBatch) -> list:
        return batch["i"].tolist()

    @asyncrl.register
    def describe(self, values) -> list:
        return [sorted(v.items()) for v in values]

    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def nested(self, batches: list, named: dict) -> list:
        return [b["i"].tolist() for b in batches] + [[k, v if isinstance(v, int) else
                                                      v["name"]] for k, v in named.items()]

    @asyncrl.register
    def history(self) -> list:
        return self.seen


def expected(n: int, width: int = 3) -> dict:
    i = torch.arange(n)
    return {"i": i.tolist(), "x": (i.double() * 10).tolist(),
            "v": (i[:, None] * 100 + torch.arange(width)).to(torch.bfloat16).tolist(),
            "name": [f"row{k}" for k in range(n)]}


def assert_rows(batch: TensorBatch, n: int) -> None:
    want = expected(n)
    assert batch["i"].tolist() == want["i"]
    assert batch["x"].tolist() == want["x"]
    assert batch["v"].dtype == torch.bfloat16 and batch["v"].tolist() == want["v"]
    assert batch["name"] == want["name"]


@pytest.fixture(scope="module")
def groups(bg):
    async def spawn_all():  # together: one group's start-up waits overlap the others' work
        ctl = bg.ctl
        return dict(zip(["p4", "p2", "c2", "c1", "grid"], await asyncio.gather(
            ctl.spawn(Producer, nprocs=4, name="p4"),
            ctl.spawn(Producer, nprocs=2, name="p2"),
            ctl.spawn(Consumer, nprocs=2, name="c2"),
            ctl.spawn(Consumer, nprocs=1, name="c1"),
            ctl.spawn(Consumer, nprocs=4, name="grid", mesh={"dp": 2, "tp": 2})), strict=True))
    return bg.run(spawn_all(), timeout=240)


def get(fut, timeout=60):
    return fut.result(timeout=timeout)


@pytest.mark.parametrize("producer, consumer, n", [
    ("p4", "c2", 11), ("p2", "c1", 7), ("p2", "c2", 9), ("p4", "c1", 3)])
def test_dp_m_to_dp_n_moves_rows_in_order(bg, groups, producer, consumer, n):
    before = bg.ctl.payload_bytes
    made = groups[producer].make(rows(n))
    out = get(groups[consumer].echo(made))
    assert_rows(out, n)
    assert bg.ctl.payload_bytes == before  # nothing went through the controller


def test_zero_width_columns_and_rowless_shards_arrive_empty_shaped(groups):
    """A column of zero bytes per row (shape (n, 0)) moves like any other (on GPUs it never
    goes by CUDA IPC or NCCL: an empty storage has nothing to export), and so does a batch
    smaller than the producer group (padded rows dropped)."""
    out = get(groups["c1"].echo(groups["p4"].make(rows(6), width=0)))
    assert out["v"].shape == (6, 0) and out["v"].dtype == torch.bfloat16
    assert out["i"].tolist() == list(range(6)) and out["name"] == expected(6)["name"]
    few = get(groups["c2"].echo(groups["p4"].make(rows(2))))
    assert_rows(few, 2)


def test_dp4_to_dp2_pulls_only_the_shards_it_needs(groups):
    get(groups["c2"].echo(groups["p4"].make(rows(8))))
    last = [h[-1] for h in get(groups["c2"].history())]
    assert last == [[[0, 1, 2, 3], [0, 1]], [[4, 5, 6, 7], [2, 3]]]


def test_dp_to_tp_replicas_each_get_their_dp_chunk(groups):
    out = get(groups["grid"].echo(groups["p2"].make(rows(6))))
    assert_rows(out, 6)
    last = [h[-1][0] for h in get(groups["grid"].history())]
    assert last == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_broadcast_rank_zero_and_user_protocols(groups):
    made = groups["p2"].make(rows(5))
    total = float(sum(expected(5)["x"]))
    assert get(groups["c2"].total(made)) == [[5, total, "row4"]] * 2  # ONE_TO_ALL
    assert get(groups["c2"].ids(made)) == [0, 1, 2, 3, 4]  # RANK_ZERO: the whole batch
    assert get(groups["c2"].second_half(made)) == [2, 3, 4]  # user protocol: slices rows
    mine = groups["p2"].make_mine(rows(5))  # a user protocol whose collect concats batches
    assert_rows(get(mine), 5)
    assert_rows(get(groups["c1"].echo(mine)), 5)  # its collect also joins the references


def test_a_group_takes_its_own_rows_from_its_store_and_its_peers_rows_by_pull(groups):
    """A rank copies the rows its own store holds (CUDA cannot open a process's own IPC
    handles) and pulls the rest, in one batch, in order."""
    p2 = groups["p2"]
    made = p2.make(rows(9))
    want = expected(9)
    for out in get(p2.whole(made)):  # each rank: its own 5 or 4 rows, and the other's
        assert out["i"] == want["i"] and out["v"] == want["v"] and out["name"] == want["name"]
        assert out["src"] == [0] * 5 + [1] * 4
    again = get(p2.again(made))  # DP -> DP on the same ranks: nothing pulled
    assert_rows(again, 9)
    assert again["by"] == again["src"] == [0] * 5 + [1] * 4


def test_columns_with_lazy_bits_move_as_their_values(groups):
    """A column that is a negative (or conjugate) view moves as the values it reads as: the
    data plane moves raw bytes, and the bit is not in them."""
    assert_rows(get(groups["c1"].echo(groups["p2"].lazy(rows(5)))), 5)


def test_rows_from_a_ranks_own_store_are_copies_like_pulled_ones(groups):
    """A consumer that changes the list rows it got changes no stored result: its own
    store's rows are copies, as its peers' pulled ones are, and so is each repeat of a row."""
    made = groups["p2"].nest(rows(4))
    want = [[[k, -1] for k in range(4)]] * 2
    assert get(groups["p2"].touch(made)) == want
    assert get(groups["p2"].touch(made)) == want  # not [0, -1, -1]: the store kept [0]
    assert get(groups["p2"].touch(made.rows([1, 1, 3, 3]))) == [[[1, -1]] * 2 + [[3, -1]] * 2] * 2


def test_non_batch_values_are_pulled_whole(groups):
    infos = groups["p2"].info(7)  # ONE_TO_ALL: a list of one dict per rank
    assert get(groups["c1"].describe(infos)) == [
        [[["k", 7], ["rank", 0]], [["k", 7], ["rank", 1]]]]


def test_padding_rows_reach_the_consumer_marked_and_are_dropped(groups):
    out = get(groups["c2"].echo(groups["p2"].make(rows(3))))
    assert_rows(out, 3)
    assert out["by"] == [0, 0, 1]


def test_three_group_chain_carries_no_payload_through_the_controller(bg, groups):
    ctl = bg.ctl
    before = ctl.payload_bytes
    a = groups["p4"].make(rows(10))
    b = groups["c2"].echo(a)  # transform
    c = groups["grid"].echo(b)
    out = get(c)
    assert_rows(out, 10)
    assert out["by"] == [0] * 5 + [2] * 5
    assert ctl.payload_bytes == before
    # the driver's own await is not counted; sending that value on is
    value = get(b)
    assert ctl.payload_bytes == before
    get(groups["c1"].echo(value))
    assert ctl.payload_bytes > before


def test_failure_propagates_through_a_chain(groups):
    failed = groups["p2"].fail()
    middle = groups["c2"].echo(failed)
    end = groups["c1"].echo(middle)
    with pytest.raises(RuntimeError, match="input 0") as info:
        get(end)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__
    assert any(isinstance(e, asyncrl.RemoteError) and "boom in the producer" in str(e)
               for e in chain)


def test_large_results_are_fetched_when_awaited(groups):
    n = 20000  # ~0.5 MB: too big to come inline with the Result
    out = get(groups["p2"].make(rows(n), width=4))
    assert out["i"].tolist() == list(range(n)) and out["v"].shape == (n, 4)


class Weights(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def full(self, mib: int) -> dict:  # a state dict's shape: a dict holding a large tensor
        return {"w": torch.full((mib, 1 << 18), 1.5), "step": 3}

    @asyncrl.register
    def load(self, state: dict) -> tuple:  # what each rank was sent, row by row
        return state["w"].view(state["rows"], -1).double().sum(1), self.rank

    @asyncrl.register(dispatch=Dispatch.DP)
    def row_sums(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"s": batch["x"].sum(1)})


def test_a_gigabyte_result_reaches_the_driver_while_heartbeats_flow():
    # Encoded into one signed message, a GiB kept the rank busy copying and hashing with the
    # GIL held for seconds: no heartbeat, and the controller declared it dead. Its bytes now
    # go as raw frames on a socket of their own, and arrive as the tensor's memory.
    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.1, heartbeat_timeout=1.5) as ctl:
            group = await ctl.spawn(Weights, name="weights")
            pids = group_pids(group)
            got = await group.full(1024)
            small = await group.full(1)  # the rank is alive and answers again
            return pids, got, small
    pids, got, small = run(main())
    assert_gone(pids)
    assert got["step"] == 3 and got["w"].shape == (1024, 1 << 18)  # checked once the loop
    assert bool((got["w"] == 1.5).all()) and small["w"].shape == (1, 1 << 18)  # is gone


@pytest.mark.parametrize("relay", [False, True])
def test_large_arguments_reach_the_ranks_while_heartbeats_flow(relay):
    # Encoded into the Call, 256 MiB held the controller's loop copying and signing for
    # seconds (per rank): its heartbeats stopped and the ranks left. The bytes now follow the
    # Call as raw frames, through the host's relay too, and the ranks use them as received.
    # (the test's own tensor work out of the loop: it would stop the heartbeats itself)
    w = torch.arange(1 << 26, dtype=torch.float32) % 1000  # 256 MiB

    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.1, heartbeat_timeout=1.5,
                                      relay=relay) as ctl:
            group = await ctl.spawn(Weights, nprocs=2, name="weights")
            pids = group_pids(group)
            loaded = await group.load({"w": w, "rows": 256})
            x = (torch.arange(64 * 4096) % 7).float().view(64, 4096)  # 1 MiB: a copy is sent
            sums = group.row_sums(TensorBatch({"x": x}))  # each rank its rows of the host's
            x.zero_()
            return pids, loaded, (await sums)["s"]
    pids, loaded, sums = run(main())
    expected = w.view(256, -1).double().sum(1)
    assert_gone(pids)
    assert [rank for _, rank in loaded] == [0, 1]
    assert all(torch.equal(got, expected) for got, _ in loaded)
    assert torch.equal(sums, (torch.arange(64 * 4096) % 7).float().view(64, 4096).sum(1))


class Built(asyncrl.Worker):
    def __init__(self, state: dict):
        self.state = state

    @asyncrl.register
    def row_sums(self) -> tuple:
        return self.state["w"].view(self.state["rows"], -1).double().sum(1), self.rank

    @asyncrl.register(dispatch=GATHER_TO_ZERO)  # every rank runs; rank 0's value is kept
    def differs(self, w: torch.Tensor) -> tuple:
        return int((w != self.state["w"]).sum()), self.rank


@pytest.mark.parametrize("relay", [False, True])
def test_large_arguments_reach_the_ranks_once_per_relay_while_heartbeats_flow(relay):
    # Encoded into the Construct, 256 MiB were copied and signed on the loop once per rank
    # as each said hello; now they follow it as raw frames, like a call's, once per relay.
    w = torch.arange(1 << 26, dtype=torch.float32) % 999  # 256 MiB

    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.1, heartbeat_timeout=1.5,
                                      relay=relay) as ctl:
            sent = []  # the raw frames' bytes the controller sends, socket by socket
            send = ctl.channel.send_encoded  # what every send comes down to

            def counted(identity, message, frames=()):
                sent.append(sum(memoryview(f).nbytes for f in frames))
                return send(identity, message, frames)
            ctl.channel.send_encoded = counted
            group = await ctl.spawn(Built, {"w": w, "rows": 512}, nprocs=2)
            pids = group_pids(group)
            assert group.construct_frames == []  # sent: no longer held
            constructed = sum(sent)
            sent.clear()
            # the ranks differ in whether they keep a result, and still share one Call
            assert await group.differs(w) == [0, 0]  # no byte differs; rank 0
            return pids, await group.row_sums(), constructed, sum(sent)
    pids, built, constructed, called = run(main())
    # to each rank's socket, or once to the host's relay, which hands them to both
    assert constructed == called == w.nbytes * (1 if relay else 2)
    assert_gone(pids)
    expected = w.view(512, -1).double().sum(1)
    assert [rank for _, rank in built] == [0, 1]
    assert all(torch.equal(got, expected) for got, _ in built)


def test_futures_inside_lists_and_dicts_are_pulled_too(bg, groups):
    p2, c1 = groups["p2"], groups["c1"]
    before = bg.ctl.payload_bytes
    got = get(c1.nested((p2.make(rows(4)), p2.make(rows(2))),
                        {"a": p2.make(rows(3)), "n": 5}))
    assert got == [[0, 1, 2, 3], [0, 1], ["a", ["row0", "row1", "row2"]], ["n", 5]]
    assert bg.ctl.payload_bytes == before  # pulled from p2's ranks, not through here


def test_a_cancelled_await_leaves_the_future_and_the_group_usable(bg, groups):
    async def main():
        made = groups["p2"].make(rows(4))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(made, 0)  # not done yet: this awaiter is cancelled
        return await groups["c1"].ids(made), (await made)["i"].tolist()
    assert bg.run(main()) == ([0, 1, 2, 3], [0, 1, 2, 3])


def test_an_awaited_result_that_cannot_be_sent_fails_that_await_only(groups):
    with pytest.raises(asyncrl.RemoteError, match=r"value\['obj'\]\[0\]: the int \d+ is past"):
        get(groups["p2"].unsendable())
    assert get(groups["p2"].info(1)) == [{"rank": 0, "k": 1}, {"rank": 1, "k": 1}]


def test_objects_are_freed_when_nothing_names_them(bg, groups):
    p2, c1 = groups["p2"], groups["c1"]
    held = p2.make(rows(4))
    get(held)
    for _ in range(300):
        get(c1.total(p2.make(rows(4))))
    gc.collect()
    deadline = time.monotonic() + 20  # stats come with heartbeats (1 s)
    while time.monotonic() < deadline and any(o != 1 for o, _ in p2.store_stats.values()):
        time.sleep(0.1)
    assert [o for o, _ in p2.store_stats.values()] == [1, 1]  # only `held` remains
    del held
    gc.collect()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(o for o, _ in p2.store_stats.values()):
        time.sleep(0.1)
    assert p2.store_stats == {0: (0, 0), 1: (0, 0)}


def test_malformed_transfer_requests_are_rejected(bg, groups):
    import zmq

    p2 = groups["p2"]
    made = p2.make(rows(4))
    get(made)
    addr = p2.ranks[0].data_addr
    secret = read_secret(str(bg.ctl.secret_file))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"tester/0/pull")
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(addr)
    signer, verifier = Signer(secret), Verifier(secret)

    def ask(pull):
        route = b"tester/0/pull@" + addr.encode()  # pulls are bound to the server they ask
        sock.send_multipart(signer.sign(route, messages.encode(pull)))
        frames = sock.recv_multipart()
        return messages.decode(verifier.verify(b">tester/0/pull", frames[:2]))

    try:
        obj = made._fut.result().obj_id
        sock.send_multipart([b"garbage", b"x" * 32])  # unsigned: dropped, no answer
        assert "not held" in ask(messages.Pull(1, obj_id=123456789, start=0, stop=1)).error
        assert "outside" in ask(messages.Pull(2, obj_id=obj, start=0, stop=99)).error
        assert "not a segment of the puller's pool" in ask(messages.Pull(
            3, obj_id=obj, start=0, stop=1, dest="../etc/passwd")).error
        other_pool = f"asyncrl-{bg.ctl.run_id}-c1+0-0"  # another rank's live segment
        assert "not a segment of the puller's pool" in ask(messages.Pull(
            5, obj_id=obj, start=0, stop=1, dest=other_pool,
            columns=[messages.ColumnDest("i", 0, 8)])).error
        lookalike = f"asyncrl-{bg.ctl.run_id}-tester-0+1-7"  # group "tester-0", not rank 0
        assert "not a segment of the puller's pool" in ask(messages.Pull(
            7, obj_id=obj, start=0, stop=1, dest=lookalike,
            columns=[messages.ColumnDest("i", 0, 8)])).error
        wrong_server = Signer(secret).sign(b"tester/0/pull@tcp://elsewhere:1",
                                           messages.encode(messages.Pull(6, obj_id=obj)))
        sock.send_multipart(wrong_server)  # signed for another server: dropped, no answer
        ok = ask(messages.Pull(4, obj_id=obj, start=0, stop=2))  # rank 0 holds rows 0-1
        assert not ok.error and ok.buffers == ["i", "x", "v"]
    finally:
        sock.close(0)
        ctx.term()
    assert get(groups["c1"].ids(made)) == [0, 1, 2, 3]  # the rank serves on


class Slow(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"i": batch["i"] * 2})

    @asyncrl.register
    def pid(self) -> int:
        return os.getpid()

    @asyncrl.register
    def big(self) -> TensorBatch:  # too big to come with its Result: fetched when awaited
        return TensorBatch({"x": torch.ones(2, 40_000)})


def test_stalled_producer_gives_transfer_timeout_naming_it():
    """A producer alive yet silent fails a consumer's pull, and a driver's fetch of its
    result, with TransferTimeout naming it; once it answers again, the result is there."""
    async def main():
        async with asyncrl.Controller(transfer_timeout=2, heartbeat_timeout=60,
                                      transport="tcp") as ctl:
            prod = await ctl.spawn(Slow, nprocs=1, name="stalled")
            cons = await ctl.spawn(Consumer, nprocs=1, name="cons")
            pids = group_pids(prod) + group_pids(cons)
            made = prod.make(rows(6))
            out = await cons.ids(made)  # forced TCP works end to end
            assert out == [0, 2, 4, 6, 8, 10]
            big = prod.big()
            await poll_until(big.done, 30, "the reference to the big result")
            os.kill(prod.pids[0], signal.SIGSTOP)
            try:
                with pytest.raises(asyncrl.TransferTimeout) as info:
                    await cons.ids(made)
                with pytest.raises(asyncrl.TransferTimeout) as fetched:
                    await big
            finally:
                os.kill(prod.pids[0], signal.SIGCONT)
            assert float((await big)[0]["x"].sum()) == 80_000  # asked again, answered
            return pids, str(info.value), str(fetched.value)
    pids, message, fetch = run(main())
    assert "stalled:0" in message and "within 2 s" in message and "cons[rank 0].ids" in message
    assert fetch.startswith("fetching the result of call ") and "from stalled:0: no answer " \
        "within 2 s, and 0.032 s more for its 320," in fetch and "transfer_timeout=" in fetch
    assert_gone(pids)


def test_a_producer_that_dies_fails_the_pull_with_its_death_not_a_timeout():
    """The consumer pulls from a stopped producer, which is then killed: the controller tells
    the consumer's rank, whose pull fails with InputLostError naming the death, not
    TransferTimeout at the 60 s limit; the group respawned is pulled from as before."""
    async def main():
        async with asyncrl.Controller(transfer_timeout=60, transport="tcp") as ctl:
            prod, cons = await asyncio.gather(ctl.spawn(Slow, nprocs=1, name="prod"),
                                              ctl.spawn(Consumer, nprocs=1, name="cons"))
            pids = group_pids(prod) + group_pids(cons)
            made, big = prod.make(rows(3)), prod.big()
            assert await cons.ids(made) == [0, 2, 4] and len((await big)[0]) == 2
            os.kill(prod.pids[0], signal.SIGSTOP)  # answers no pull from now on
            pulled = cons.ids(made)
            os.kill(prod.pids[0], signal.SIGKILL)
            with pytest.raises(asyncrl.InputLostError) as info:
                await asyncio.wait_for(pulled, 50)
            # a call made after the death is refused before it is sent (its ranks may never
            # have heard of it); a result that came whole with its Result goes as itself
            with pytest.raises(asyncrl.InputLostError, match=r"input 0 \(prod.big\) is lost: "
                               r"it was held by group 'prod', which is dead: "):
                await cons.echo(big)
            assert await cons.ids(made) == [0, 2, 4]
            await ctl.close_group(prod)
            prod = await ctl.spawn(Slow, nprocs=1, name="prod")
            pids += group_pids(prod)
            assert await cons.ids(prod.make(rows(2))) == [0, 2]
            return pids, str(info.value)
    pids, message = run(main())
    assert message.startswith("cons[rank 0].ids: cannot pull rows 0:3 of object ") and \
        "from prod:0: group 'prod' is dead" in message, message
    assert_gone(pids)


def test_rows_of_futures_are_one_batch_pulled_by_the_consumer(bg, groups):
    """`fut.rows(...)` and `asyncrl.concat(...)`: rows picked from results on two groups,
    in the order given, reach a DP consumer from the producers; awaited, the same rows."""
    p4, p2, c2, c1 = groups["p4"], groups["p2"], groups["c2"], groups["c1"]
    a = p4.make(rows(10))
    b = p2.make(TensorBatch({"i": torch.arange(100, 106)}))
    picked = asyncrl.concat(a.rows([9, 0, 4]), b.rows([5, 1]), a.rows([2]))
    before = bg.ctl.payload_bytes
    out = get(c2.echo(picked))
    assert bg.ctl.payload_bytes == before
    want = [9, 0, 4, 105, 101, 2]
    assert out["i"].tolist() == want and out["x"].tolist() == [10.0 * i for i in want]
    assert out["name"] == [f"row{i}" for i in want] and out["by"] == [0, 0, 0, 1, 1, 1]
    assert out["v"].tolist() == (torch.tensor(want)[:, None] * 100 + torch.arange(3)).to(
        torch.bfloat16).tolist()
    fetched = bg.run(_awaited(picked))
    assert fetched["i"].tolist() == want and fetched["name"] == out["name"]
    assert get(c1.ids(asyncrl.concat(b, a.rows([1])))) == [100, 101, 102, 103, 104, 105, 1]
    assert get(c1.ids(a.rows([3, 3, 0, 3, 8, 8]))) == [3, 3, 0, 3, 8, 8]  # repeats: in order

    with pytest.raises(IndexError, match="row 10 is outside this batch of 10 rows"):
        get(c1.ids(a.rows([10])))
    with pytest.raises(ValueError, match=r"differ in columns .*'v', 'bfloat16', \(4,\)"):
        get(c1.ids(asyncrl.concat(a, p2.make(rows(2), width=4))))
    with pytest.raises(TypeError, match="not a TensorBatch"):
        get(c1.ids(asyncrl.concat(p2.info(1))))
    with pytest.raises(IndexError, match="negative row indices"):
        a.rows([0, -1])
    with pytest.raises(TypeError, match="not a boolean mask"):
        a.rows(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="takes group calls' futures"):
        asyncrl.concat(a, rows(2))
    assert get(c1.ids(a)) == list(range(10))  # the picked-from futures are still whole


async def _awaited(picked):
    return await picked
