"""How a pull of rows is cut up: rows into buckets of about `limit` bytes (tensor columns'
bytes and list columns' estimated ones), a bucket's columns into groups of pulls."""

from __future__ import annotations

import math

import torch

from asyncrl.comm import dataserver
from asyncrl.comm.dtypes import torch_dtype
from asyncrl.comm.messages import Column
from asyncrl.comm.remote import Piece


def row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The bytes of a row of a tensor column."""
    return math.prod(shape) * torch.empty((), dtype=torch_dtype(dtype)).element_size()


def list_row_bytes(columns: tuple[Column, ...]) -> int:
    """The bytes of a row's list columns, as their producer estimated them (on average): they
    come inside the reply's signed message, whatever carries the tensor columns."""
    return sum(c.row_bytes for c in columns if c.dtype == "list")


def rows_of(pieces: list[Piece], nbytes: int, limit: int) -> list[Piece]:
    """Pieces cut into runs of rows of at most `limit` bytes each (a row `nbytes`)."""
    rows = max(1, limit // max(1, nbytes))
    return [Piece(p.shard, s, min(s + rows, p.stop)) for p in pieces
            for s in range(p.start, p.stop, rows)]


def column_groups(row_bytes: dict[str, int], rows: int, by_bytes: bool,
                  limit: int) -> list[list[str]]:
    """The columns in groups, each asked for by one pull: of at most `limit` bytes for `rows`
    rows when `by_bytes` (a wider column alone): a row wider than a bucket (a weight pack: a
    column per parameter) comes a group at a time, not as one message held whole beside the
    batch it is copied into; and naming at most half what a data server takes in a message
    (an MoE model's pack has ~19k columns: named in one pull, its server cut the puller off)."""
    groups: list[list[str]] = [[]]
    size = named = 0
    for key, nbytes in row_bytes.items():
        naming = naming_bytes(key)
        if groups[-1] and ((by_bytes and size + nbytes * rows > limit)
                           or named + naming > dataserver.MAX_PULL_BYTES // 2):
            groups.append([])
            size = named = 0
        groups[-1].append(key)
        size += nbytes * rows
        named += naming
    return groups


def naming_bytes(key: str) -> int:
    """At most what a ColumnDest of `key` adds to a pull: the key, its two ints, msgpack's
    framing."""
    return len(key.encode(errors="surrogatepass")) + 24
