"""The per-rank object store: results stay where they were produced until released."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import msgspec
import torch

from asyncrl.comm import codec
from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.messages import NONE, Column, Schema


def schema_of(value: Any) -> Schema:
    """Keys, dtypes, row shapes and size of a value, for the controller's reference."""
    if isinstance(value, TensorBatch):
        columns, nbytes = [], 0
        for key, col in value.items():
            if isinstance(col, torch.Tensor):
                _check_column(key, col)
                columns.append(Column(key, str(col.dtype)[6:], tuple(col.shape[1:]),
                                      "cuda" if col.is_cuda else "cpu"))
                nbytes += col.numel() * col.element_size()
            else:
                columns.append(Column(key, "list"))
        meta = msgspec.Raw(codec.encode(value.meta)) if value.meta else NONE
        return Schema(len(value), tuple(columns), meta, nbytes)
    _check_tensors(value)
    return Schema(-1, nbytes=codec.array_bytes(value))


def _check_tensors(value: Any) -> None:
    """`check_sendable` for every tensor in a value, however deep in lists, dicts and batches
    (as `codec.array_bytes` walks them): a large value is stored, not encoded, and a tensor
    that cannot be sent failed only when a driver fetched it, unnamed. The error names its
    path (value['q'][0]), made only then."""
    try:
        _walk(value)
    except _Unsendable as e:
        path = "".join(reversed(e.path))
        raise TypeError(f"value{path}: {e.cause}" if path else str(e.cause)) from None


class _Unsendable(Exception):
    """A tensor that cannot be sent, and its path inward (filled as the walk unwinds)."""

    def __init__(self, cause: TypeError):
        super().__init__(str(cause))
        self.cause = cause
        self.path: list[str] = []


def _walk(value: Any) -> None:
    if isinstance(value, torch.Tensor):
        try:
            codec.check_sendable(value)
        except TypeError as e:
            raise _Unsendable(e) from None
        return
    items: Iterable[tuple[Any, Any]] = value.items() if isinstance(value, dict | TensorBatch) \
        else enumerate(value) if isinstance(value, list | tuple) else ()
    for at, item in items:
        if type(item) not in codec._LEAVES:  # long lists of numbers, strings: fast
            try:
                _walk(item)
            except _Unsendable as e:
                e.path.append(f"[{at!r}]")
                raise


def _check_column(key: str, col: torch.Tensor) -> None:
    """TypeError naming the column unless its raw bytes are all of it: a large batch is
    stored, not encoded, and the data plane moves its columns' bytes as they are."""
    try:
        codec.check_sendable(col)
    except TypeError as e:
        raise TypeError(f"column {key!r} of the TensorBatch: {e}") from None


def storable(value: Any) -> Any:
    """The value with the lazy conjugate and negative bits of its batch columns applied: the
    data plane moves a column's raw bytes (shared memory, CUDA IPC, NCCL), which lack them."""
    if isinstance(value, TensorBatch) and any(
            isinstance(c, torch.Tensor) and (c.is_conj() or c.is_neg()) for _, c in value.items()):
        return TensorBatch({k: c.resolve_conj().resolve_neg() if isinstance(c, torch.Tensor)
                            else c for k, c in value.items()}, value.meta)
    return value


class ObjectStore:
    """obj_id -> value. The exec thread puts, the data server reads, the io thread frees."""

    def __init__(self) -> None:
        self._objects: dict[int, tuple[Any, int]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0

    def put(self, obj_id: int, value: Any, nbytes: int) -> None:
        with self._lock:
            old = self._objects.get(obj_id)  # overwritten: its bytes are no longer held
            self._objects[obj_id] = (value, nbytes)
            self.nbytes += nbytes - (old[1] if old is not None else 0)

    def get(self, obj_id: int) -> Any:
        entry = self._objects.get(obj_id)
        if entry is None:
            raise KeyError(obj_id)
        return entry[0]

    def free(self, obj_ids: list[int]) -> None:
        with self._lock:
            for obj_id in obj_ids:
                entry = self._objects.pop(obj_id, None)
                if entry is not None:
                    self.nbytes -= entry[1]

    def __len__(self) -> int:
        return len(self._objects)
