"""What holds a DataFlow's steps back, and what one step() leaves behind: a node's group calls
it did not return, a driver's timeout, an exhausted node's input item, two step() calls at
once, a failed step's recovery watchers, what leaving `async with flow:` waits for, and the
graph's checks of its arguments."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

import asyncrl
from asyncrl.compat import cancelling
from asyncrl.controller.inputs import _digest
from asyncrl.futures.future import DistFuture, Held


def _pending(label: str) -> DistFuture:
    return DistFuture._new(asyncio.get_running_loop(), label)


class Loader(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def load(self, seconds: float) -> float:
        time.sleep(seconds)  # stands in for loading new weights: work, not synchronisation
        return seconds


    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def pair(self, a: asyncrl.TensorBatch, b: asyncrl.TensorBatch) -> asyncrl.TensorBatch:
        return a


loader = asyncrl.group(Loader, name="loader")


def test_a_call_refused_where_it_was_made_holds_no_step_back():
    """A call whose arguments the controller refuses (DP batches of other lengths) raised,
    and its future, noted as the node's, never ended: a node that caught the error never
    finished, and the next step's follows edge waited for ever."""
    from asyncrl import TensorBatch

    @asyncrl.node(follows="check")
    def roll(x):
        return x

    @asyncrl.node
    def check(roll):
        try:
            loader.pair(TensorBatch({"i": [1, 2, 3]}), TensorBatch({"i": [1, 2]}))
        except ValueError:
            return {"refused": 1}

    async def main():
        flow = asyncrl.DataFlow(nodes=[roll, check], inputs={"x": range(3)},
                                groups=[loader])
        async with flow:
            return [await flow.step() for _ in range(3)]
    steps = asyncio.run(asyncio.wait_for(main(), 60))
    assert [s["check"] for s in steps] == [{"refused": 1}] * 3


def test_a_follows_edge_and_a_checkpoint_wait_for_a_call_the_node_did_not_return():
    """`def sync(train): rollouts.load_weights(...); return {...}` counted as finished at
    once: at max_staleness 0 the next rollout started before the new weights landed, and a
    checkpoint saved while they still loaded."""
    order: list = []

    @asyncrl.node(follows="sync")
    def roll(x):
        order.append(("roll", x))
        return x

    @asyncrl.node
    def sync(roll):
        call = loader.load(0.2)  # not returned: the node returns None
        call._fut.add_done_callback(lambda _: order.append(("loaded", roll)))

    async def save(t):
        order.append(("save", t))

    async def main():
        async with asyncrl.Controller():
            flow = asyncrl.DataFlow(nodes=[roll, sync], inputs={"x": range(3)},
                                    groups=[loader], checkpoint_every=1)
            await flow.run(checkpoint=save)
    asyncio.run(asyncio.wait_for(main(), 120))
    assert order == [(what, t) for t in range(3) for what in ("roll", "loaded", "save")]


def _edge_flow(late: list) -> asyncrl.DataFlow:
    """rollout follows train; train of step 0 returns a future the test sets (`late`)."""
    @asyncrl.node(follows="train")
    def rollout(x):
        return x

    @asyncrl.node
    def train(rollout):
        if rollout:
            return rollout
        late.append(_pending("train 0"))
        return late[0]

    return asyncrl.DataFlow(nodes=[rollout, train], inputs={"x": range(3)}, groups=[])


def test_a_driver_timing_out_a_step_waiting_on_its_follows_edge_can_step_again():
    """The timeout cancelled step 1's nodes waiting on train 0: the next step() raised
    "step 1 failed" (a rewind needed), its input item used up."""
    late: list = []
    flow = _edge_flow(late)

    async def main():
        async with flow:
            await flow.step()
            with pytest.raises(asyncio.TimeoutError):  # train 0 runs on: step 1 waits for it
                await asyncio.wait_for(flow.step(), 0.05)
            late[0]._set_result(Held("train 0"))
            second = await asyncio.wait_for(flow.step(), 30)
            third = await asyncio.wait_for(flow.step(), 30)
        return second["rollout"], third["rollout"], flow.next_step
    assert asyncio.run(main()) == (1, 2, 3)


def test_a_step_ended_by_its_nodes_inputs_running_out_leaves_its_item_unread():
    """The step's input item counted as consumed: the last checkpoint saved consumed=3
    where item 2 was never trained on, and a resume with more data skipped it."""
    @asyncrl.node
    def gen(x):
        if x == 2:
            raise asyncrl.InputsExhausted("the node's own prompts ran out")
        return x

    async def main():
        saved = []

        async def save(t):
            saved.append((t, flow.positions()))

        async with asyncrl.Controller():
            flow = asyncrl.DataFlow(nodes=[gen], inputs={"x": [0, 1, 2, 3]}, groups=[])
            await flow.run(checkpoint=save)
            return saved, flow.feed.next()
    saved, again = asyncio.run(main())
    assert saved == [(1, {"x": {"consumed": 2, "item": _digest(1)}})]
    assert again == {"x": 2}  # read again, as a resume from that checkpoint does


