"""ObjectRef: the controller's handle on one call's result.

It holds where each collected rank keeps its part (a `Shard` and its schema) and, when the
parts were small, the encoded values themselves. Passing the call's future to another group
uses `view()` — references that the consumer's ranks pull from — and never the values (but
for a group gone since whose parts all came inline: the value is all here). `await` uses
`value()`, fetching the parts that were too big to come inline (their large arrays arrive
as raw frames and are used in place; a failed fetch of one rank's part leaves the parts that
arrived for the next await). When the last reference to an ObjectRef goes (its DistFuture
and every pending consumer call), the owners are told to free their parts.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.comm import codec
from asyncrl.comm.messages import Schema
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue, Shard
from asyncrl.compat import add_note

if TYPE_CHECKING:
    from asyncrl.controller.group import GroupHandle


class ObjectRef:
    __slots__ = ("group", "obj_id", "_collect", "_collect_encoded", "schemas", "_inline",
                 "_value", "_done", "_building", "_fetching", "protocol", "__weakref__")

    def __init__(self, group: GroupHandle, obj_id: int, collect: Callable[[dict[int, Any]], Any],
                 schemas: dict[int, Schema], inline: dict[int, msgspec.Raw],
                 collect_encoded: Callable[[dict[int, Any]], Any] | None = None,
                 protocol: str = ""):
        self.group, self.obj_id = group, obj_id
        self._collect = collect
        self.protocol = protocol  # the name of the user protocol whose collect it is ("":
        # a built-in one's, which the user cannot change)
        self._collect_encoded = collect_encoded  # the protocol's, when it has one
        self.schemas = schemas  # rank -> what it stores (ranks that returned None: nothing)
        self._inline = inline  # rank -> encoded value, for the parts that came with the Result
        self._value: Any = None
        self._done = False
        self._building: asyncio.Task[Any] | None = None  # fetching parts, for every awaiter
        # rank -> the fetch of its part, kept until the value is built: a build that failed
        # on one rank's part fetches only that one again, not the others' (gigabytes maybe)
        self._fetching: dict[int, asyncio.Future[Any]] = {}
        if schemas:
            weakref.finalize(self, group._ctl.releases.later, group, list(schemas), obj_id)

    def shard(self, rank: int) -> Shard:
        """Where `rank` keeps its part."""
        info = self.group.ranks[rank]
        return Shard(self.group.name, rank, self.obj_id, info.data_addr, info.host, info.gpu)

    def parts(self) -> Iterator[tuple[Shard, Schema]]:
        """Every stored part: where it is and what it holds."""
        for rank, schema in self.schemas.items():
            yield self.shard(rank), schema

    def view(self, passed_as: str = "an input of another group's call") -> Any:
        """The value as references for another group's call (`passed_as`: which argument of
        which call, for an error's note): nothing is fetched."""
        parts: dict[int, Any] = {}
        for rank in self._ranks():
            schema = self.schemas.get(rank)
            if schema is None:
                parts[rank] = None
                continue
            shard = self.shard(rank)
            if schema.rows < 0:
                parts[rank] = RemoteValue(shard, schema.nbytes)  # (a pull's time: its bytes)
            else:
                meta = codec.decode(schema.meta) or {}
                parts[rank] = RemoteBatch([Piece(shard, 0, schema.rows)], schema.columns, meta)
        try:
            return self._collect(parts)
        except Exception as e:  # a user's collect written for values (its `await` works)
            if not self.protocol:
                raise
            add_note(e, f"collect() of protocol {self.protocol!r} got references (RemoteValue/"
                        f"RemoteBatch), not values, when its result was passed as {passed_as}: "
                        f"make it take both, or pass the awaited value instead of the future")
            raise

    def came_inline(self) -> bool:
        """Whether every part came with its Result: `value()` needs no rank."""
        return all(rank in self._inline for rank in self._ranks())

    async def value(self) -> Any:
        """The value itself, for the driver that awaits it (fetched where not inline). Every
        awaiter gets the same object, built once."""
        if self._done:
            return self._value
        ranks = self._ranks()
        missing = [rank for rank in ranks if rank not in self._inline]
        if not missing:  # every part came inline: built at once, nothing to wait for
            return self._build(ranks, {})
        if self._building is None:  # one build however many await (each awaiter shielded:
            # one cancelled leaves the others theirs); a failure: the next await asks again
            self._building = asyncio.ensure_future(self._fetch_and_build(ranks, missing))
            self._building.add_done_callback(self._built)
        return await asyncio.shield(self._building)

    async def _fetch_and_build(self, ranks: list[int], missing: list[int]) -> Any:
        for rank in missing:  # from every rank at once; a fetch that failed: again
            if _to_fetch(self._fetching.get(rank)):
                self._fetching[rank] = asyncio.ensure_future(self.group._fetch(
                    rank, self.obj_id, self.schemas[rank].nbytes if rank in self.schemas else 0))
        try:
            parts = await asyncio.gather(*(self._fetching[r] for r in missing))
        except BaseException:  # a failed fetch kept: its error's traceback names self, a
            # cycle that keeps the ranks' parts until a gc pass (the next await asks again)
            for rank in [r for r, fetch in self._fetching.items() if _to_fetch(fetch)]:
                del self._fetching[rank]
            raise
        fetched = dict(zip(missing, parts, strict=True))
        self._fetching.clear()
        return self._build(ranks, fetched)

    def _build(self, ranks: list[int], fetched: dict[int, Any]) -> Any:
        value = None
        if not fetched and self._collect_encoded is not None:  # every part came inline
            value = self._collect_encoded(self._inline)
        if value is None:
            value = self._collect({rank: fetched[rank] if rank in fetched else
                                   codec.decode(self._inline[rank]) for rank in ranks})
        self._value = codec.count_produced(value)
        self._done = True
        return self._value

    def _built(self, task: asyncio.Task[Any]) -> None:
        self._building = None
        if not task.cancelled():
            task.exception()  # seen by its awaiters; none left: not "never retrieved"

    def holds_batches(self) -> bool:
        """Whether every part the ranks keep is a TensorBatch (and one is kept at all)."""
        return bool(self.schemas) and all(s.rows >= 0 for s in self.schemas.values())

    def _ranks(self) -> list[int]:
        """The collected ranks in rank order (not Split.collect's): the order collect gets."""
        return sorted(set(self.schemas) | set(self._inline))


def _to_fetch(fetch: asyncio.Future[Any] | None) -> bool:
    """Whether a part is to be fetched (again): no fetch of it yet, or one that failed."""
    return fetch is None or (fetch.done() and (fetch.cancelled() or
                                               fetch.exception() is not None))
