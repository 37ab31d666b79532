"""When a DataFlow node has finished: it returned, every DistFuture it returned is done, and so
is every group call it made, returned or not.

    _run_node: node_calls.set(Calls()) ──▶ fn() ──▶ group.call(...) ──▶ note_call(future)
    finished(): the node returned ──▶ its returned futures done (their failure is the node's)
                                  ──▶ the calls it noted done (a failure: the group says it)

A node that calls a group without returning the future (`rollouts.load_weights(...)` in a
node that returns metrics) has not finished until that call ends: a `follows=` edge on it
and a checkpoint after its step wait for the call, as for a returned one.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.futures.future import futures_in

if TYPE_CHECKING:
    from asyncrl.controller.nodes import NodeError
    from asyncrl.futures.future import DistFuture

F = TypeVar("F", bound=asyncio.Future)


class Calls:
    """The group calls a node made that are not done yet (a done one is let go at once)."""

    def __init__(self) -> None:
        self.running: set[asyncio.Future[Any]] = set()

    def add(self, fut: asyncio.Future[Any]) -> None:
        if not fut.done():
            self.running.add(fut)
            fut.add_done_callback(self.running.discard)

    async def done(self) -> None:
        while self.running:  # (a task the node started may call on while this waits)
            await asyncio.wait(list(self.running))


# the calls of the node running in this task (tasks and threads it starts copy the context)
node_calls: contextvars.ContextVar[Calls | None] = contextvars.ContextVar(
    "asyncrl_node_calls", default=None)


def note_call(future: DistFuture) -> None:
    """A group call made (GroupHandle.call): the node running it waits for it to finish."""
    calls = node_calls.get()
    if calls is None:
        return
    loop = future._fut.get_loop()
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:  # a thread the node started (asyncio.to_thread)
        here = False
    if here:
        calls.add(future._fut)
    else:  # (ahead of the thread's result, which the node awaits on the loop)
        loop.call_soon_threadsafe(calls.add, future._fut)


def quiet(fut: F) -> F:
    """A task or future whose failure is reported where it is awaited, not again when it is
    collected (nor when its awaiter was cancelled first: a shield's left-behind gather)."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


async def shielded(tasks: Iterable[asyncio.Future]) -> None:
    """Wait for `tasks`; a cancel of the waiter does not reach them (later steps wait on
    them too), and a failure after the waiter went is not logged as never retrieved."""
    await asyncio.shield(quiet(asyncio.gather(*tasks)))


async def finished(returned: asyncio.Task, calls: Calls,
                   blame: Callable[[Exception], NodeError]) -> None:
    """A node has finished when it returned, every DistFuture it returned is done and every
    group call it made has ended."""
    out = await returned
    try:
        for fut in futures_in(out):
            await asyncio.shield(fut._fut)
    except Exception as e:  # the work the node started failed: say which node
        err = blame(e)
        raise err from err.__cause__
    await calls.done()
