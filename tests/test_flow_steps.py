"""A DataFlow whose node fails while stepping: said at once, and no step after it."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import sys
import threading

import pytest
import torch

import asyncrl
from asyncrl.actors.worker import rng_state
from asyncrl.controller import launch
from asyncrl.controller.inputs import Inputs, _digest
from asyncrl.controller.recovery import Recovery
from asyncrl.controller.timeline import Timeline
from asyncrl.errors import CheckpointError


def test_a_step_after_a_failed_one_is_refused_with_what_to_do():
    """A driver that catches a node's failure and steps on: the failed step's nodes were
    cancelled, and the next step's follows= edge waits on them (it raised CancelledError,
    which looks like the driver itself was cancelled)."""
    @asyncrl.node
    def gen(x):
        if x == 2:
            raise ValueError("no sample for 2")
        return x

    @asyncrl.node(follows="train")
    def rollout(gen):
        return gen

    @asyncrl.node
    def train(rollout):
        return rollout

    async def main():
        async with asyncrl.DataFlow(nodes=[gen, rollout, train], inputs={"x": [1, 2, 3]},
                                    groups=[]) as flow:
            first = await flow.step()
            with pytest.raises(asyncrl.NodeError, match="no sample for 2"):
                await flow.step()
            with pytest.raises(asyncrl.FlowError, match=re.escape(
                    "step 1 failed, and the steps after it need its nodes: rewind")):
                await flow.step()
            return first
    assert asyncio.run(main()) == {"gen": 1, "rollout": 1, "train": 1}


def test_a_nodes_failure_is_said_without_waiting_for_a_slower_node_before_it():
    never = []  # set only by a step that ends: the slow node waits on it

    @asyncrl.node
    async def slow(x):
        await never[0].wait()

    @asyncrl.node
    def broken(x):
        raise ValueError("broken at once")

    async def main():
        never.append(asyncio.Event())
        flow = asyncrl.DataFlow(nodes=[slow, broken], inputs={"x": [1]}, groups=[])
        assert flow.order == ["slow", "broken"]
        async with flow:
            with pytest.raises(asyncrl.NodeError, match="broken at once"):
                await asyncio.wait_for(flow.step(), 30)  # not a TimeoutError
    asyncio.run(main())


class Faulty(asyncrl.Worker):
    @asyncrl.register
    def make(self, x):
        raise ValueError(f"no rollout for {x}")

    @asyncrl.register
    def take(self, rows):
        return rows


faulty = asyncrl.group(Faulty, name="faulty")


def test_a_failure_is_named_by_the_node_it_began_in_not_one_it_fed():
    """`train` awaits a call on `gen`'s failed result: its own call fails first, with
    'input 0 (faulty.make) failed', but the error names gen, whose work failed."""
    @asyncrl.node
    def gen(x):
        return faulty.make(x)

    @asyncrl.node
    async def train(gen):
        return await faulty.take(gen)

    async def main():
        async with asyncrl.DataFlow(nodes=[gen, train], inputs={"x": [1]}, groups=[faulty]) \
                as flow:
            with pytest.raises(asyncrl.NodeError) as info:
                await asyncio.wait_for(flow.step(), 60)
        return info.value
    err = asyncio.run(main())
    assert err.node == "gen" and "no rollout for 1" in str(err), str(err)


restartable = asyncrl.group(Faulty, name="restartable", max_restarts=1)


def test_a_one_shot_input_with_restarts_is_refused_when_the_flow_opens():
    """A rewind reads the inputs again from the start: a generator cannot be. It was found
    out at the first rewind, maybe hours in; now when the flow opens, before any step."""
    @asyncrl.node
    def gen(x):
        return restartable.make(x)

    async def main():
        flow = asyncrl.DataFlow(nodes=[gen], inputs={"x": (i for i in range(3))},
                                groups=[restartable])
        with pytest.raises(asyncrl.FlowError, match="input 'x' is a one-shot iterator"):
            await flow.open()  # (a failed open closes what it started)
        # without restarts (no rewind) a generator is fine
        async with asyncrl.DataFlow(nodes=[gen], inputs={"x": (i for i in range(3))},
                                    groups=[faulty]):
            pass
    asyncio.run(main())


def test_a_driver_timing_out_a_step_waiting_on_its_bound_can_step_again():
    """A driver's `wait_for(flow.step(), T)` that timed out while the step waited for step
    t-k-2 cancelled that step's finish tracking: every later step raised CancelledError."""
    from asyncrl.futures.future import DistFuture, Held

    late: list = []  # step 0's eval: a DistFuture set only when the test says so

    def done_now(label):
        f = DistFuture._new(asyncio.get_running_loop(), label)
        f._set_result(Held(label))
        return f

    @asyncrl.node(follows="train")
    def rollout(x):
        return done_now("rollout")

    @asyncrl.node
    def train(rollout):
        return done_now("train")

    @asyncrl.node
    def evaluate(train, step):
        if step:
            return done_now("eval")
        late.append(DistFuture._new(asyncio.get_running_loop(), "eval"))
        return late[0]

    async def main():
        async with asyncrl.DataFlow(nodes=[rollout, train, evaluate], inputs={"x": range(4)},
                                    groups=[]) as flow:
            await flow.step()
            await flow.step()
            with pytest.raises(asyncio.TimeoutError):  # step 2 waits for all of step 0
                await asyncio.wait_for(flow.step(), 0.2)
            late[0]._set_result(Held("eval"))
            third = await asyncio.wait_for(flow.step(), 30)
        return flow.next_step, sorted(third)
    assert asyncio.run(main()) == (3, ["evaluate", "rollout", "train"])


