"""How many bytes a value holds, counted without encoding it: its tensors' and arrays' bytes
(`array_bytes`), about all it encodes to (`value_bytes`: its strings and numbers too), what a
whole stored value's pull waits for (`pulled_bytes`), or whether it surely encodes past a
limit (`encodes_past`). They look inside lists, tuples, dicts, TensorBatch, msgspec Structs
and dataclasses, as the codec sends them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.comm.batch import TensorBatch

LEAVES = frozenset({int, float, str, bytes, bool, type(None)})
_NUMBERS = frozenset({int, float, bool, type(None)})
NUMBER_BYTES = 8  # a number or other small leaf, taken at its most (msgpack: 1 to 9 bytes)
LARGE_BYTES = 4 << 20  # a whole value's strings and numbers count from this many on (fewer
# take under half a second at the slowest link rate counted on, channel.LINK_MIN_RATE)


def fields(value: Any) -> list[tuple[str, Any]] | None:
    """The (name, value) of each field of a msgspec Struct or a dataclass instance (not a
    class), else None (a field never set left out, as msgspec leaves it out)."""
    if isinstance(value, msgspec.Struct):
        names = list(value.__struct_fields__)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
    else:
        return None
    return [(n, v) for n in names
            if (v := getattr(value, n, msgspec.UNSET)) is not msgspec.UNSET]


def _field_values(value: Any) -> list[Any] | None:
    named = fields(value)
    return None if named is None else [v for _, v in named]


def array_bytes(value: Any) -> int:
    """The bytes of the tensors and arrays in a value, however deep in lists, dicts, Structs
    and dataclasses (a state dict is a dict of tensors): what a store holds, and what cannot
    come inline."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, TensorBatch):
        return sum(array_bytes(col) for _, col in value.items())
    items = value.values() if isinstance(value, dict) else value if isinstance(
        value, (list, tuple)) else _field_values(value) or ()
    return sum(array_bytes(v) for v in items if type(v) not in LEAVES)  # long lists: fast


def value_bytes(value: Any) -> int:
    """About the bytes `value` encodes to, counted without encoding it: its tensors' and
    arrays' bytes, its strings' and bytes' lengths, NUMBER_BYTES a number (a list of
    images or of long texts is mostly bytes that a pull of it waits for)."""
    kind = type(value)
    if kind in _NUMBERS:  # (by exact type first: the common leaves, fast)
        return NUMBER_BYTES
    if kind is str or kind is bytes or kind is bytearray:
        return len(value) + 1
    if isinstance(value, dict):
        return 1 + _items_bytes(value.keys()) + _items_bytes(value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return 1 + _items_bytes(value)
    if isinstance(value, torch.Tensor | np.ndarray):
        return array_bytes(value)
    if isinstance(value, str | bytes | bytearray):  # (a subclass)
        return len(value) + 1
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, TensorBatch):
        return sum(value_bytes(col) for _, col in value.items()) + value_bytes(value.meta)
    values = _field_values(value)
    return NUMBER_BYTES if values is None else 1 + _items_bytes(values)


def _items_bytes(items: Collection[Any]) -> int:
    if len(items) > 16:  # long lists of numbers or of strings: counted at C speed
        kinds = set(map(type, items))
        if kinds <= _NUMBERS:
            return NUMBER_BYTES * len(items)
        if len(kinds) == 1 and kinds <= {str, bytes}:
            return len(items) + sum(map(len, items))
    size = 0
    for item in items:  # (the common leaves here: a call each would double the time)
        kind = type(item)
        if kind in _NUMBERS:
            size += NUMBER_BYTES
        elif kind is str or kind is bytes:
            size += len(item) + 1
        else:
            size += value_bytes(item)
    return size


def pulled_bytes(value: Any) -> int:
    """The bytes a pull of a whole stored value waits for, and its store counts: its arrays'
    (`array_bytes`), and the rest of it (`value_bytes`) once that is LARGE_BYTES or more:
    then a pull of a large text or bytes is given time for them too."""
    arrays, everything = array_bytes(value), value_bytes(value)
    return everything if everything - arrays >= LARGE_BYTES else arrays


def encodes_past(value: Any, limit: int) -> bool:
    """Whether `value` surely encodes to more than `limit` bytes, counted without encoding
    it (an item takes a byte at least, a string its length, an array its bytes): a result of
    millions of numbers held a rank's GIL for seconds to be measured, then dropped."""
    size, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str | bytes | bytearray):
            size += len(v)
        elif isinstance(v, torch.Tensor | np.ndarray):
            size += array_bytes(v)
        elif isinstance(v, list | tuple | dict | TensorBatch):
            if size + len(v) > limit:  # (before a long list's items are looked at)
                return True
            size += 1
            todo.extend([*v.keys(), *v.values()] if isinstance(v, dict) else
                        [*(col for _, col in v.items()), v.meta] if isinstance(v, TensorBatch)
                        else v)
        else:
            values = _field_values(v)
            if values is not None:
                todo.extend(values)
            size += 1
        if size > limit:
            return True
    return False
