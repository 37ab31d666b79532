"""DistFuture: what every group call returns at once.

``await fut`` in the controller's loop; ``fut.result(timeout=...)`` from sync code on other
threads. There is no public constructor: futures come from group calls. The future is done
when every rank has finished; it then holds a reference to the result (an ObjectRef), whose
value is fetched only when someone awaits it. Passed to another group's call, it is never
fetched: the consumer's ranks pull the data from the producer's ranks. `DistFuture.held`
makes a done future of a value already on the controller (a node run alone on saved inputs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import operator
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from asyncrl.comm.batch import RowOps


class DistFuture:
    __slots__ = ("_fut", "_loop", "_label", "busy_s", "_awaited", "__weakref__")
    _fut: asyncio.Future[Any]
    _loop: asyncio.AbstractEventLoop
    _label: str
    busy_s: float  # once resolved: the longest time one of its ranks spent running it
    _awaited: bool  # its failure was raised to an awaiter (theirs to handle)

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("DistFuture has no public constructor; group method calls return them")

    @classmethod
    def _new(cls, loop: asyncio.AbstractEventLoop, label: str) -> DistFuture:
        self = object.__new__(cls)
        self._loop = loop
        self._fut = loop.create_future()
        self._label = label
        self.busy_s = 0.0
        self._awaited = False
        return self

    @classmethod
    def held(cls, value: Any, label: str) -> DistFuture:
        """A done future of a value the controller holds (in a running loop); passed to a
        group's call, the value goes with the call."""
        self = cls._new(asyncio.get_running_loop(), label)
        self._set_result(Held(value))
        return self

    # -- controller side: resolve ---------------------------------------------------------
    def _set_result(self, value: Any) -> None:
        if not self._fut.done():
            self._fut.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        if not self._fut.done():
            self._fut.set_exception(exc)
            # a failure nobody awaits is still reported by the group; do not warn at GC time
            self._fut.exception()

    # -- user side ------------------------------------------------------------------------
    def done(self) -> bool:
        return self._fut.done()

    def __await__(self):
        return _awaited(self, self._get)

    def _check_loop(self) -> None:
        if self._loop.is_closed() or not self._loop.is_running():
            raise RuntimeError(f"{self._label}: the controller's event loop is not running "
                               f"(closed, or this thread would run it): its value can only be "
                               f"had while the controller runs, with `await` on its loop")

    async def _get(self) -> Any:
        try:  # shielded: cancelling one awaiter (a wait_for timing out) must not cancel the call
            return await (await asyncio.shield(self._fut)).value()
        except asyncio.CancelledError:  # (an awaiter that gave up never saw the failure: a
            raise  # later one is the node's, as for a call it did not await)
        except BaseException:
            self._awaited = True
            raise

    def result(self, timeout: float | None = None) -> Any:
        """Block until the value is ready (sync code on another thread).

        Raises the built-in TimeoutError after `timeout` seconds, leaving the future usable;
        RuntimeError if called on the controller's own loop, where it would deadlock."""
        running = _running_loop()
        if running is self._loop:
            raise RuntimeError(f"{self._label}: result() called on the controller's event loop "
                               f"would block it forever; use `await fut` there")
        if running is not None:
            warnings.warn(f"{self._label}: result() blocks the event loop running in this "
                          f"thread; prefer `await`", RuntimeWarning, stacklevel=2)
        self._check_loop()  # (else the work queued for it would never run: a wait for ever)
        value = asyncio.run_coroutine_threadsafe(self._get(), self._loop)
        try:
            return value.result(timeout)
        except concurrent.futures.TimeoutError:  # (the built-in TimeoutError since 3.11)
            if value.done():  # the call's own failure, a TransferTimeout say: not this wait's
                return value.result()
            value.cancel()  # this wait (the call, and a fetch other awaiters share, go on)
            raise TimeoutError(f"{self._label} not done after {timeout} s") from None

    def rows(self, indices: Iterable[int]) -> Rows:
        """Some rows of this future's TensorBatch, in the order given (a filter, a
        reordering): passed to a group's call, its ranks pull only those rows."""
        return Rows([(self, indices)])

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<DistFuture {self._label} {state}>"



def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _awaited(fut: DistFuture, work: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """`work()` awaited here; from another loop (another thread), run on the controller's
    loop instead: its sockets are that thread's alone."""
    running = _running_loop()
    if running is None or running is fut._loop:
        return work().__await__()
    fut._check_loop()
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work(), fut._loop)).__await__()

