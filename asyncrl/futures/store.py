"""The per-rank object store: results stay where they were produced until released."""

from __future__ import annotations

import datetime
import decimal
import enum
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.comm import codec
from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.messages import NONE, Column, Schema
from asyncrl.comm.remote import RemoteBatch, RemoteValue
from asyncrl.comm.sizes import fields, pulled_bytes, value_bytes


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
            else:  # its bytes (an estimate) give a pull of its rows time and buckets
                listed = value_bytes(col)
                columns.append(Column(key, "list", row_bytes=-(-listed // max(1, len(col)))))
                nbytes += listed
        _check_sendable(value)  # (its list columns; the tensors' errors name the column)
        meta = msgspec.Raw(codec.encode(value.meta)) if value.meta else NONE
        return Schema(len(value), tuple(columns), meta, nbytes)
    _check_sendable(value)
    return Schema(-1, nbytes=pulled_bytes(value))


def _check_sendable(value: Any) -> None:
    """A TypeError unless the codec can send every leaf of a value, however deep in lists,
    dicts, batches (their list columns too), dataclasses and Structs: a large value is
    stored, not encoded, and what cannot be sent failed only at a consumer's pull (blamed on
    the consumer) or a driver's fetch. Checked by type, not by encoding the value; the error
    names its path (value['q'][0]), made only then."""
    try:
        _walk(value)
    except _Unsendable as e:
        path = "".join(reversed(e.path))
        raise TypeError(f"value{path}: {e.cause}" if path else str(e.cause)) from None


class _Unsendable(Exception):
    """What cannot be sent, and its path inward (filled as the walk unwinds)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause
        self.path: list[str] = []


# what msgspec encodes as it is, by exact type (a subclass of int or str it does not); the
# rest mirrors codec._enc_hook
_SENDS = frozenset({int, float, str, bytes, bool, type(None), bytearray, memoryview,
                    datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
                    uuid.UUID, decimal.Decimal, msgspec.Raw, msgspec.msgpack.Ext,
                    type(msgspec.UNSET),
                    RemoteBatch, RemoteValue})


def _walk(value: Any) -> None:
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in _SENDS or _past_64_bits(key):
                _inside(key, key)
            if type(item) not in _SENDS or _past_64_bits(item):
                _inside(item, key)
        return
    if isinstance(value, list | tuple | set | frozenset):
        kinds = set(map(type, value))
        if _SENDS.issuperset(kinds) and (int not in kinds or (  # long lists: fast
                -(1 << 63) <= min(value) and max(value) < 1 << 64 if kinds == {int}
                else not any(map(_past_64_bits, value)))):
            return
        items = enumerate(value)
    elif isinstance(value, TensorBatch):
        items = value.items()
    elif (named := fields(value)) is not None:  # a Struct's, a dataclass's
        items = [(_Field(name), v) for name, v in named]
    else:
        _check_leaf(value)
        return
    for at, item in items:
        if type(item) not in _SENDS or _past_64_bits(item):
            _inside(item, at)


def _past_64_bits(value: Any) -> bool:
    """An int msgpack cannot carry (it takes -2**63 .. 2**64-1)."""
    return type(value) is int and not -(1 << 63) <= value < 1 << 64


def _check_leaf(value: Any) -> None:
    if _past_64_bits(value):
        raise _Unsendable(OverflowError(f"the int {value} is past 64 bits, which msgpack "
                                        f"cannot carry; send it as a string"))
    if type(value) in _SENDS or isinstance(value, enum.Enum):  # (an enum: sent as its value)
        return
    try:
        if isinstance(value, torch.Tensor):
            codec.check_sendable(value)
        elif isinstance(value, np.ndarray):  # refused by dtype: an empty one says it
            codec._enc_hook(np.empty(0, value.dtype).view(type(value)))
        elif isinstance(value, np.generic):
            codec._enc_hook(value)
        else:  # a class or function (sent by name), or the codec's TypeError
            codec.encode(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise _Unsendable(e) from None


class _Field(str):
    """A dataclass's or Struct's field name, in a path: .name, not ['name']."""


def _inside(item: Any, at: Any) -> None:
    try:
        _walk(item)
    except _Unsendable as e:
        e.path.append(f".{at}" if isinstance(at, _Field) else f"[{at!r}]")
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
