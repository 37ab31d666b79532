"""A driver's fetches of stored results too big to have come with their Result: one Fetch
per part however many await it, answered, failed, or timed out after the transfer timeout
(a rank alive yet silent must not hang the driver)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from asyncrl.comm import codec
from asyncrl.comm.channel import LINK_MIN_RATE
from asyncrl.comm.messages import Fetch, Fetched
from asyncrl.errors import TransferTimeout


class Fetches:
    def __init__(self, group: str, loop: asyncio.AbstractEventLoop,
                 post: Callable[[int, Fetch], None], timeout: float):
        self._group, self._loop, self._post, self._timeout = group, loop, post, timeout
        self._waiters: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._stale: set[tuple[int, int]] = set()  # timed out once: asked again when awaited
        self._awaiting: dict[tuple[int, int], int] = {}  # awaiters of each waiter

    async def get(self, rank: int, obj_id: int, nbytes: int = 0) -> Any:
        """Rank `rank`'s part of call `obj_id`'s result, decoded: its large arrays are views
        of the frames they came in. `nbytes`, its size, lengthens the wait: the timeout is
        for an answer, not for gigabytes to come over a slow link."""
        key = (rank, obj_id)
        waiter = self._waiters.get(key)
        if waiter is None or key in self._stale:  # (a stale one stays: others await it too)
            if waiter is None:
                waiter = self._waiters[key] = self._loop.create_future()
            self._stale.discard(key)
            self._post(rank, Fetch(obj_id))
        more = nbytes / LINK_MIN_RATE
        self._awaiting[key] = self._awaiting.get(key, 0) + 1
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self._timeout + more)
        except asyncio.TimeoutError:
            if self._waiters.get(key) is waiter:  # awaiting it again asks again; the last
                if self._awaiting[key] > 1:  # awaiter gone, it goes (kept, it stayed until
                    self._stale.add(key)  # the group's end)
                else:
                    del self._waiters[key]
                    self._stale.discard(key)
            raise TransferTimeout(
                f"fetching the result of call {obj_id} from {self._group}:{rank}: no answer "
                f"within {self._timeout:g} s" + (f", and {more:.2g} s more for its {nbytes:,} "
                                                  f"bytes" if nbytes else "") +
                " (raise Controller(transfer_timeout=...))") from None
        finally:
            self._awaiting[key] -= 1
            if not self._awaiting[key]:
                del self._awaiting[key]

    def answered(self, msg: Fetched) -> None:
        self._stale.discard((msg.rank, msg.obj_id))
        waiter = self._waiters.pop((msg.rank, msg.obj_id), None)
        if waiter is None or waiter.done():
            return
        if msg.error:  # not held: a LookupError; held but not sendable: the rank's failure
            kind = LookupError if msg.missing else RuntimeError
            waiter.set_exception(kind(f"fetching the result of call {msg.obj_id} from "
                                      f"{self._group}:{msg.rank}: {msg.error}"))
            return
        try:
            waiter.set_result(codec.decode_oob(msg.value, msg.frames))
        except Exception as e:  # noqa: BLE001 - a value that does not decode: the driver's
            waiter.set_exception(e)

    def fail(self, exc: BaseException) -> None:
        waiters, self._waiters = list(self._waiters.values()), {}
        self._stale.clear()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(copy.copy(exc))  # (each its own: see GroupHandle)
                waiter.exception()  # retrieved: no "never retrieved" warning
