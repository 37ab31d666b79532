"""TensorBatch: the unit of data between groups.

Named columns that share dim 0: tensors, or lists of msgspec-encodable values (strings,
numbers, lists), plus a small `meta` dict. Never pickled: `comm.codec` sends it as a header
plus raw tensor buffers.

Row operations (`chunk`, `split`, `repeat`) live in `RowOps` and use only `len`, `slice`,
`take`, `concat` and `meta`, so another container with those primitives can reuse them.
Every method that returns a batch gives it its own `meta` dict.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from typing_extensions import Self

Column = torch.Tensor | list

PAD_KEY = "dp_pad"  # meta key: how many trailing rows of a padded chunk are padding


def _count(method: str, name: str, value: Any) -> int:
    """`value` as an int >= 1, or an error naming the method and argument."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{method}({name}) needs an int, got {type(value).__name__}") from None
    if n < 1:
        raise ValueError(f"{method}({name}) needs {name} >= 1, got {n}")
    return n


def sliced_meta(meta: dict[str, Any], length: int, start: int, stop: int) -> dict[str, Any]:
    """The meta of rows [start, stop): the padding mark counts the padding rows kept (the
    last `meta[PAD_KEY]` rows are padding), so a micro-batch never drops a real row."""
    pad = meta.get(PAD_KEY)
    if not pad:
        return meta
    start, stop, _ = slice(start, stop).indices(length)
    kept = max(0, stop - max(start, length - pad))
    out = {k: v for k, v in meta.items() if k != PAD_KEY}
    if kept:
        out[PAD_KEY] = kept
    return out


def unpadded_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The meta of rows picked one by one (take): where padding went is unknown."""
    return {k: v for k, v in meta.items() if k != PAD_KEY} if PAD_KEY in meta else meta


def concat_meta(parts: Sequence[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """The first batch's meta (parts: (meta, rows) per batch); the padding marks add up
    while the padding stays trailing, i.e. no real row follows a padding row."""
    out, total = unpadded_meta(parts[0][0]), 0
    for meta, rows in parts:
        pad = meta.get(PAD_KEY, 0)
        if total and pad != rows:
            return out  # real rows after padding: no single trailing mark describes it
        total += pad
    return {**out, PAD_KEY: total} if total else out


class RowOps:
    """Row operations written only with `len(self)`, `slice`, `take`, `concat` and `meta` (a
    subclass may override `_pieces` to cut many pieces in one pass)."""

    __slots__ = ()

    if TYPE_CHECKING:  # the primitives a subclass provides
        meta: dict[str, Any]

        def __len__(self) -> int: ...
        def slice(self, start: int, stop: int) -> Self: ...
        def take(self, rows: Sequence[int]) -> Self: ...
        @classmethod
        def concat(cls, batches: Sequence[Self]) -> Self: ...

    @property
    def real_rows(self) -> int:
        """The rows before a DP chunk's trailing padding (`meta[PAD_KEY]`): all, unpadded."""
        return len(self) - int(self.meta.get(PAD_KEY, 0))

    def chunk(self, n: int, pad: bool = False) -> list[Self]:
        """Exactly `n` near-equal chunks in row order; the first len % n get one row more.

        With `pad=True` every chunk has ceil(len / n) rows (so data-parallel ranks run the same
        number of steps): a short chunk repeats its last row (an empty one, the batch's last row)
        and records the number of trailing padding rows in `meta[PAD_KEY]`.
        """
        n = _count("chunk", "n", n)
        base, extra = divmod(len(self), n)
        out = self._pieces([base + 1] * extra + [base] * (n - extra))
        if pad and extra:  # else every chunk already has ceil(len / n) rows (or none has a row)
            last = self.slice(len(self) - 1, len(self))  # what an empty chunk repeats
            out = [self._pad(c, base + 1, last) for c in out]
        return out

    def _pieces(self, sizes: list[int]) -> list[Self]:
        """Consecutive pieces of `sizes` rows (summing to len(self)); a subclass may cut them
        in one pass instead of a `slice` each."""
        out, start = [], 0
        for size in sizes:
            out.append(self.slice(start, start + size))
            start += size
        return out

    def pad_to(self, rows: int) -> Self:
        """At least `rows` rows: the last row repeated, the padding rows marked in
        `meta[PAD_KEY]` (as `chunk(pad=True)` pads a short chunk). Needs a row to repeat."""
        if len(self) >= rows:  # (a batch of its own meta, as every other returned)
            return self.slice(0, len(self))
        if not len(self):
            raise ValueError("pad_to: an empty batch has no row to repeat")
        return self._pad(self, rows, self)

    def _pad(self, chunk: Self, rows: int, last: Self) -> Self:
        missing = rows - len(chunk)
        if missing == 0:
            return chunk
        src = chunk if len(chunk) else last
        # take shares a list column's items with the row it repeats: a method that changes
        # a row's list in place (appends a turn) changed its padding too
        extra = _own_items(src.take([len(src) - 1] * missing))
        padded = type(self).concat([chunk, extra])
        # padding the chunk already had (re-chunking a padded chunk) stays trailing too
        padded.meta[PAD_KEY] = chunk.meta.get(PAD_KEY, 0) + missing
        return padded

    def split(self, micro_batch_size: int) -> list[Self]:
        """Consecutive batches of `micro_batch_size` rows (the last may be shorter; none if
        the batch is empty)."""
        size = _count("split", "micro_batch_size", micro_batch_size)
        full, rest = divmod(len(self), size)
        return self._pieces([size] * full + ([rest] if rest else []))

    def repeat(self, k: int, interleave: bool = True) -> Self:
        """Each row `k` times: row0,row0,row1,row1 when interleaved, else the whole batch
        `k` times: row0,row1,row0,row1. Every column is copied, a `seed` column too: for k
        different samples per prompt give each copy its own seed (PromptSource(repeat=k)
        does), or the k samples are the same and a GRPO group's advantages all 0."""
        k = _count("repeat", "k", k)
        pad = self.meta.get(PAD_KEY, 0)
        if interleave:
            out = self.take([i for i in range(len(self)) for _ in range(k)])
            if pad:  # the padding rows' copies: trailing still (a DP chunk's k samples)
                out.meta[PAD_KEY] = pad * k
        elif pad:
            raise ValueError(f"repeat(k, interleave=False) of a batch with {pad} padding "
                             f"row(s) puts them among real rows; repeat interleaved, or drop "
                             f"them first (batch.slice(0, len(batch) - {pad}))")
        else:
            out = type(self).concat([self] * k)
        # each copy its own list items (take and concat share them), as each sample's fetch
        # gets: appending a turn to one sample's messages changed its k - 1 siblings
        return _own_items(out) if k > 1 else out


