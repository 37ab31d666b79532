"""Values on the wire: msgspec msgpack plus a few extension types. Never pickle.

    tensor / ndarray -> Ext(header + raw bytes)      TensorBatch -> Ext([columns, meta])
    class / function -> Ext([module, qualname, file])  (imported again on the other side)
    RemoteBatch / RemoteValue -> Ext(where the data is)  (the receiving rank pulls it)

Everything else must be msgspec-encodable (None, bool, int, float, str, bytes, lists,
dicts, msgspec Structs, dataclasses, enums...). Tuples arrive as lists.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.messages import Column
from asyncrl.comm.refs import is_referable, make_ref, resolve_ref
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue, Shard

_REMOTE_BATCH = tuple[list[Piece], list[Column], dict[str, Any]]
# bytes of tensors decoded from workers' results and encoded again (see `count_produced`)
produced_bytes_encoded = 0
_produced: dict[int, int] = {}  # storage address -> how many marked tensors use it

EXT_TENSOR, EXT_NDARRAY, EXT_BATCH, EXT_REF, EXT_REMOTE_BATCH, EXT_REMOTE_VALUE = 1, 2, 3, 4, 5, 6
_HLEN = struct.Struct(">I")
_NO_BYTES = np.empty(0, np.uint8)
_DTYPES: dict[str, torch.dtype] = {}  # names seen on the wire -> dtypes (checked once each)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)[6:]  # "torch.float32" -> "float32"
    return name


def _pack_buffer(header: Any, raw: np.ndarray) -> bytes:
    """header length + msgpack header + raw bytes (a C-contiguous array), with one copy of
    the raw bytes."""
    head = msgspec.msgpack.encode(header)
    return b"".join((_HLEN.pack(len(head)), head, raw.data))


def _unpack_buffer(data: memoryview) -> tuple[Any, memoryview]:
    (hlen,) = _HLEN.unpack_from(data)
    start = _HLEN.size + hlen
    return msgspec.msgpack.decode(data[_HLEN.size:start]), data[start:]


def count_produced(value: Any) -> Any:
    """Mark the tensors of a value decoded from a worker's result, so that sending them on
    is counted in `produced_bytes_encoded` (the controller's payload counter)."""
    if isinstance(value, torch.Tensor) and value.numel():
        key = value.untyped_storage().data_ptr()  # slices and views of it count too
        _produced[key] = _produced.get(key, 0) + 1
        weakref.finalize(value, _forget_produced, key)
    elif isinstance(value, TensorBatch):
        for _, col in value.items():
            count_produced(col)
    elif isinstance(value, (list, tuple)):
        for item in value:
            count_produced(item)
    elif isinstance(value, dict):
        for item in value.values():
            count_produced(item)
    return value


def _forget_produced(key: int) -> None:
    left = _produced.pop(key, 1) - 1
    if left:
        _produced[key] = left


def _enc_hook(obj: Any) -> Any:
    global produced_bytes_encoded
    if isinstance(obj, torch.Tensor):
        numel = obj.numel()
        if _produced and numel and obj.untyped_storage().data_ptr() in _produced:
            produced_bytes_encoded += numel * obj.element_size()
        t = obj.detach() if obj.requires_grad else obj  # each step only where it is needed:
        if not t.is_cpu:  # a DP call encodes one small chunk per rank
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if numel else _NO_BYTES
        return msgspec.msgpack.Ext(EXT_TENSOR, _pack_buffer([_dtype_name(t.dtype),
                                                             list(t.shape)], raw))
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("a numpy array of Python objects cannot be sent; use a list")
        a = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(EXT_NDARRAY, _pack_buffer([a.dtype.str, list(a.shape)], a))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, TensorBatch):
        return msgspec.msgpack.Ext(EXT_BATCH, msgspec.msgpack.encode(
            [dict(obj.items()), obj.meta], enc_hook=_enc_hook))
    if is_referable(obj):
        return msgspec.msgpack.Ext(EXT_REF, msgspec.msgpack.encode(list(make_ref(obj))))
    if isinstance(obj, RemoteBatch):
        return msgspec.msgpack.Ext(EXT_REMOTE_BATCH, msgspec.msgpack.encode(
            [obj.pieces, obj.columns, obj.meta], enc_hook=_enc_hook))
    if isinstance(obj, RemoteValue):
        return msgspec.msgpack.Ext(EXT_REMOTE_VALUE, msgspec.msgpack.encode(obj.shard))
    raise TypeError(
        f"an object of type {type(obj).__module__}.{type(obj).__qualname__} cannot be sent: "
        f"asyncrl sends msgspec-encodable values, tensors, ndarrays, TensorBatch, DistFutures "
        f"and module-level classes/functions, and never pickles")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_TENSOR:
        (dtype, shape), raw = _unpack_buffer(data)
        dt = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        if dt is None:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown tensor dtype {dtype!r}")
            _DTYPES[dtype] = dt
        if len(raw) == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
    if code == EXT_NDARRAY:
        (dtype, shape), raw = _unpack_buffer(data)
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are refused")
        return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
    if code == EXT_BATCH:
        columns, meta = msgspec.msgpack.decode(data, ext_hook=_ext_hook)
        return TensorBatch(columns, meta)
    if code == EXT_REF:
        module, qualname, file = msgspec.msgpack.decode(data)
        return resolve_ref(module, qualname, file)
    if code == EXT_REMOTE_BATCH:
        pieces, columns, meta = msgspec.msgpack.decode(data, type=_REMOTE_BATCH,
                                                       ext_hook=_ext_hook)
        return RemoteBatch(pieces, columns, meta)
    if code == EXT_REMOTE_VALUE:
        return RemoteValue(msgspec.msgpack.decode(data, type=Shard))
    raise ValueError(f"unknown extension type {code}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode(value: Any) -> bytes:
    """Encode a value; TypeError (saying what cannot be sent) if it is not sendable."""
    return _encoder.encode(value)


def decode(buf: Any) -> Any:
    return _decoder.decode(buf)


def encode_call(args: tuple, kwargs: dict[str, Any], names: list[str]) -> bytes:
    """Encode call arguments one by one so an error names the argument that failed.

    `names[i]` names positional argument i (its parameter name when known)."""
    parts = []
    for i, a in enumerate(args):
        parts.append(_raw(a, names[i] if i < len(names) else f"#{i}"))
    kw = {k: _raw(v, k) for k, v in kwargs.items()}
    return msgspec.msgpack.encode([parts, kw])


def _raw(value: Any, name: str) -> msgspec.Raw:
    try:
        return msgspec.Raw(_encoder.encode(value))
    except (TypeError, ValueError, OverflowError) as e:
        raise ArgEncodeError(name, e) from e


class ArgEncodeError(Exception):
    """Which argument failed to encode; callers re-raise it with the call's context."""

    def __init__(self, name: str, cause: Exception):
        super().__init__(name, cause)
        self.name, self.cause = name, cause


def decode_call(buf: Any) -> tuple[list, dict[str, Any]]:
    args, kwargs = _decoder.decode(buf)
    return args, kwargs
