"""When a DataFlow node has finished: it returned, every DistFuture it returned is done, and so
is every group call it made, returned or not.

    _run_node: node_calls.set(Calls()) ──▶ fn() ──▶ group.call(...) ──▶ note_call(future)
    finished(): the node returned ──▶ its returned futures done (their failure is the node's)
                                  ──▶ the calls it noted done (the first to fail: the node's)

A node that calls a group without returning the future (`rollouts.load_weights(...)` in a
node that returns metrics, or one inside a dataclass it returns) has not finished until that
call ends: a `follows=` edge on it and a checkpoint after its step wait for the call, as for
a returned one, and its failure is the node's (a NodeError: the next rollout does not run on
the old weights), unless its failure was raised to an await (the node's: its own to handle;
an await that gave up first, a wait_for's timeout, saw none) or it is the group's death
(met by the next call to the group, which recovery repairs; so is a rank's failure of a
collective that the death broke first, `broken_by`). A call that recovery re-ran
the node after (a stateless group's death) counts no more: the re-run's calls do.
`DataFlow.run_node` (a node run alone) waits for its calls the same way. A call from a thread
is the node's when the thread copied its context (asyncio.to_thread); one made off the loop
with no node's context while nodes run is warned of, once.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.compat import add_note
from asyncrl.errors import GroupDeadError
from asyncrl.futures.future import futures_in

if TYPE_CHECKING:
    from asyncrl.futures.future import DistFuture

F = TypeVar("F", bound=asyncio.Future)
log = logging.getLogger("asyncrl")
_DEATH = "_asyncrl_broken_by"  # on a rank's failure of a call: the group's death behind it


def broken_by(failure: BaseException, death: GroupDeadError) -> None:
    """A call that a rank failed first (its peer died: a broken collective) ends with the
    group's `death`: said on `failure`, and kept on it, so that the failure is taken for the
    death even once the group is back (an await of it after another node's respawn)."""
    add_note(failure, f"then {death}")
    setattr(failure, _DEATH, death)


def death_of(exc: BaseException | None) -> GroupDeadError | None:
    """The group's death `exc` is, or that broke it (`broken_by`); None for other failures."""
    return exc if isinstance(exc, GroupDeadError) else getattr(exc, _DEATH, None)


class Calls:
    """The group calls a node made that are not done yet (a done one is let go at once), and
    those of the node's last run that failed."""

    def __init__(self) -> None:
        self.running: set[asyncio.Future[Any]] = set()
        self._failures: list[DistFuture] = []
        self._run = 0  # the node's runs so far (recovery re-runs it after a death)

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """`fn(**kwargs)`, a run of the node (recovery re-runs it after a death): the failures
        of its earlier runs' calls, which this run repairs, are forgotten (those calls are
        still waited for)."""
        self._run += 1
        self._failures = []
        return fn(**kwargs)

    def add(self, future: DistFuture) -> None:
        fut, ended = future._fut, functools.partial(self._ended, self._run, future)
        if fut.done():  # (noted from a thread after it ended)
            ended(fut)
            return
        self.running.add(fut)
        fut.add_done_callback(self.running.discard)
        fut.add_done_callback(ended)

    def _ended(self, run: int, future: DistFuture, fut: asyncio.Future[Any]) -> None:
        if run == self._run and not fut.cancelled() and fut.exception() is not None:
            self._failures.append(future)  # (cancelled: the step was, which says so)

    @property
    def failed(self) -> BaseException | None:
        """The first failure of the last run's calls not raised to an await (one that was
        is the awaiter's to handle), but for the called group's death: the
        next call to that group meets it, where recovery re-runs or rewinds as it does for
        any call (an input lost with another group's death is the node's: the called group
        lives, and its next call would not say it)."""
        return next((e for f in self._failures if not f._awaited and death_of(
            e := f._fut.exception()) is None), None)

    async def done(self) -> None:
        while self.running:  # (a task the node started may call on while this waits)
            await asyncio.wait(list(self.running))
        # a task awaiting a call that just failed is woken with this one: it has seen the
        # failure (marked it awaited, its own to handle) before `failed` is read
        await asyncio.sleep(0)


# the calls of the node running in this task (the tasks it starts copy the context, and so
# do its threads started by asyncio.to_thread; not loop.run_in_executor's, a
# ThreadPoolExecutor's nor a threading.Thread's: their calls are not the node's)
node_calls: contextvars.ContextVar[Calls | None] = contextvars.ContextVar(
    "asyncrl_node_calls", default=None)
# nodes dispatched and not finished yet, of any flow: a call made off the loop with no node's
# context meanwhile is likely a node's, from a thread that did not copy it (warned of once)
unfinished: set[asyncio.Future[Any]] = set()
_warned: list[str] = []


def note_call(future: DistFuture) -> None:
    """A group call made (GroupHandle.call): the node running it waits for it to finish."""
    calls = node_calls.get()
    if calls is None and not unfinished:
        return
    loop = future._fut.get_loop()
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:  # a thread the node started (asyncio.to_thread)
        here = False
    if calls is None:
        if not here and not _warned:
            _warned.append(future._label)
            log.warning(
                "asyncrl: %s was called from a thread, while a flow's nodes ran, with no "
                "node's context: if a node started that thread (loop.run_in_executor, a "
                "ThreadPoolExecutor, threading.Thread), the node neither waits for the call "
                "(its follows= edges, a checkpoint) nor fails with it; start it with "
                "asyncio.to_thread (or run its function in contextvars.copy_context())",
                future._label)
    elif here:
        calls.add(future)
    else:  # (ahead of the thread's result, which the node awaits on the loop)
        loop.call_soon_threadsafe(calls.add, future)


def dispatched(task: F) -> F:
    """`task`, a node's finished(): in `unfinished` until it ends."""
    unfinished.add(task)
    task.add_done_callback(unfinished.discard)
    return task


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
                   blame: Callable[[Exception], Exception]) -> None:
    """A node has finished when it returned, every DistFuture it returned is done and every
    group call it made has ended; it failed when one of those failed (`blame` names it)."""
    out = await returned
    try:
        for fut in futures_in(out):
            await asyncio.shield(fut._fut)
        await calls.done()
        if isinstance(calls.failed, Exception):  # one it did not return (a sync's load):
            raise calls.failed  # else the next step's rollout ran on the old weights
    except Exception as e:  # the work the node started failed: say which node
        err = blame(e)
        if err is e:  # (a node run alone: its own error, its context kept)
            raise
        raise err from err.__cause__
