"""How many bytes a value holds, counted without encoding it: its tensors' and arrays' bytes
(`array_bytes`), or whether it surely encodes past a limit (`encodes_past`). Both look inside
lists, tuples, dicts, TensorBatch, msgspec Structs and dataclasses, as the codec sends them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.comm.batch import TensorBatch

LEAVES = frozenset({int, float, str, bytes, bool, type(None)})


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


def _field_values(value: Any) -> Iterable[Any] | None:
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