class Rows:
    """Rows of one or more batch futures, concatenated in order (`fut.rows(indices)`,
    `asyncrl.concat(...)`), built without fetching anything: passed to a group's call it is
    one batch whose rows the consumer's ranks pull from the producers, as a future's are;
    `await` fetches the value. The batches must have the same columns (responses to prompt
    batches of one PromptSource with max_prompt_length have)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[DistFuture, Iterable[int] | None]]):
        self.parts: list[tuple[DistFuture, list[int] | None]] = []
        for fut, indices in parts:
            if not isinstance(fut, DistFuture):
                raise TypeError(f"rows of a group call's future, not of {type(fut).__name__}")
            picked = None if indices is None else [_row_index(fut, i) for i in indices]
            if picked is not None and any(i < 0 for i in picked):
                raise IndexError(f"rows of {fut._label}: negative row indices "
                                 f"{[i for i in picked if i < 0][:5]}; rows count from 0")
            self.parts.append((fut, picked))

    def futures(self) -> list[DistFuture]:
        return [f for f, _ in self.parts]

    async def batch(self, view: Callable[[DistFuture], Awaitable[Any]]) -> Any:
        """The rows as one batch, each future turned into its batch by `view` (a future's
        value, or the references a consumer's ranks pull from)."""
        pieces = []
        for fut, picked in self.parts:
            whole = await view(fut)
            if not isinstance(whole, RowOps):
                raise TypeError(f"rows of {fut._label}: its value is a "
                                f"{type(whole).__name__}, not a TensorBatch")
            pieces.append(whole if picked is None else whole.take(picked))
        kinds = {type(p) for p in pieces}
        if len(kinds) > 1:  # a value the controller holds beside data on the ranks
            raise TypeError(f"concat: {', '.join(f._label for f in self.futures())} mix "
                            f"values on the controller with batches on the ranks")
        return pieces[0] if len(pieces) == 1 else type(pieces[0]).concat(pieces)

    def __await__(self) -> Any:
        return _awaited(self.parts[0][0], self._get) if self.parts else self._get().__await__()

    async def _get(self) -> Any:
        try:
            return await self.batch(lambda f: f._get())
        except asyncio.CancelledError:
            raise
        except BaseException:  # the concat's failure was raised: every part's is the
            for fut, _ in self.parts:  # awaiter's, one failing later too (its parts are
                fut._awaited = True  # awaited one by one: the rest never would be)
            raise

    def __repr__(self) -> str:
        return "<Rows " + " + ".join(
            f"{f._label}[{'all' if p is None else len(p)}]" for f, p in self.parts) + ">"


def _row_index(fut: DistFuture, i: Any) -> int:
    if isinstance(i, bool) or "bool" in str(getattr(i, "dtype", "")):  # True, False: 1, 0
        raise TypeError(f"rows of {fut._label}: give row indices, not a boolean mask (the "
                        f"indices where it is True: mask.nonzero().flatten())")
    return operator.index(i)


def concat(*items: DistFuture | Rows) -> Rows:
    """Batch futures (or `fut.rows(...)` of them) as one batch, in order; see `Rows`."""
    if not items:
        raise ValueError("asyncrl.concat needs at least one future")
    parts: list[tuple[DistFuture, Iterable[int] | None]] = []
    for item in items:
        if isinstance(item, Rows):
            parts += item.parts
        elif isinstance(item, DistFuture):
            parts.append((item, None))
        else:
            raise TypeError(f"asyncrl.concat takes group calls' futures and their .rows(...), "
                            f"got {type(item).__name__}")
    return Rows(parts)


class Held:
    """What a `DistFuture.held` future resolves to (in place of an ObjectRef)."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    async def value(self) -> Any:
        return self._value

    def view(self) -> Any:
        return self._value

    def holds_batches(self) -> bool:
        return False


def futures_in(value: Any) -> list[DistFuture]:
    """The DistFutures in `value`: itself, or inside its lists, tuples and dicts."""
    if isinstance(value, DistFuture):
        return [value]
    if isinstance(value, Rows):
        return value.futures()
    if isinstance(value, list | tuple):
        return [f for x in value for f in futures_in(x)]
    if isinstance(value, dict):
        return [f for x in value.values() for f in futures_in(x)]
    return []


def rebuild(like: list | tuple, items: list[Any]) -> list | tuple:
    """A list or tuple of the same type as `like` (a namedtuple too) holding `items`."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


async def resolved(out: Any, batches: bool = True, found: list[list[Any]] | None = None,
                   at: tuple[Any, ...] = ()) -> Any:
    """A value (what a node returned) with its DistFutures resolved to values;
    `batches=False`: a future whose value is TensorBatches kept on the ranks stays a future
    (nothing fetched). `found` gets the path (keys and indices) of each future resolved."""
    if isinstance(out, DistFuture):
        if not batches and (await asyncio.shield(out._fut)).holds_batches():
            return out
        if found is not None:
            found.append(list(at))
        return await out
    if isinstance(out, Rows):  # rows of batches: data on the ranks
        if not batches:
            return out
        if found is not None:
            found.append(list(at))
        return await out
    if isinstance(out, list | tuple):
        return rebuild(out, [await resolved(x, batches, found, (*at, i))
                              for i, x in enumerate(out)])
    if isinstance(out, dict):
        return {k: await resolved(v, batches, found, (*at, k)) for k, v in out.items()}
    return out


def held_at(value: Any, path: list[Any], label: str) -> Any:
    """`value` with the item at `path` a done DistFuture of it again."""
    if not path:
        return DistFuture.held(value, label)
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, key: held_at(value[key], rest, label)}
    items = list(value)
    items[key] = held_at(items[key], rest, label)
    return rebuild(value, items)