_IMMUTABLE = frozenset({int, float, str, bytes, bool, type(None)})


def _own_items(batch: Any) -> Any:
    """`batch` with its list columns' items copied (a TensorBatch's; tensor columns are
    copies already), in place: their containers, not the tensors and arrays in them."""
    if isinstance(batch, TensorBatch):
        for k, v in batch._data.items():
            if isinstance(v, list):
                batch._data[k] = [_own(x) for x in v]
    return batch


def _own(x: Any) -> Any:
    """`x` with its lists, dicts, tuples and sets copied, as deep as they go; tensors and
    arrays shared (an image per row: a deep copy of each repeat cost seconds and GBs);
    numbers and strings as they are (immutable); anything else deep-copied."""
    if type(x) in _IMMUTABLE or isinstance(x, torch.Tensor | np.ndarray):
        return x
    if type(x) is dict:  # (exact types: a subclass's constructor may take other arguments)
        return {k: _own(v) for k, v in x.items()}
    if type(x) in (list, tuple, set, frozenset):
        return type(x)(_own(v) for v in x)
    return copy.deepcopy(x)


def row_indices(rows: Iterable[Any]) -> list[int]:
    """`rows` as plain ints (numpy's or 0-d tensors' too), once (a generator is empty the
    second time); a boolean mask or floats refused: True, False read as rows 1, 0, and a
    float was truncated to a row: the wrong rows, silently."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if any(isinstance(r, bool | np.bool_) or (isinstance(r, torch.Tensor | np.ndarray)
                                                and r.dtype in (torch.bool, np.bool_))
           for r in rows):
        raise TypeError("take(rows) needs row indices, got a boolean mask; pass "
                        "mask.nonzero().flatten() (the indices where it is True)")
    try:
        return [operator.index(r) for r in rows]
    except TypeError:
        raise TypeError(f"take(rows) needs whole row indices, got "
                        f"{[r for r in rows if not isinstance(r, int)][:3]}") from None


class TensorBatch(RowOps):
    __slots__ = ("_data", "_len", "meta")

    def __init__(self, data: Mapping[str, Column], meta: dict[str, Any] | None = None):
        cols: dict[str, Column] = {}
        length: int | None = None
        for key, col in data.items():
            if not isinstance(key, str):
                raise TypeError(f"TensorBatch column names must be str, got {key!r}")
            if isinstance(col, torch.Tensor):
                if col.dim() == 0:
                    raise ValueError(
                        f"TensorBatch column {key!r} is a 0-d tensor; columns share dim 0, "
                        f"so give it a leading batch dimension (e.g. t.reshape(1))")
                n = col.shape[0]
            elif isinstance(col, (list, tuple)):
                col = list(col)
                n = len(col)
            else:
                raise TypeError(
                    f"TensorBatch column {key!r} is a {type(col).__name__}; columns are "
                    f"torch tensors or lists (put scalars and small values in `meta`)")
            if length is None:
                length = n
            elif n != length:
                first = next(iter(cols))
                raise ValueError(
                    f"TensorBatch columns must share dim 0: {first!r} has {length} rows but "
                    f"{key!r} has {n}; give every column one entry per row")
            cols[key] = col
        self._data = cols
        self._len = length or 0
        self.meta: dict[str, Any] = dict(meta or {})
        named = [k for k in self.meta if not isinstance(k, str)]
        if named:  # (it came back to the driver, but no other group's ranks could read it)
            raise TypeError(f"TensorBatch meta keys must be str, got {named[:3]!r}")

    @classmethod
    def _of(cls, data: dict[str, Column], length: int, meta: dict[str, Any]) -> TensorBatch:
        """A batch of columns known to be valid (e.g. rows of a valid batch), without
        __init__'s checks: a DP call builds one chunk per rank."""
        batch = cls.__new__(cls)
        batch._data, batch._len, batch.meta = data, length, dict(meta)
        return batch

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: str) -> Column:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"TensorBatch has no column {key!r}; columns: {list(self._data)}") \
                from None

    def tensor(self, key: str) -> torch.Tensor:
        """A tensor column (TypeError for a list column)."""
        col = self[key]
        if not isinstance(col, torch.Tensor):
            raise TypeError(f"TensorBatch column {key!r} is a list, not a tensor")
        return col

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def items(self) -> Iterable[tuple[str, Column]]:
        return self._data.items()

    def to_dict(self) -> dict[str, Column]:
        """The columns as a new dict (the columns themselves are not copied)."""
        return dict(self._data)

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{k}: {tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else f"{k}: list"
            for k, v in self._data.items())
        return f"TensorBatch(len={self._len}, {{{cols}}}, meta={self.meta})"

    # -- columns --------------------------------------------------------------------------
    def select(self, keys: Iterable[str]) -> TensorBatch:
        """Only the named columns, in the order given."""
        if isinstance(keys, str):
            raise TypeError(f"select(keys) takes a list of column names, got the str {keys!r}; "
                            f"write select([{keys!r}])")
        keys = list(keys)
        if not keys:
            # A batch without columns has no rows, so this would silently change the length.
            raise ValueError(f"select(keys) needs at least one column; columns: {self.keys()}")
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise KeyError(f"TensorBatch.select: no column(s) {missing}; columns: {self.keys()}")
        return TensorBatch({k: self._data[k] for k in keys}, self.meta)

    def union(self, other: TensorBatch) -> TensorBatch:
        """Columns of both batches side by side; `meta` merged, `other`'s keys winning."""
        if not isinstance(other, TensorBatch):
            raise TypeError(f"union(other) needs a TensorBatch, got {type(other).__name__}; "
                            f"wrap columns with TensorBatch({{...}})")
        if len(other) != len(self):
            raise ValueError(
                f"TensorBatch.union: this batch has {len(self)} rows but other has "
                f"{len(other)}; columns side by side must have the same rows (slice one first)")
        data = dict(self._data)
        for k, col in other._data.items():
            if k in data and not _same_column(data[k], col):
                raise ValueError(
                    f"TensorBatch.union: column {k!r} is in both batches with different values; "
                    f"drop it from one side first (e.g. other.select([...]) without {k!r})")
            data.setdefault(k, col)
        return TensorBatch(data, {**self.meta, **other.meta})

    # -- rows -----------------------------------------------------------------------------
    def slice(self, start: int, stop: int) -> TensorBatch:
        """Rows [start, stop) as a new batch (tensor columns are views)."""
        start, stop, _ = slice(start, stop).indices(self._len)
        return TensorBatch._of({k: v[start:stop] for k, v in self._data.items()},
                               max(0, stop - start), sliced_meta(self.meta, self._len, start, stop))

    def _pieces(self, sizes: list[int]) -> list[TensorBatch]:
        # one torch.split per tensor column instead of a slice per piece
        stops = list(itertools.accumulate(sizes))
        starts = [0, *stops][:-1]
        cols = [v.split(sizes) if isinstance(v, torch.Tensor) else
                [v[a:b] for a, b in zip(starts, stops, strict=True)] for v in self._data.values()]
        keys = list(self._data)
        return [TensorBatch._of(dict(zip(keys, parts, strict=True)), b - a,
                                sliced_meta(self.meta, self._len, a, b))
                for a, b, *parts in zip(starts, stops, *cols, strict=True)]

    def take(self, rows: Sequence[int]) -> TensorBatch:
        """The given rows, in the given order: tensor columns copied, a list column's items
        the same objects (a row taken twice shares a mutable item)."""
        rows = row_indices(rows)
        if rows and not 0 <= min(rows) <= max(rows) < self._len:  # (a list column wrapped -1)
            raise IndexError(f"take: row indices run from 0 to {self._len - 1}, got "
                             f"{min(rows)}..{max(rows)}")
        index = torch.tensor(rows, dtype=torch.long)
        return TensorBatch(  # the index on each column's device (a no-op on the CPU's)
            {k: _rows(v, index.to(v.device)) if isinstance(v, torch.Tensor) else
             [v[i] for i in rows] for k, v in self._data.items()}, unpadded_meta(self.meta))

    @staticmethod
    def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
        """Rows of every batch, in order. Keys must match; `meta` is the first batch's."""
        if not batches:
            raise ValueError("TensorBatch.concat needs at least one batch")
        if not isinstance(batches[0], TensorBatch) and isinstance(batches[0], RowOps):
            # a protocol's collect sees references to rows on the ranks when its result is
            # passed on: concat them the way their own type does
            return type(batches[0]).concat(batches)
        keys = batches[0].keys()
        for i, b in enumerate(batches[1:], 1):
            if b.keys() != keys:
                raise ValueError(f"TensorBatch.concat: batch {i} has columns {b.keys()} but "
                                 f"batch 0 has {keys}; {_column_fix(keys, b.keys(), i)}")
        data: dict[str, Column] = {}
        for k in keys:
            cols = [b._data[k] for b in batches]
            tensors = [c for c in cols if isinstance(c, torch.Tensor)]
            if len(tensors) == len(cols):
                if any(t.dtype != tensors[0].dtype for t in tensors):  # torch.cat would promote
                    dtypes = "; ".join(f"batch {i}: {t.dtype}" for i, t in enumerate(tensors))
                    raise ValueError(
                        f"TensorBatch.concat: column {k!r} has different dtypes ({dtypes}); "
                        f"cast it to one dtype in every batch first (e.g. .to(torch.int64))")
                try:
                    data[k] = torch.cat(tensors, dim=0)
                except RuntimeError as e:  # row shapes or devices differ
                    rows = [f"batch {i}: {tuple(t.shape[1:])} on {t.device}"
                            for i, t in enumerate(tensors)]
                    raise ValueError(
                        f"TensorBatch.concat: column {k!r} cannot be joined ({'; '.join(rows)}); "
                        f"its rows must have one shape and device in every batch: pad them "
                        f"to one length or move them to one device first") from e
            elif all(isinstance(c, list) for c in cols):
                data[k] = [x for c in cols for x in c]
            else:
                where = [i for i, c in enumerate(cols) if isinstance(c, torch.Tensor)]
                rest = [i for i in range(len(cols)) if i not in where]
                raise TypeError(f"TensorBatch.concat: column {k!r} is a tensor in some batches "
                                f"({where}) and a list in others ({rest}); make it one kind "
                                f"first: torch.tensor(the list) or the tensor's .tolist()")
        return TensorBatch(data, concat_meta([(b.meta, len(b)) for b in batches]))


