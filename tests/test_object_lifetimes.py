"""What a group call's result and a failed call keep, without processes: a closed group's
held call lets go of another group's result, a failed call of its arguments; a small result
outlives its group; a fetch that failed on one rank keeps the parts that arrived."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import threading
import types
import weakref
from collections.abc import Iterator

import msgspec
import pytest
import torch

from asyncrl.actors.protocols import Layout
from asyncrl.comm import codec
from asyncrl.comm.messages import MethodSpec, Schema
from asyncrl.comm.remote import RemoteValue
from asyncrl.controller.group import GroupHandle, RankInfo
from asyncrl.controller.objects import ObjectRef
from asyncrl.errors import ClosedError, EncodeError, GroupDeadError, InputLostError, TransferTimeout
from asyncrl.futures.future import DistFuture, Rows


def fake_controller(released: list[int] | None = None) -> types.SimpleNamespace:
    """What a GroupHandle asks of its controller, on the running loop; an object freed is
    noted in `released`."""
    ctl = types.SimpleNamespace(
        loop=asyncio.get_running_loop(), _loop_thread=threading.get_ident(), transfer_timeout=1.0,
        timeline=None, transport="tcp", calls={}, payload_bytes=0, relay_of={},
        links=types.SimpleNamespace(needed=lambda *a: False),
        releases=types.SimpleNamespace(later=lambda group, ranks, obj: (
            released.append(obj) if released is not None else None)))
    ctl.post = lambda *a: None
    return ctl


def group(ctl: types.SimpleNamespace, name: str, cls: type = object) -> GroupHandle:
    """A group of one rank with one method, f."""
    handle = GroupHandle(ctl, name, cls, Layout(name, (("dp", 1),)), None)
    handle.methods = {"f": MethodSpec("one_to_all")}
    handle.ranks = {0: RankInfo(1, "h", 0.0, b"io", b"exec")}
    return handle


async def turns(n: int = 8) -> None:
    """Let the loop run what is ready (a held call's tasks take a few turns to wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


@contextlib.contextmanager
def refcounts_only() -> Iterator[None]:
    """Objects freed only when nothing names them (no gc pass frees a cycle meanwhile)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_closed_groups_held_call_lets_go_of_another_groups_result():
    """A held call of group c waited on a's future when c was shut down: c kept its drain
    task, whose cancel's traceback named the future; a's result, once it came, was never
    released while c's handle lived (Recovery keeps a dead one until the next restart)."""
    released: list[int] = []

    async def main() -> None:
        ctl = fake_controller(released)
        a, c = group(ctl, "a"), group(ctl, "c")
        pending = DistFuture._new(ctl.loop, "a.make")
        out = c.call("f", pending)
        await turns()  # (the call waits for `pending`)
        c._fail_all(ClosedError("group 'c' was shut down"))
        await turns()
        assert isinstance(out._fut.exception(), ClosedError)
        pending._set_result(ObjectRef(a, 7, lambda p: p, {0: Schema(-1, nbytes=1 << 30)}, {}))
        del pending, out
        await turns()
        assert released == [7], "c's handle (named here still) keeps a's result"
    with refcounts_only():
        asyncio.run(main())


def test_a_call_failed_from_a_thread_lets_go_of_its_arguments():
    """A call made from a thread fails on the loop (an argument that cannot be sent): its
    error's traceback named the call, and so its 4 MiB argument, for as long as the failed
    future lived (and then until a gc pass)."""
    class Worker:
        def f(self, x, fn): ...

    async def main() -> None:
        c = group(fake_controller(), "c", Worker)
        big = torch.zeros(1 << 20)
        alive = weakref.ref(big)
        # (a pool joined before the check: its thread let go of the call's arguments only
        # after the loop had its answer, which a loaded machine showed)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = await asyncio.get_running_loop().run_in_executor(
                pool, c.call, "f", big, lambda: 0)
        del big
        with pytest.raises(EncodeError, match="cannot send argument 'fn'") as info:
            await fut
        assert alive() is None, "the failed future's error keeps the call's argument"
        assert info.traceback  # (its lines are kept)
    with refcounts_only():
        asyncio.run(main())


def test_a_small_result_of_a_group_dead_since_goes_as_itself():
    """Every part came with its Result: the controller has the value (`await` gives it), yet
    a call taking it raised InputLostError and recovery went back to a checkpoint."""
    async def main() -> None:
        ctl = fake_controller()
        a, b, c = group(ctl, "a"), group(ctl, "b"), group(ctl, "c")
        sent: list = []
        c._send = sent.append
        a.dead = GroupDeadError("a", 0, -9, "killed", "")
        small, alive = DistFuture._new(ctl.loop, "a.small"), DistFuture._new(ctl.loop, "b.small")
        for fut, producer in ((small, a), (alive, b)):
            fut._set_result(ObjectRef(producer, 7, lambda parts: parts[0], {0: Schema(-1)},
                                      {0: msgspec.Raw(codec.encode(5))}))
        c.call("f", small)
        c.call("f", alive)  # (a group alive: references, as before)
        rows = c.call("f", Rows([(small, None)]))  # (rows of it: not to mix with references)
        await turns()
        assert [item.args for item in sent[:1]] == [(5,)]
        assert [type(item.args[0]) for item in sent[1:]] == [RemoteValue]
        assert isinstance(rows._fut.exception(), InputLostError)
    asyncio.run(main())


def test_a_fetch_failed_on_one_rank_fetches_only_that_rank_again():
    """Rank 1's part timed out: the parts of ranks 0, 2 and 3 (a gigabyte each) that had
    arrived were thrown away, and the next await fetched all four again."""
    asked: list[int] = []

    async def fetch(rank: int, obj_id: int, nbytes: int = 0) -> str:
        asked.append(rank)
        await asyncio.sleep(0)
        if rank == 1 and asked.count(1) == 1:
            raise TransferTimeout("rank 1 slow")
        return f"part{rank}"

    async def main() -> list[str]:
        owner = types.SimpleNamespace(_fetch=fetch, _ctl=fake_controller())
        ref = ObjectRef(owner, 5, lambda parts: [parts[r] for r in sorted(parts)],
                        {r: Schema(-1, nbytes=1 << 30) for r in range(4)}, {})
        with pytest.raises(TransferTimeout):
            await ref.value()
        return await ref.value()
    assert asyncio.run(main()) == ["part0", "part1", "part2", "part3"]
    assert {r: asked.count(r) for r in range(4)} == {0: 1, 1: 2, 2: 1, 3: 1}


def test_a_failed_fetch_lets_go_of_the_result_when_its_future_goes():
    """A fetch timed out: the failed fetch kept in the ObjectRef held an error whose traceback
    named the ObjectRef, a cycle; the ranks kept the result until a gc pass."""
    released: list[int] = []

    async def fetch(rank: int, obj_id: int, nbytes: int = 0) -> None:
        raise TransferTimeout("rank 0 slow")

    async def main() -> None:
        owner = types.SimpleNamespace(_fetch=fetch, _ctl=fake_controller(released))
        fut = DistFuture._new(asyncio.get_running_loop(), "a.big")
        fut._set_result(ObjectRef(owner, 9, lambda p: p, {0: Schema(-1, nbytes=1 << 30)}, {}))
        with pytest.raises(TransferTimeout):
            await fut
        del fut
        await turns()
        assert released == [9], "the failed fetch's traceback keeps the result"
    with refcounts_only():
        asyncio.run(main())
