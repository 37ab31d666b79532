"""ObjectRef: the controller's handle on one call's result.

It holds where each collected rank keeps its part (a `Shard` and its schema) and, when the
parts were small, the encoded values themselves. Passing the call's future to another group
uses `view()` — references that the consumer's ranks pull from — and never the values.
`await` uses `value()`, fetching the parts that were too big to come inline. When the last
reference to an ObjectRef goes (its DistFuture and every pending consumer call), the owners
are told to free their parts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.comm import codec
from asyncrl.comm.messages import Schema
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue, Shard

if TYPE_CHECKING:
    from asyncrl.controller.group import GroupHandle


class ObjectRef:
    __slots__ = ("group", "obj_id", "_collect", "shards", "_inline", "_value", "_done",
                 "__weakref__")

    def __init__(self, group: GroupHandle, obj_id: int, collect: Callable[[dict[int, Any]], Any],
                 shards: dict[int, tuple[Shard, Schema]], inline: dict[int, msgspec.Raw]):
        self.group, self.obj_id = group, obj_id
        self._collect = collect
        self.shards = shards  # rank -> where its part is stored (ranks that returned None: none)
        self._inline = inline  # rank -> encoded value, for the parts that came with the Result
        self._value: Any = None
        self._done = False
        if shards:
            weakref.finalize(self, group._ctl._release_later, group, list(shards), obj_id)

    def view(self) -> Any:
        """The value as references for another group's call: nothing is fetched."""
        parts: dict[int, Any] = {}
        for rank in self._ranks():
            if rank not in self.shards:
                parts[rank] = None
                continue
            shard, schema = self.shards[rank]
            if schema.rows < 0:
                parts[rank] = RemoteValue(shard)
            else:
                meta = codec.decode(schema.meta) or {}
                parts[rank] = RemoteBatch([Piece(shard, 0, schema.rows)], schema.columns, meta)
        return self._collect(parts)

    async def value(self) -> Any:
        """The value itself, for the driver that awaits it (fetched where not inline)."""
        if not self._done:
            parts = {}
            for rank in self._ranks():
                raw = self._inline.get(rank)
                if raw is None:
                    raw = await self.group._fetch(rank, self.obj_id)
                parts[rank] = codec.decode(raw)
            self._value = codec.count_produced(self._collect(parts))
            self._done = True
        return self._value

    def _ranks(self) -> list[int]:
        return sorted(set(self.shards) | set(self._inline))