def test_the_steps_finished_before_a_failure_reach_on_step():
    """Train's work failing at step 3 surfaced as step 4 was dispatched, after step 2 had
    finished (its bound); the steps still pending were dropped: metrics.jsonl lacked step
    2, which trained."""
    from asyncrl.futures.future import DistFuture, Held

    def soon(label, fail=False, after=0.01):
        loop = asyncio.get_running_loop()
        f = DistFuture._new(loop, label)
        # (work that takes a while: steps stay unfinished for a while, as on real ranks)
        loop.call_later(after, lambda: f._set_exception(RuntimeError(f"{label} failed"))
                        if fail else f._set_result(Held(label)))
        return f

    @asyncrl.node(follows="train")
    def rollout(x):
        return soon("rollout")

    @asyncrl.node
    def train(rollout, step):
        return soon(f"train {step}", fail=step == 3)

    @asyncrl.node
    def evaluate(train):  # a side node, slower: its step finishes after the next begins
        return soon("eval", after=0.03)

    async def main():
        seen = []
        async with asyncrl.DataFlow(nodes=[rollout, train, evaluate], inputs={"x": range(8)},
                                    groups=[]) as flow:
            with pytest.raises(asyncrl.NodeError, match="train 3 failed"):
                await flow.run(on_step=lambda t, values, s: seen.append(t))
        return seen
    assert asyncio.run(main()) == [0, 1, 2]


