"""References to data that stays on the ranks that produced it.

The controller never holds a worker's payload: for a stored result it holds a `Shard` per
owning rank, and when a future is passed to another group it builds a `RemoteBatch` (rows
as pieces of shards) or a `RemoteValue`. Protocols split a `RemoteBatch` exactly like a
`TensorBatch` (the same row operations), so every transfer plan — DP m -> n, replicas,
broadcast, rank zero, user protocols — falls out of the consumer's protocol. The consumer's
ranks then pull their pieces straight from the producers (`comm.dataplane`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl.comm.batch import RowOps, concat_meta, row_indices, sliced_meta, unpadded_meta
from asyncrl.comm.messages import Column


class Shard(msgspec.Struct, array_like=True, frozen=True):
    """One rank's stored part of a result."""

    group: str
    rank: int
    obj_id: int
    addr: str  # the owner's data-plane server
    host: str
    gpu: str = ""  # the UUID of the owner's GPU ("" without one)

    @property
    def peer(self) -> str:
        return f"{self.group}:{self.rank}"


class Piece(msgspec.Struct, array_like=True, frozen=True):
    """Rows [start, stop) of one shard."""

    shard: Shard
    start: int
    stop: int


class RemoteValue:
    """A whole stored value (not a TensorBatch) on one rank, and the bytes of its arrays: a
    pull of it waits for them on a slow link. A plain class, not a Struct: the codec must
    see it to encode it as a reference."""

    __slots__ = ("shard", "nbytes")

    def __init__(self, shard: Shard, nbytes: int = 0):
        self.shard, self.nbytes = shard, nbytes

    def __repr__(self) -> str:
        return f"RemoteValue({self.shard.peer} object {self.shard.obj_id})"