def _column_fix(keys: list[str], other: list[str], i: int) -> str:
    """How to make batch i's columns match batch 0's, for concat's message."""
    if sorted(other) == sorted(keys):
        return f"the same columns in another order: reorder batch {i} with .select({keys})"
    missing = [k for k in keys if k not in other]
    extra = [k for k in other if k not in keys]
    said = " and ".join(([f"lacks {missing}"] if missing else []) +
                        ([f"has {extra} besides"] if extra else []))
    shared = [k for k in keys if k in other]
    return (f"batch {i} {said}; every batch needs the same columns: keep the shared ones "
            f"with .select({shared}) on each batch, or add the missing ones")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """t's bits as the int of its item size: a dtype that an op lacks (torch 2.13's CPU
    index_select and equal refuse uint16/32/64, bits16, complex32) in one it has."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    try:
        return t.index_select(0, index)
    except NotImplementedError:  # (uint16 token ids from an np.memmap, say)
        return _as_int(t).index_select(0, index).view(t.dtype)


def _same_column(a: Column, b: Column) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # torch.equal promotes dtypes; an int and a float column are not the same column.
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        try:  # NaN != NaN, yet a column holding NaN is the same column as itself or a copy
            return a is b or torch.equal(a, b) or (
                (a.is_floating_point() or a.is_complex()) and
                bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))
        except NotImplementedError:  # the same bits: the same column (NaN too)
            return torch.equal(_as_int(a), _as_int(b))
    return isinstance(a, list) and isinstance(b, list) and _same_item(a, b)


def _same_item(a: Any, b: Any) -> bool:
    """A list column's items alike, as tensor columns are: tensors by value (== on them is
    a tensor, whose truth raised), NaN the same as NaN (a wire copy was "different")."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
            _same_column(a.reshape(1, -1), b.reshape(1, -1)) and a.shape == b.shape)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and \
            a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_item(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_item(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)