def test_groups_declared_in_another_module_run_when_the_nodes_name_them(tmp_path, monkeypatch):
    """A flow file that moved its groups into a module of its own (`from roles import
    actor`, `import roles; roles.critic`, a closure): the DataFlow found only groups
    declared beside its nodes, and a node's call said the group was not running."""
    from asyncrl.controller.declare import declared_count, forget_declared_after

    (tmp_path / "roles_mod.py").write_text(
        "import asyncrl\n"
        "class Echo(asyncrl.Worker):\n    pass\n"
        "actor = asyncrl.group(Echo, name='actor')\n"
        "critic = asyncrl.group(Echo, name='critic')\n"
        "unused = asyncrl.group(Echo, name='unused')\n"
        "other = asyncrl.group(Echo, name='other')\n")
    (tmp_path / "flow_mod.py").write_text(
        "import asyncrl\nimport roles_mod\nfrom roles_mod import actor\n"
        "local = asyncrl.group(roles_mod.Echo, name='local')\n"
        "def make(spec):\n"
        "    @asyncrl.node\n"
        "    def reward(prompts):\n        return spec\n"
        "    return reward\n"
        "@asyncrl.node\ndef rollout(prompts):\n    return actor\n"
        "@asyncrl.node\ndef train(rollout):\n    return [roles_mod.critic for _ in rollout]\n"
        "import types\nheld = types.SimpleNamespace(other=1)\n"
        "@asyncrl.node\ndef read(train):\n    return held.other  # not roles_mod's other\n"
        "flow = asyncrl.DataFlow(nodes=[rollout, train, read, make(roles_mod.unused)],\n"
        "                        inputs={'prompts': [1]})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    count = declared_count()
    try:
        import flow_mod

        names = [g.name for g in flow_mod.flow.groups]
    finally:
        forget_declared_after(count)
        for module in ("flow_mod", "roles_mod"):
            sys.modules.pop(module, None)
    assert names == ["actor", "critic", "unused", "local"]  # in the order declared


def test_opening_an_open_flow_is_refused_and_leaves_it_open():
    """A second open() failed (a group name taken) and its clean-up closed the first
    open's groups and controller under the running flow."""
    @asyncrl.node
    def echo(x):
        return x

    async def main():
        async with asyncrl.DataFlow(nodes=[echo], inputs={"x": [1, 2]}, groups=[]) as flow:
            with pytest.raises(asyncrl.FlowError, match="open already"):
                await flow.open()
            return await flow.step()  # still open (its own controller too)
    assert asyncio.run(main()) == {"echo": 1}


@asyncrl.node
def broken(x):
    if x == 2:
        raise ValueError("no sample for 2")
    return x


def _run_until_step_2_fails(slow, flows: list, **controller) -> list:
    """Run nodes `slow` and `broken` over x = 0..4 until broken fails at step 2 (the flow
    goes into `flows`); what on_step got, (step, values)."""
    async def main():
        seen = []
        async with asyncrl.Controller(**controller) as ctl:
            flow = asyncrl.DataFlow(nodes=[slow, broken], inputs={"x": range(5)}, groups=[])
            flows.append(flow)
            await flow.open(ctl)
            try:
                with pytest.raises(asyncrl.NodeError, match="no sample for 2"):
                    await asyncio.wait_for(flow.run(
                        on_step=lambda t, values, s: seen.append((t, values))), 30)
            finally:
                await flow.close()
        return seen
    return asyncio.run(main())


def test_the_steps_still_running_when_a_later_one_fails_finish_and_reach_on_step(capsys):
    """Step 2 fails while step 1 (dispatched before it: steps overlap) still runs: the run
    ended at once and step 1, which would have finished, lost its row; now it finishes."""
    from asyncrl.futures.future import DistFuture, Held

    flows, tasks = [], []

    async def work(f, x):  # (a group's call: its node returned, its work goes on; step
        # 1's runs on until step 2 has failed)
        while x == 1 and flows[0]._failed != 2:  # noqa: ASYNC110 - (no event says it)
            await asyncio.sleep(0.01)
        f._set_result(Held(x))

    @asyncrl.node
    def slow(x):
        f = DistFuture._new(asyncio.get_running_loop(), f"slow {x}")
        tasks.append(asyncio.get_running_loop().create_task(work(f, x)))
        return f

    assert _run_until_step_2_fails(slow, flows) == [(0, {"slow": 0, "broken": 0}),
                                                     (1, {"slow": 1, "broken": 1})]
    assert "node 'broken' failed at step 2: letting step(s) 1, dispatched before it, finish " \
        "first" in capsys.readouterr().err


def test_a_step_still_running_when_a_later_one_fails_is_waited_for_within_a_bound(capsys):
    """A call that runs on (a hung loop in a live rank: its heartbeats still come) held the
    run's error back for ever; it is waited for up to the collective timeout."""
    from asyncrl.futures.future import DistFuture, Held

    held = []

    @asyncrl.node
    def slow(x):
        held.append(DistFuture._new(asyncio.get_running_loop(), f"slow {x}"))
        if x != 1:  # step 1's never resolves
            held[-1]._set_result(Held(x))
        return held[-1]

    seen = _run_until_step_2_fails(slow, [], collective_timeout=0.5)
    assert [t for t, _ in seen] == [0]
    err = capsys.readouterr().err
    assert "letting step(s) 1, dispatched before it, finish first (their rows; within 0.5 s" \
        in err and "step(s) 1 still ran 0.5 s later (the collective timeout): left" in err


def _failing_future(label):
    from asyncrl.futures.future import DistFuture

    f = DistFuture._new(asyncio.get_running_loop(), label)
    f._set_exception(RuntimeError(f"{label} failed"))
    return f


def test_an_upstream_failure_is_named_by_its_node_when_inputs_are_saved(tmp_path):
    """With --save-inputs the downstream node's inputs were awaited outside the blame: a
    bare RuntimeError, naming no node and no step, where a run without it names the node."""
    @asyncrl.node
    def rollout(x):
        return _failing_future(f"rollout {x}") if x == 1 else x

    @asyncrl.node
    def score(rollout):
        return rollout

    async def main(save):
        flow = asyncrl.DataFlow(nodes=[rollout, score], inputs={"x": range(3)}, groups=[])
        flow.save_inputs = tmp_path / "inputs" if save else None
        async with flow:
            with pytest.raises(asyncrl.NodeError) as e:
                await flow.run()
        return e.value
    for save in (False, True):
        err = asyncio.run(main(save))
        assert (err.node, err.step) == ("rollout", 1) and "rollout 1 failed" in str(err), save


def test_a_node_raising_cancelled_error_fails_its_step_not_the_driver():
    """A node whose awaited task was cancelled raised CancelledError, which the run took for
    the driver's own cancel: no NodeError, and the steps finished before it lost their rows
    (on_step got none)."""
    @asyncrl.node
    async def fetch(x):
        if x == 2:
            task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
            task.cancel()
            await task
        return x

    async def main():
        seen = []
        async with asyncrl.DataFlow(nodes=[fetch], inputs={"x": range(4)}, groups=[]) as flow:
            with pytest.raises(asyncrl.NodeError, match="node 'fetch' raised "
                                                        "CancelledError") as e:
                await flow.run(on_step=lambda t, values, s: seen.append(t))
        return e.value, seen
    err, seen = asyncio.run(main())
    assert (err.node, err.step, seen) == ("fetch", 2, [0, 1])


def test_on_step_failing_while_a_run_fails_is_said_and_no_later_step_completes(capsys):
    """Steps 0 and 1 finish while step 2 fails; step 0's on_step raising was swallowed and
    step 1's row written past the gap (metrics.jsonl with step 1 and no step 0)."""
    from asyncrl.futures.future import DistFuture, Held

    flows = []

    def finished(t):
        step = flows[0]._steps.get(t)
        return step is not None and all(f.done() for f in step.finished.values())

    async def work(f, x):
        while flows[0]._next < 3:  # noqa: ASYNC110 - (no event says it): until step 2 runs
            await asyncio.sleep(0.01)
        f._set_result(Held(x))

    @asyncrl.node
    def slow(x):
        f = DistFuture._new(asyncio.get_running_loop(), f"slow {x}")
        asyncio.get_running_loop().create_task(work(f, x))
        return f

    @asyncrl.node
    async def fails_later(x):  # step 2 fails once steps 0 and 1 have finished
        while x == 2 and not (finished(0) and finished(1)):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if x == 2:
            raise ValueError("no sample for 2")
        return x

    def on_step(t, values, s):
        if t == 0:
            raise OSError("the disk is full")
        seen.append(t)

    async def main():
        flows.append(asyncrl.DataFlow(nodes=[slow, fails_later], inputs={"x": range(5)},
                                      groups=[], max_staleness=2))
        async with flows[0] as flow:
            with pytest.raises(asyncrl.NodeError, match="no sample for 2"):
                await asyncio.wait_for(flow.run(on_step=on_step), 30)
    seen: list[int] = []
    asyncio.run(main())
    assert seen == []
    assert "completing step 0 failed too: OSError: the disk is full" in capsys.readouterr().err


class Live:
    """An iterator whose state_dict() is the dict it moves on; it keeps the dict it loads."""

    def __init__(self):
        self.state = {"at": 0}

    def __iter__(self):
        return self

    def __next__(self):
        self.state["at"] += 1
        return self.state["at"]

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_an_iterator_that_saves_its_position_is_rereadable():
    """Any iterator was refused with restarts on ("a one-shot iterator... cannot be read
    again"), also one whose state_dict()/load_state_dict() take it back to a checkpoint's
    position, as resume_at does. (A live state_dict(): the positions kept at the run's start,
    for a rewind before any checkpoint, and before a step, for unread(), moved on with it.)"""
    with pytest.raises(asyncrl.FlowError, match="input 'g' is a one-shot iterator"):
        Inputs({"g": (i for i in range(3))}).check_rereadable()
    feed = Inputs({"p": Live()})
    feed.check_rereadable()
    feed.reset()
    origin = feed.positions()  # (flow.run keeps it so)
    assert [feed.next()["p"] for _ in range(2)] == [1, 2]
    feed.unread()
    assert feed.next()["p"] == 2
    for _ in range(2):  # rewound twice to the start
        feed.reset()
        feed.resume_at(0, origin, rewind=True)
        assert [feed.next()["p"] for _ in range(2)] == [1, 2]


def test_a_node_whose_own_inputs_run_out_ends_the_run_with_its_last_checkpoint(capsys):
    """DAPO's last step of a finite run (epochs=1): its prompts ran out before a group whose
    rewards differ, and the run failed there, before the checkpoint of its last step."""
    from asyncrl import TensorBatch
    from asyncrl.futures.future import DistFuture
    from asyncrl.rl import PromptSource, dynamic_sampling

    source = PromptSource([{"prompt": [i]} for i in range(1, 5)], batch_size=1, repeat=2,
                          shuffle=False, max_prompt_length=1)
    rewards = [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]  # prompts 3 and 4 alike

    def done(value):
        return DistFuture.held(value, "g.m")

    @asyncrl.node(follows="train")
    async def sample(prompts):
        return await dynamic_sampling(
            prompts, more=source.next_batch, generate=done, groups=1, group_size=2,
            score=lambda rollout: done(TensorBatch({"reward": rewards.pop(0)})))

    @asyncrl.node
    def train(sample):
        return sample["dapo/rounds"]

    async def main():
        saved = []

        async def checkpoint(t):
            saved.append((t, source.state_dict()["epoch"]))

        async with asyncrl.DataFlow(nodes=[sample, train], inputs={"prompts": source},
                                    groups=[]) as flow:
            steps = await flow.run(checkpoint=checkpoint)
        return [s["train"] for s in steps], saved, flow.next_step, flow.ended
    # (saved where step 2 found it, epoch 0: step 2's prompts are read again by a resume)
    assert asyncio.run(main()) == ([1, 1], [(1, 0)], 2, "sample")
    assert "node 'sample', step 2: dynamic sampling found no group whose rewards differ in 2 " \
           "groups before the prompts ran out: the run ends" in capsys.readouterr().err


class ShufflesEachPass:
    """An input read again in another order on each pass (a DataLoader with shuffle=True
    and a seeded generator): the resume's pass is the second since the process started."""

    def __init__(self, seed: int = 0, tensors: bool = False) -> None:
        self.rng, self.tensors = random.Random(seed), tensors

    def __iter__(self):
        order = list(range(20))
        self.rng.shuffle(order)
        return iter({"ids": torch.tensor([i])} for i in order) if self.tensors else iter(order)


def test_a_resume_reads_a_reshuffling_input_as_the_run_did():
    """The check before the groups start read such an input once more: the resume then read
    a third order, refused as "another item" (or, with items no digest covers, trained on
    other rows, some twice: tensors, a DataLoader's, were not covered)."""
    ran = Inputs({"x": ShufflesEachPass()})  # the run that saved the checkpoint
    ran.reset()
    taken = [ran.next()["x"] for _ in range(6)]
    ran.consumed["x"] = 5
    ran._last["x"] = _digest(taken[4])
    saved = ran.positions()
    resumed = Inputs({"x": ShufflesEachPass()})  # a new process: the same seed
    resumed.check(saved)  # before any group starts
    resumed.reset()
    resumed.resume_at(5, saved)
    assert resumed.next()["x"] == taken[5]
    ran, same, other = (Inputs({"x": ShufflesEachPass(seed, tensors=True)}) for seed in (0, 0, 1))
    for feed in (ran, same, other):
        feed.reset()
    [ran.next() for _ in range(5)]
    saved = json.loads(json.dumps(ran.positions()))  # as meta.json keeps it
    same.resume_at(5, saved)
    assert torch.equal(same.next()["x"]["ids"], ran.next()["x"]["ids"])
    with pytest.raises(CheckpointError, match="input 'x' gave another item at position 5"):
        other.resume_at(5, saved)  # (another seed: another order)


def test_a_skip_count_resume_keeps_the_controller_loop_beating(tmp_path):
    """An input without state_dict() was skipped to its position on the controller's loop,
    after every group had started (a --resume, a rewind): a DataLoader's thousands of
    batches stopped the heartbeats (400 items at 5 ms: 2.1 s), and the ranks exited."""
    from asyncrl.controller.checkpoint import restore

    on_the_loop = []  # for each item the input gives (a DataLoader's batch): on the loop?
    flow = asyncrl.DataFlow(nodes=[broken], groups=[], inputs={"x": (on_the_loop.append(
        threading.current_thread() is threading.main_thread()) or i for i in itertools.count())})
    torch.save(rng_state(), tmp_path / "controller_rng.pt")

    async def main():
        async with flow:
            await restore(flow, tmp_path, {"step": 3, "inputs": {"x": {"consumed": 400}}})
    asyncio.run(main())
    assert flow.next_step == 4 and flow.feed.next()["x"] == 400
    assert on_the_loop == [False] * 400 + [True]  # skipped on a thread, then read


def test_on_rewind_does_not_stall_the_loop(tmp_path, monkeypatch):
    """A rewind's on_rewind (`asyncrl launch`'s metrics.jsonl and timeline.jsonl rewritten
    and fsynced, TensorBoard closed) ran on the controller's loop: 66 MB of metrics held it
    1.4 s, near the ranks' heartbeat timeout (3 s)."""
    @asyncrl.node
    def take(x):
        if x == 2 and not rewound:
            raise RuntimeError("a rank died")
        return {"x": x}
    flow = asyncrl.DataFlow(nodes=[take], groups=[], inputs={"x": [0, 1, 2, 3]})
    rewound, on_the_loop = [], []  # the steps rewinds went back from; where rows were cut

    async def rewind(exc, step, restore):  # to the start (no checkpoint), as recovery does
        await flow._abandon()
        flow._reset_sources()
        rewound.append(step)
        return True
    monkeypatch.setattr(Recovery, "enabled", property(lambda self: True))
    monkeypatch.setattr(flow.recovery, "rewind", rewind)
    drop = launch.drop_rows_after
    monkeypatch.setattr(launch, "drop_rows_after", lambda *a: (on_the_loop.append(
        threading.current_thread() is threading.main_thread()), drop(*a))[1])
    metrics = launch.Metrics(tmp_path, None, Timeline(tmp_path), trackers=[])
    asyncio.run(flow.run(on_step=metrics, on_rewind=metrics.rewind_off_loop))
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert rewound == [2] and [json.loads(row)["step"] for row in rows] == [0, 1, 2, 3]
    assert on_the_loop == [False]  # (a thread's: the loop's heartbeats go on meanwhile)