class RemoteBatch(RowOps):
    """A TensorBatch whose rows live on producer ranks, described piece by piece."""

    __slots__ = ("pieces", "columns", "meta", "_len")

    def __init__(self, pieces: Sequence[Piece], columns: Sequence[Column],
                 meta: dict[str, Any] | None = None):
        self.pieces = [p for p in pieces if p.stop > p.start]
        self.columns = tuple(columns)
        self.meta: dict[str, Any] = dict(meta or {})
        self._len = sum(p.stop - p.start for p in self.pieces)

    def __len__(self) -> int:
        return self._len

    def keys(self) -> list[str]:
        return [c.key for c in self.columns]

    def __repr__(self) -> str:
        return f"RemoteBatch(len={self._len}, pieces={len(self.pieces)}, keys={self.keys()})"

    def slice(self, start: int, stop: int) -> RemoteBatch:
        start, stop, _ = slice(start, stop).indices(self._len)
        out, offset = [], 0
        for p in self.pieces:
            n = p.stop - p.start
            lo, hi = max(start - offset, 0), min(stop - offset, n)
            if lo < hi:
                out.append(Piece(p.shard, p.start + lo, p.start + hi))
            offset += n
        return RemoteBatch(out, self.columns, sliced_meta(self.meta, self._len, start, stop))

    def _pieces(self, sizes: list[int]) -> list[RemoteBatch]:
        # one walk over the pieces, not one per slice: chunking a DP result of n ranks over
        # n ranks would cost n * n
        out, i, used, start = [], 0, 0, 0  # used: rows of self.pieces[i] in earlier batches
        for size in sizes:
            parts, need = [], size
            while need:
                p = self.pieces[i]
                take = min(need, p.stop - p.start - used)
                parts.append(Piece(p.shard, p.start + used, p.start + used + take))
                need, used = need - take, used + take
                if used == p.stop - p.start:
                    i, used = i + 1, 0
            out.append(RemoteBatch(parts, self.columns,
                                   sliced_meta(self.meta, self._len, start, start + size)))
            start += size
        return out

    def take(self, rows: Sequence[int]) -> RemoteBatch:
        out: list[Piece] = []
        ends = list(itertools.accumulate(p.stop - p.start for p in self.pieces))
        for r in row_indices(rows):  # numpy or 0-d torch indices: plain ints
            if not 0 <= r < self._len:
                raise IndexError(f"take: row {r} is outside this batch of {self._len} rows")
            i = bisect.bisect_right(ends, r)  # the piece holding row r
            held = self.pieces[i]
            at = held.stop - (ends[i] - r)  # row r is ends[i] - r rows before its end
            p = Piece(held.shard, at, at + 1)
            last = out[-1] if out else None
            if last is not None and last.shard == p.shard and last.stop == p.start:
                out[-1] = Piece(p.shard, last.start, p.stop)  # merge runs of adjacent rows
            else:
                out.append(p)
        return RemoteBatch(out, self.columns, unpadded_meta(self.meta))

    def compacted(self) -> tuple[RemoteBatch, list[int]] | None:
        """The rows to pull when fewer pieces hold them (rows repeated, e.g. `repeat(k)`, or
        reordered): each shard's ranges merged, and for each row of this batch its row in
        them. None when the pieces cannot be merged (each would still be one pull)."""
        ranges: dict[Shard, list[list[int]]] = {}
        for p in sorted(self.pieces, key=lambda p: p.start):
            merged = ranges.setdefault(p.shard, [])
            if merged and p.start <= merged[-1][1]:  # overlapping or adjacent
                merged[-1][1] = max(merged[-1][1], p.stop)
            else:
                merged.append([p.start, p.stop])
        if sum(map(len, ranges.values())) >= len(self.pieces):
            return None
        # shard -> (its ranges' starts, their first rows in the compact batch)
        first: dict[Shard, tuple[list[int], list[int]]] = {}
        at = 0
        for shard, merged in ranges.items():
            first[shard] = ([a for a, _ in merged], [])
            for a, b in merged:
                first[shard][1].append(at)
                at += b - a
        order: list[int] = []
        for p in self.pieces:
            starts, rows = first[p.shard]
            i = bisect.bisect_right(starts, p.start) - 1
            order.extend(range(rows[i] + p.start - starts[i], rows[i] + p.stop - starts[i]))
        compact = [Piece(shard, a, b) for shard, merged in ranges.items() for a, b in merged]
        return RemoteBatch(compact, self.columns), order

    @staticmethod
    def concat(batches: Sequence[RemoteBatch]) -> RemoteBatch:  # type: ignore[override]
        if not batches:
            raise ValueError("RemoteBatch.concat needs at least one batch")
        columns = batches[0].columns
        for i, b in enumerate(batches[1:], 1):
            if list(map(_kind, b.columns)) != list(map(_kind, columns)):
                differ = sorted(set(map(_kind, b.columns)) ^ set(map(_kind, columns)))
                hint = " (responses to prompt batches of different widths: give the " \
                    "PromptSource max_prompt_length, which pads prompts to it)" if any(
                        d[0].startswith("prompt") for d in differ) else ""
                raise ValueError(f"concat: batch {i} and batch 0 differ in columns (key, dtype, "
                                 f"row shape, device) {differ or 'order'}: batches "
                                 f"concatenate when their columns match{hint}")
        # a list column's bytes a row: the most any part's producer estimated (too many give
        # a pull more time and smaller buckets; too few, too little time)
        columns = tuple(msgspec.structs.replace(c, row_bytes=max(
            b.columns[j].row_bytes for b in batches)) if c.dtype == "list" else c
            for j, c in enumerate(columns))
        return RemoteBatch([p for b in batches for p in b.pieces], columns,
                           concat_meta([(b.meta, len(b)) for b in batches]))


def _kind(c: Column) -> tuple[str, str, tuple[int, ...], str]:
    """What concatenated columns must share (not their estimated bytes)."""
    return c.key, c.dtype, c.shape, c.device