def test_two_steps_at_once_are_refused():
    """gather(flow.step(), flow.step()) gave two steps one index (steps 2 and 2)."""
    @asyncrl.node
    def echo(x):
        return x

    async def main():
        flow = asyncrl.DataFlow(nodes=[echo], inputs={"x": range(5)}, groups=[])
        async with flow:
            await flow.step()
            await flow.step()
            both = await asyncio.gather(flow.step(), flow.step(), return_exceptions=True)
            return both, await flow.step(), flow.next_step
    (first, second), after, next_step = asyncio.run(main())
    assert first == {"echo": 2} and isinstance(second, RuntimeError)
    assert "await each step before calling the next (or use flow.run())" in str(second)
    assert (after, next_step) == ({"echo": 3}, 4)


def test_a_failed_steps_recovery_watchers_are_cancelled_with_it(monkeypatch):
    """With restarts on, a node's returned futures are followed by a watcher that re-runs
    the node if a stateless group dies; a failed step's watchers ran on, free to respawn a
    group and re-run its node (spending a restart) for a step nothing would use."""
    from asyncrl.controller.recovery import Recovery

    monkeypatch.setattr(Recovery, "enabled", property(lambda self: True))  # (no group)

    @asyncrl.node
    def keep(x):
        return _pending(f"keep {x}")  # followed by a watcher

    @asyncrl.node
    def broken(keep):
        raise ValueError("broken beside it")

    async def main():
        flow = asyncrl.DataFlow(nodes=[keep, broken], inputs={"x": [0]}, groups=[])
        async with flow:
            with pytest.raises(asyncrl.NodeError, match="broken beside it"):
                await flow.step()
            watchers = list(flow._watchers)
            return len(watchers), all(cancelling(w) for w in watchers)
    assert asyncio.run(main()) == (1, True)


def test_a_left_behind_bound_wait_failing_later_is_not_logged_as_never_retrieved(caplog):
    """A driver's timeout on step 2's wait for step 0, whose work fails after: the shielded
    gather it left behind logged "_GatheringFuture exception was never retrieved"."""
    late: list = []

    @asyncrl.node
    def slow(x):
        if x:
            return x
        late.append(_pending("slow 0"))
        return late[0]

    async def main():
        flow = asyncrl.DataFlow(nodes=[slow], inputs={"x": range(4)}, groups=[])
        async with flow:
            await flow.step()
            await flow.step()
            with pytest.raises(asyncio.TimeoutError):  # step 2 waits for all of step 0
                await asyncio.wait_for(flow.step(), 0.05)
            late[0]._set_exception(RuntimeError("slow 0 failed"))
            with pytest.raises(asyncrl.NodeError, match="slow 0 failed"):
                await flow.step()
        gc.collect()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert "never retrieved" not in caplog.text


def test_leaving_a_flows_block_raises_a_failure_of_its_last_steps_calls():
    """`async with flow: await flow.step()`: leaving closed the flow at once, cancelling the
    step's finish; the failure of a group call its node did not return was dropped."""
    @asyncrl.node
    def n(x):
        loader.load(-1.0)  # the rank raises (a negative sleep); not returned
        return {"ok": 1}

    async def main():
        flow = asyncrl.DataFlow(nodes=[n], inputs={"x": range(3)}, groups=[loader])
        async with flow:
            assert await flow.step() == {"n": {"ok": 1}}
    with pytest.raises(asyncrl.NodeError, match="node 'n' failed at step 0"):
        asyncio.run(asyncio.wait_for(main(), 60))


def test_leaving_a_flows_block_lets_its_last_steps_calls_finish(monkeypatch):
    """A slow call the last step's node made and did not return was cut off by the close."""
    loaded: list = []

    @asyncrl.node
    def sync(x):
        call = loader.load(0.5)  # stands in for new weights loading
        call._fut.add_done_callback(lambda f: loaded.append(
            "failed" if f.cancelled() or f.exception() else "loaded"))
        return {"synced": x}

    async def main():
        flow = asyncrl.DataFlow(nodes=[sync], inputs={"x": range(3)}, groups=[loader])
        closing = flow.close

        async def close():  # what had finished when the flow began to close
            loaded.append("closing")
            await closing()
        monkeypatch.setattr(flow, "close", close)
        async with flow:
            await flow.step()
    asyncio.run(asyncio.wait_for(main(), 60))
    assert loaded == ["loaded", "closing"]


def test_follows_takes_a_node_or_its_name():
    @asyncrl.node
    def train(rollout):
        return rollout

    @asyncrl.node(follows=train)  # the node itself: "unhashable type: 'Node'" before
    def rollout(x):
        return x

    assert rollout.follows == "train"
    flow = asyncrl.DataFlow(nodes=[rollout, train], inputs={"x": [1]}, groups=[])
    assert flow.order == ["rollout", "train"]
    with pytest.raises(asyncrl.FlowError, match="follows= takes a node or its name"):
        asyncrl.node(follows=3)


