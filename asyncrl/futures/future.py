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
import warnings
from typing import Any


class DistFuture:
    __slots__ = ("_fut", "_loop", "_label", "busy_s", "__weakref__")
    _fut: asyncio.Future[Any]
    _loop: asyncio.AbstractEventLoop
    _label: str
    busy_s: float  # once resolved: the longest time one of its ranks spent running it

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("DistFuture has no public constructor; group method calls return them")

    @classmethod
    def _new(cls, loop: asyncio.AbstractEventLoop, label: str) -> DistFuture:
        self = object.__new__(cls)
        self._loop = loop
        self._fut = loop.create_future()
        self._label = label
        self.busy_s = 0.0
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
        return self._get().__await__()

    async def _get(self) -> Any:
        # shielded: cancelling one awaiter (a wait_for timing out) must not cancel the call
        return await (await asyncio.shield(self._fut)).value()

    def result(self, timeout: float | None = None) -> Any:
        """Block until the value is ready (sync code on another thread).

        Raises the built-in TimeoutError after `timeout` seconds, leaving the future usable;
        RuntimeError if called on the controller's own loop, where it would deadlock."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError(f"{self._label}: result() called on the controller's event loop "
                               f"would block it forever; use `await fut` there")
        if running is not None:
            warnings.warn(f"{self._label}: result() blocks the event loop running in this "
                          f"thread; prefer `await`", RuntimeWarning, stacklevel=2)
        value = asyncio.run_coroutine_threadsafe(self._get(), self._loop)
        try:
            return value.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self._label} not done after {timeout} s") from None

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<DistFuture {self._label} {state}>"


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

