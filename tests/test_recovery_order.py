"""Re-runs after a stateless group's death that show up late or in the wrong order, on a real
GroupHandle and Recovery with stand-ins for the controller and the flow (no processes: calls
are noted, not sent, and answered here). Rank 0 of a 2-rank group fails its call first (its
collective broke), then rank 1's death is declared: a call awaited only after another node
respawned the group is re-run, and an upstream node's re-run sends its calls before those
of a downstream node that waits on its result."""

import asyncio
import itertools
import threading
import types

import pytest
from helpers import poll_until, run

from asyncrl.actors.protocols import Layout
from asyncrl.comm.messages import Failure, MethodSpec, Result
from asyncrl.controller.finished import Calls
from asyncrl.controller.group import GroupHandle, RankInfo, _Pending
from asyncrl.controller.recovery import Recovery
from asyncrl.futures.future import Held


class _StandIns:
    """A 2-rank stateless group "G" (methods f and g), its flow and its Recovery. Each call
    sent is noted in `sent` as (handle, method, call id)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.sent: list[tuple[GroupHandle, str, int]] = []
        ids = itertools.count(1000)

        def send(handle, item):
            cid = next(ids)
            handle._pending[cid] = _Pending(cid, item.method, None, item.future, None, {0, 1},
                                            {0, 1}, item.inputs)
            self.sent.append((handle, item.method, cid))

        monkeypatch.setattr(GroupHandle, "_send", send)
        loop = asyncio.get_running_loop()
        self.ctl = types.SimpleNamespace(
            loop=loop, _loop_thread=threading.get_ident(), transfer_timeout=0.1, timeline=None,
            transport="tcp", calls={}, relay_of={}, cluster=None, groups={},
            links=types.SimpleNamespace(needed=lambda *a: False), post=lambda *a: None,
            heartbeat_timeout=0.5, heartbeat_interval=0.05, close_group=self._close)
        self.spec = types.SimpleNamespace(name="G", stateful=False, max_restarts=2,
                                          restart_backoff=0.0, handle=self._handle(), place=None)

        async def spawn(spec):
            await asyncio.sleep(0.05)
            return self._handle()

        async def abandon():
            pass

        self.flow = types.SimpleNamespace(
            groups=[self.spec], _ctl=self.ctl, _spawn=spawn, _watchers=set(), _steps={},
            feed=types.SimpleNamespace(check_rereadable=lambda: None), _abandon=abandon,
            _reset_sources=lambda: None, _origin=(0, {}), next_step=1)
        self.recovery = Recovery(self.flow)

    def _handle(self) -> GroupHandle:
        agent = types.SimpleNamespace(tail=lambda: "", blamed=lambda heard: [])
        h = GroupHandle(self.ctl, "G", object, Layout("G", (("dp", 2),)), agent)
        h.methods = {"f": MethodSpec("one_to_all"), "g": MethodSpec("one_to_all")}
        h.ranks = {r: RankInfo(1, "h", 0.0, b"io%d" % r, b"ex%d" % r) for r in (0, 1)}
        return h

    async def _close(self, handle: GroupHandle) -> None:
        handle.closing = True
        handle._fail_all(RuntimeError("closed"))

    def sent_to(self, handle: GroupHandle) -> list[str]:
        return [method for h, method, _ in self.sent if h is handle]

    def call_id(self, handle: GroupHandle, method: str) -> int:
        return next(cid for h, m, cid in self.sent if h is handle and m == method)

    async def break_then_die(self, method: str) -> None:
        """Rank 0 fails `method`'s call on the group (its collective broke), then the death
        of rank 1 is declared (a moment later: a re-run waits for it by then)."""
        handle = self.spec.handle
        handle._on_result(Result(self.call_id(handle, method), 0, error=Failure(
            "RuntimeError", "gloo: connection closed", "")))
        await asyncio.sleep(0.02)
        handle._mark_dead(1, -9, "killed")

    def answer(self, handle: GroupHandle, method: str, value: object) -> None:
        p = handle._pending.pop(self.call_id(handle, method))
        p.future._set_result(Held(value))


def test_a_call_awaited_after_another_node_respawned_its_group_reruns_its_node(monkeypatch):
    """Async node A calls G.f and awaits other work; rank 1 dies (A's call failed first with
    rank 0's broken collective), node B meets the death and respawns G. A, awaiting its call
    then, saw a RemoteError with no death behind it (G was alive again): the run failed,
    restarts left; now A is re-run on the new G."""
    async def main():
        t = _StandIns(monkeypatch)
        go = asyncio.Event()
        runs: list[str] = []

        async def a():
            runs.append("A")
            fut = t.spec.handle.call("f", 1)
            await go.wait()  # the node's other work
            return await fut

        def b():
            runs.append("B")
            return t.spec.handle.call("g", 2)

        task = asyncio.ensure_future(t.recovery.call("A", 0, a))
        await poll_until(lambda: t.sent, 5, "A's call")
        old = t.spec.handle
        await t.break_then_die("f")
        await t.recovery.call("B", 1, b)  # respawns G
        assert t.spec.handle is not old
        go.set()
        await poll_until(lambda: t.sent_to(t.spec.handle) == ["g", "f"], 5, "A's re-run")
        t.answer(t.spec.handle, "f", "a's value")
        return await task, runs, t.recovery.restarts

    out, runs, restarts = run(main(), 20)
    assert (out, runs, restarts) == ("a's value", ["A", "B", "B", "A"], {"G": 1})


def test_an_upstream_nodes_rerun_sends_its_calls_before_a_downstream_rerun_waiting_on_it(
        monkeypatch):
    """Node N returns G.f(1) (its stand-in P); node D calls G.g(P), held in G's backlog. Rank
    0 fails f first, then rank 1's death fails g at once: D re-ran first, its g(P) at the
    head of the new G's backlog, and N's re-run's f queued behind it: P waited for f, f for
    g(P), the step for ever. D's re-run now waits for its input P."""
    async def main():
        t = _StandIns(monkeypatch)
        n_out = await t.recovery.call("N", 0, lambda: t.spec.handle.call("f", 1))
        d_out = await t.recovery.call("D", 0, lambda: t.spec.handle.call("g", n_out), n_out)
        old = t.spec.handle
        await t.break_then_die("f")
        await poll_until(lambda: t.sent_to(t.spec.handle) and t.spec.handle is not old, 5,
                         "N's re-run's call")
        new = t.spec.handle
        t.answer(new, "f", "rows")
        await poll_until(lambda: "g" in t.sent_to(new), 5, "D's re-run's call, sent")
        t.answer(new, "g", "scores")
        return t.sent_to(new), await n_out, await d_out

    assert run(main(), 20) == (["f", "g"], "rows", "scores")


def test_a_call_broken_by_a_death_rewinds_after_its_group_is_back(monkeypatch):
    """A call failed with rank 0's broken collective, then rank 1's death; node B's re-run
    respawned G. The failure, left to a rewind (its node called a group that keeps state,
    say), was taken for a bug, G being alive: the run failed, restarts left."""
    async def main():
        t = _StandIns(monkeypatch)
        fut = t.spec.handle.call("f", 1)
        await t.break_then_die("f")
        await t.recovery.call("B", 1, lambda: t.spec.handle.call("g", 2))  # respawns G
        t.answer(t.spec.handle, "g", "scored")

        async def restore():
            return True

        return await t.recovery.rewind(fut._fut.exception(), 0, restore), t.recovery.events

    rewound, events = run(main(), 20)
    assert rewound and [e.kind for e in events] == ["rerun", "rewind"]


def test_a_call_its_node_left_that_a_death_broke_is_not_the_nodes_failure(monkeypatch):
    """A node neither returned nor awaited its call on G, which rank 0's broken collective
    failed before rank 1's death: the node failed with that RemoteError (then a rewind, or
    the run's end once G was back), where G's death itself is left to G's next call."""
    async def main():
        t = _StandIns(monkeypatch)
        calls = Calls()
        calls.add(t.spec.handle.call("f", 1))
        await t.break_then_die("f")
        await calls.done()
        return calls.failed

    assert run(main(), 20) is None
