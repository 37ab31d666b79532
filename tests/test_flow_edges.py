"""Edges of a DataFlow's steps: a group call a node made but did not return (or gave up
waiting for) that fails, in a run and in a node run alone, one made from a thread without
the node's context, the cleanup of an exhausted step's other nodes and their calls, an input
item a node changes in place, and a close that is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types

import pytest

import asyncrl
import asyncrl.controller.finished as finished_mod
from asyncrl.controller.finished import Calls, note_call
from asyncrl.controller.inputs import Inputs
from asyncrl.futures.future import DistFuture


def steps_run(nodes: list, items: int) -> int:
    """Run a DataFlow of `nodes` over the input x = 0..items-1 in a Controller of its own
    (no groups): how many steps it ran."""
    async def main():
        async with asyncrl.Controller():
            flow = asyncrl.DataFlow(nodes=nodes, inputs={"x": range(items)}, groups=[])
            await flow.run()
            return flow.next_step
    return asyncio.run(asyncio.wait_for(main(), 60))


def failed_load_run(sync, said: str) -> tuple[asyncrl.NodeError, list[int]]:
    """`sync` as the node "sync", beside a rollout that follows it (max_staleness=0), for 3
    steps: the NodeError they end with (matching `said`) and the steps rolled out."""
    rolled: list[int] = []

    @asyncrl.node(follows="sync")
    def rollout(x):
        rolled.append(x)
        return x

    with pytest.raises(asyncrl.NodeError, match=said) as failed:
        steps_run([rollout, asyncrl.node(sync)], 3)
    return failed.value, rolled


def test_a_call_the_node_did_not_return_that_fails_fails_the_node():
    """`def sync(train): rollouts.load_weights(...); return {...}`: its load failing after the
    node returned was only waited for; the next rollout (follows="sync", max_staleness=0) ran
    on the old weights and the run ended normally."""
    def sync(rollout):
        load = DistFuture._new(asyncio.get_running_loop(), "rollouts.load_weights")
        note_call(load)  # as GroupHandle.call does
        asyncio.get_running_loop().call_soon(load._set_exception, RuntimeError("load failed"))
        return {"synced": rollout}

    failed, rolled = failed_load_run(sync, "node 'sync' failed at step 0")
    assert (failed.node, failed.step) == ("sync", 0)
    assert isinstance(failed.__cause__, RuntimeError)
    assert rolled == [0]  # no rollout after the failed load


def test_a_call_the_node_waited_for_and_gave_up_on_that_fails_fails_the_node():
    """`try: await asyncio.wait_for(rollouts.load_weights(...), 30) except TimeoutError: pass`:
    the wait marked the load awaited, its failure after the wait gave up was skipped, and the
    rollouts after it ran on the old weights while the run ended well."""
    async def sync(rollout):
        load = DistFuture._new(asyncio.get_running_loop(), "rollouts.load_weights")
        note_call(load)
        try:
            await asyncio.wait_for(load, 0.01)  # a bounded wait, then go on
        except asyncio.TimeoutError:
            load._set_exception(RuntimeError("load failed"))  # after the wait gave up
        return {"synced": rollout}

    failed, rolled = failed_load_run(sync, "load failed")
    assert (failed.node, failed.step) == ("sync", 0)
    assert rolled == [0]  # no rollout on the old weights


def test_a_call_failure_a_task_of_the_node_caught_after_it_returned_is_not_the_nodes():
    """A retry task the node started awaits the load and handles its failure: the failure
    reaches it in the same turn of the loop as the node's wait for its calls, which read the
    failure as not awaited when that wait was woken first."""
    caught: list[str] = []

    @asyncrl.node
    def sync(x):
        loop = asyncio.get_running_loop()
        load = DistFuture._new(loop, "rollouts.load_weights")
        note_call(load)

        async def retry():
            try:
                await load
            except RuntimeError as e:
                caught.append(str(e))
        asyncio.ensure_future(retry())  # starts after the node returned
        loop.call_soon(load._set_exception, RuntimeError("load failed"))
        return x

    assert steps_run([sync], 2) == 2
    assert caught == ["load failed", "load failed"]


def test_a_call_a_thread_gave_up_waiting_for_fails_later_as_the_nodes():
    """fut.result(timeout=) from a thread that timed out marked the call awaited too."""
    async def main():
        calls = Calls()
        load = DistFuture._new(asyncio.get_running_loop(), "rollouts.load_weights")
        calls.run(calls.add, {"future": load})
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(load.result, 0.01)
        load._set_exception(RuntimeError("load failed"))
        await calls.done()
        return calls.failed
    assert isinstance(asyncio.run(main()), RuntimeError)


def test_a_call_from_a_thread_without_the_nodes_context_is_warned_of(caplog, monkeypatch):
    """A group call from a thread a node started with run_in_executor (or a
    ThreadPoolExecutor, a threading.Thread) is not the node's: the step neither waited for it
    nor failed with it, and nothing said so."""
    monkeypatch.setattr(finished_mod, "_warned", [], raising=False)  # (once a process)

    @asyncrl.node
    async def sync(x):
        loop = asyncio.get_running_loop()

        def load():  # GroupHandle.call noting its call, on the node's thread
            call = DistFuture._new(loop, "rollouts.load_weights")
            note_call(call)
            return call
        for call in (await loop.run_in_executor(None, load), await asyncio.to_thread(load)):
            call._set_result(None)
        return x

    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        steps_run([sync], 2)
    warned = [r.getMessage() for r in caplog.records if "asyncio.to_thread" in r.getMessage()]
    assert len(warned) == 1 and "rollouts.load_weights" in warned[0]


def test_a_node_run_alone_fails_with_a_call_it_did_not_return():
    """`asyncrl run flow.py --node sync` (DataFlow.run_node) neither waited for the node's
    calls nor raised their failure: the load was cut off by the close, success printed."""
    @asyncrl.node
    def sync(train):
        load = DistFuture._new(asyncio.get_running_loop(), "rollouts.load_weights")
        note_call(load)
        asyncio.get_running_loop().call_soon(load._set_exception, RuntimeError("load failed"))
        return {"synced": train}

    flow = asyncrl.DataFlow(nodes=[sync], inputs={"train": [1]}, groups=[])
    with pytest.raises(RuntimeError, match="load failed"):
        asyncio.run(asyncio.wait_for(flow.run_node("sync", {"train": 1}), 60))


def test_a_call_whose_failure_the_node_awaited_and_caught_is_its_own():
    """A node that awaits a call and handles its failure (a retry, a fallback) has not
    failed: only the failures of calls it did not await are its own that way."""
    handled: list[str] = []

    @asyncrl.node
    async def score(x):
        loop = asyncio.get_running_loop()
        call = DistFuture._new(loop, "judge.score")
        note_call(call)
        loop.call_soon(call._set_exception, RuntimeError("judge busy"))
        try:
            return await call
        except RuntimeError as e:
            handled.append(str(e))
            return 0.0

    assert steps_run([score], 2) == 2
    assert handled == ["judge busy", "judge busy"]


def test_a_death_under_a_call_the_node_left_and_failures_it_caught_in_concat_pass():
    """A group's death under a call the node did not await is met by the next call to the
    group (recovery's re-run there, not a rewind of the whole flow); a concat the node
    awaited and caught fails none of its parts' calls later."""
    from asyncrl.errors import GroupDeadError

    @asyncrl.node
    async def score(x):
        loop = asyncio.get_running_loop()
        warm, first, second = (DistFuture._new(loop, f"judge.{m}") for m in "abc")
        for call in (warm, first, second):
            note_call(call)
        warm._set_exception(GroupDeadError("judge", 0, -9, "killed"))
        first._set_exception(RuntimeError("judge busy"))
        second._set_exception(RuntimeError("judge busy"))
        try:
            return await asyncrl.concat(first, second)
        except RuntimeError:
            return 0.0

    assert steps_run([score], 2) == 2


def test_an_input_lost_under_a_call_the_node_left_fails_the_node():
    """rollouts.load_weights(trainer.sync_pack()) failing because the trainer's pack went
    with its group: the rollout group lives, and its next call (the next step's rollout)
    would run on the old weights without saying so; the node fails instead."""
    from asyncrl.errors import InputLostError

    @asyncrl.node
    def sync(x):
        load = DistFuture._new(asyncio.get_running_loop(), "rollouts.load_weights")
        note_call(load)
        load._set_exception(InputLostError("the pack's group 'trainer' died"))
        return x

    with pytest.raises(asyncrl.NodeError, match="node 'sync' failed at step 0"):
        steps_run([sync], 2)


def test_a_call_failure_a_re_run_of_the_node_repaired_is_forgotten():
    """Recovery re-runs a node after a stateless group's death: the failed calls of its first
    run are still waited for, but only the re-run's calls can fail it."""
    async def main():
        loop = asyncio.get_running_loop()
        calls = Calls()
        first, late, again = (DistFuture._new(loop, "ref.logprobs") for _ in range(3))
        calls.run(lambda: (calls.add(first), calls.add(late)), {})
        first._set_exception(ConnectionError("the group died"))
        await asyncio.wait([first._fut])  # (its done callbacks, the Calls' first, have run)
        failed_once = calls.failed
        calls.run(calls.add, {"future": again})  # the re-run
        late._set_exception(ConnectionError("the group died"))  # a call of the first run
        again._set_result(1)
        await calls.done()
        return failed_once, calls.failed
    failed_once, failed = asyncio.run(main())
    assert isinstance(failed_once, ConnectionError)
    assert failed is None


def test_an_exhausted_steps_other_nodes_end_before_the_last_save_and_the_close():
    """A node raising InputsExhausted cancelled its step's other nodes but did not wait for
    them, nor for the group calls they had sent: their cleanup and those calls ran after the
    last checkpoint was saved, and after the flow closed."""
    order: list[tuple[str, int]] = []
    sides: list[asyncio.Task] = []

    @asyncrl.node
    def gen(x):
        if x == 1:
            raise asyncrl.InputsExhausted("the node's own prompts ran out")
        return x

    @asyncrl.node
    async def side(x):
        if x == 0:
            return x
        sides.append(asyncio.current_task())  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        call = DistFuture._new(loop, "trainer.step")  # sent: it runs on after the cancel
        note_call(call)

        def ended():
            order.append(("call ended", x))
            call._set_result(None)
        try:
            await asyncio.Event().wait()  # cancelled with the exhausted step
        finally:
            await asyncio.sleep(0.2)  # cleanup that takes a while (closing a file, a client)
            order.append(("cleaned", x))
            loop.call_later(0.2, ended)  # the call ends after the node did

    async def save(t):
        order.append(("save", t))

    async def main():
        async with asyncrl.Controller():
            flow = asyncrl.DataFlow(nodes=[gen, side], inputs={"x": range(3)}, groups=[])
            async with flow:
                await flow.run(checkpoint=save)
            return [t for t in sides if not t.done()]
    left = asyncio.run(asyncio.wait_for(main(), 60))
    assert order == [("cleaned", 1), ("call ended", 1), ("save", 0)]
    assert left == []


def test_an_item_a_node_changed_in_place_is_checked_as_it_was_read():
    """A node adding a key to its DataLoader batch made the checkpoint's digest differ from a
    fresh read: the resume was refused as an input whose order changes from run to run."""
    ran = Inputs({"x": [{"p": 1}, {"p": 2}]})
    ran.reset()
    ran.next()["x"]["seen"] = True  # the node's change
    Inputs({"x": [{"p": 1}, {"p": 2}]}).check(ran.positions())  # raised CheckpointError
    ran.next()["x"]["seen"] = True
    ran.unread()  # (its node's own inputs ran out): the digest of the step before is back
    saved = ran.positions()
    assert saved["x"]["consumed"] == 1
    Inputs({"x": [{"p": 1}, {"p": 2}]}).check(saved)


def test_a_close_cancelled_while_it_waits_for_the_steps_still_closes_the_groups():
    """A second Ctrl-C (or SIGTERM) while close() waited for a task that outlives a cancel
    (a respawn) skipped the close: no group nor the flow's own Controller closed (its shared
    memory and folders left), and the flow could not be opened again."""
    @asyncrl.node
    def a(x):
        return x

    async def main():
        flow = asyncrl.DataFlow(nodes=[a], inputs={"x": 1}, groups=[])
        closed: list = []

        class Ctl:
            async def close_group(self, handle):
                closed.append(("group", handle))

            async def close(self):
                closed.append("controller")
        flow._ctl, flow._own_ctl = Ctl(), True
        flow.groups = [types.SimpleNamespace(name="g", handle="H")]
        release = asyncio.Event()

        async def unstoppable():  # a watcher waiting for a spawn that goes on when cancelled
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
        watcher = asyncio.ensure_future(unstoppable())
        flow._watchers.add(watcher)
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(flow.close())
        await asyncio.sleep(0.05)
        closing.cancel()  # the second Ctrl-C
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait([closing, watcher])
        return closing.cancelled(), closed, flow._ctl
    cancelled, closed, ctl = asyncio.run(asyncio.wait_for(main(), 60))
    assert cancelled and closed == [("group", "H"), "controller"] and ctl is None
