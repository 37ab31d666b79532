"""TensorBatch: the unit of data between groups.

Named columns that share dim 0: tensors, or lists of msgspec-encodable values (strings,
numbers, lists), plus a small `meta` dict. Never pickled: `comm.codec` sends it as a header
plus raw tensor buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Column = torch.Tensor | list


class TensorBatch:
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
                    f"{key!r} has {n}")
            cols[key] = col
        self._data = cols
        self._len = length or 0
        self.meta: dict[str, Any] = dict(meta or {})

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: str) -> Column:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"TensorBatch has no column {key!r}; columns: {list(self._data)}") \
                from None

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def items(self) -> Iterable[tuple[str, Column]]:
        return self._data.items()

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{k}: {tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else f"{k}: list"
            for k, v in self._data.items())
        return f"TensorBatch(len={self._len}, {{{cols}}}, meta={self.meta})"

    # -- rows -----------------------------------------------------------------------------
    def slice(self, start: int, stop: int) -> TensorBatch:
        """Rows [start, stop) as a new batch (tensor columns are views)."""
        return TensorBatch({k: v[start:stop] for k, v in self._data.items()}, self.meta)

    def take(self, rows: Sequence[int]) -> TensorBatch:
        """The given rows, in the given order (copies)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return TensorBatch(
            {k: v.index_select(0, index) if isinstance(v, torch.Tensor) else [v[i] for i in rows]
             for k, v in self._data.items()}, self.meta)

    def chunk(self, n: int) -> list[TensorBatch]:
        """Exactly `n` near-equal chunks in row order; the first len % n get one row more."""
        if n < 1:
            raise ValueError(f"chunk(n) needs n >= 1, got {n}")
        base, extra = divmod(self._len, n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            out.append(self.slice(start, stop))
            start = stop
        return out

    @staticmethod
    def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
        """Rows of every batch, in order. Keys must match; `meta` is the first batch's."""
        if not batches:
            raise ValueError("TensorBatch.concat needs at least one batch")
        keys = batches[0].keys()
        for i, b in enumerate(batches[1:], 1):
            if b.keys() != keys:
                raise ValueError(
                    f"TensorBatch.concat: batch {i} has columns {b.keys()} but batch 0 has "
                    f"{keys}; every batch must have the same columns in the same order")
        data: dict[str, Column] = {}
        for k in keys:
            cols = [b._data[k] for b in batches]
            tensors = [c for c in cols if isinstance(c, torch.Tensor)]
            if len(tensors) == len(cols):
                data[k] = torch.cat(tensors, dim=0)
            elif all(isinstance(c, list) for c in cols):
                data[k] = [x for c in cols for x in c]
            else:
                raise TypeError(f"TensorBatch.concat: column {k!r} is a tensor in some batches "
                                f"and a list in others")
        return TensorBatch(data, batches[0].meta)