def test_an_input_named_as_a_nodes_output_and_bool_counts_are_refused():
    @asyncrl.node
    def gen(x):
        return x

    with pytest.raises(asyncrl.FlowError, match=r"\['gen_out'\] name both a flow input and a "
                                                r"node \(or its output"):
        asyncrl.DataFlow(nodes=[gen], inputs={"x": [1], "gen_out": 5}, groups=[])
    for name in ("max_staleness", "steps", "checkpoint_every"):
        with pytest.raises(asyncrl.FlowError, match=f"{name} must be an int"):
            asyncrl.DataFlow(nodes=[gen], inputs={"x": [1]}, groups=[], **{name: True})


def test_a_run_of_constant_inputs_without_steps_is_warned_of(caplog):
    """Nothing runs out: the run goes on for ever unless a node ends it (InputsExhausted)."""
    @asyncrl.node
    def const(lr, step):
        if step == 2:
            raise asyncrl.InputsExhausted("done")
        return lr

    async def main():
        async with asyncrl.Controller():
            flow = asyncrl.DataFlow(nodes=[const], inputs={"lr": 0.1}, groups=[])
            return await flow.run()
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert asyncio.run(main()) == [{"const": 0.1}] * 2
    assert "inputs are all constants and it has no steps=" in caplog.text


def test_a_flow_without_nodes_and_nodes_that_cannot_run_are_refused():
    """Each passed construction: no nodes failed the first step on an empty wait; a generator
    node's body never ran (its consumers got the generator); a positional-only parameter
    was a TypeError at step 0."""
    with pytest.raises(asyncrl.FlowError, match=r"this flow has no nodes: .*at least one"):
        asyncrl.DataFlow(nodes=[], inputs={"x": [1]}, groups=[])

    async def agen(x):
        yield x

    def gen(x):
        yield x

    for f in (agen, gen):
        with pytest.raises(asyncrl.FlowError, match=f"node '{f.__name__}' is a generator "
                                                    f"function .*: return it"):
            asyncrl.node(f)

    def only(x, /, y):
        return x

    with pytest.raises(asyncrl.FlowError, match=r"node 'only': parameter 'x' is "
                                                r"positional-only.*remove the '/'"):
        asyncrl.node(inputs={"y": "x"})(only)


@pytest.mark.parametrize("end", ["steps", "node"])
def test_a_dataloaders_workers_end_with_the_flows_run(end):
    """Its iterator was held by the flow (to be read on): its worker processes lived on after
    run() returned, for as long as the DataFlow did (a notebook, a sweep of flows). A node
    whose own inputs ran out puts its step's item back: the iterator is wrapped then."""
    import multiprocessing

    import torch
    from torch.utils.data import DataLoader

    @asyncrl.node
    def take(x, step):
        if end == "node" and step == 2:
            raise asyncrl.InputsExhausted("the node's own prompts ran out")
        return x.tolist()

    async def main(flow):
        async with asyncrl.Controller():
            return await flow.run()

    flow = asyncrl.DataFlow(nodes=[take], groups=[], steps=2 if end == "steps" else 3, inputs={
        "x": DataLoader(list(range(20)), batch_size=2, num_workers=1)})
    try:
        for _ in range(2):  # a second run opens the input again
            assert asyncio.run(main(flow)) == [{"take": [0, 1]}, {"take": [2, 3]}]
            assert multiprocessing.active_children() == []
            assert flow.positions() == {"x": {"consumed": 2,
                                              "item": _digest(torch.tensor([2, 3]))}}
    finally:
        flow.feed._iters.clear()  # (a failure leaves no worker behind)


def test_max_staleness_without_a_follows_edge_is_warned_of(caplog):
    """Only a follows= edge waits for train of step t-k-1: without one, the in-flight bound
    alone let steps overlap k+1 apart (k=0: rollout 1 ran beside train 0), said nowhere."""
    @asyncrl.node
    def rollout(x):
        return x

    @asyncrl.node
    def train(rollout):
        return rollout

    async def opened(flow):
        async with flow:
            pass

    roll_after = asyncrl.node(follows="train", name="rollout")(rollout.fn)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        loose = asyncrl.DataFlow(nodes=[rollout, train], inputs={"x": [1]}, groups=[],
                                 max_staleness=1)
        assert caplog.text == ""  # (not where it is made: each process importing the file)
        asyncio.run(opened(loose))
    assert caplog.text.count("no node of this flow has one: steps overlap up to 2 apart") == 1
    assert "this flow's nodes: ['rollout', 'train']" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        asyncio.run(opened(asyncrl.DataFlow(nodes=[roll_after, train], inputs={"x": [1]},
                                            groups=[], max_staleness=1)))
        asyncio.run(opened(asyncrl.DataFlow(nodes=[rollout, train], inputs={"x": [1]},
                                            groups=[])))  # (k=0: the default)
    assert "max_staleness" not in caplog.text
