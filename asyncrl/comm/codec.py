"""Values on the wire: msgspec msgpack plus a few extension types. Never pickle.

    tensor / ndarray -> Ext(header + raw bytes)      TensorBatch -> Ext([columns, meta])
    class / function -> Ext([module, qualname, file])  (imported again on the other side)
    RemoteBatch / RemoteValue -> Ext(where the data is)  (the receiving rank pulls it)

`encode_oob` leaves the bytes of large tensors and arrays out of the message: they travel
as frames of their own, sent and received without a copy (a driver's large result, a
call's large arguments).

Everything else must be msgspec-encodable (None, bool, int, float, str, bytes, lists,
dicts, msgspec Structs, dataclasses, enums...), and arrives as plain values (no types are
sent): a tuple as a list, a dataclass or Struct as a dict of its fields (an omit_defaults
Struct's fields at their defaults left out, a tagged one's tag as a field), an array_like
Struct as a list, an enum as its value. msgspec.convert(value, TheType) gives the type back.

Decoding bytes from the wire raises on malformed input: mostly ValueError (msgspec's
DecodeError is one), but a hostile message can also raise struct.error, TypeError,
OverflowError, RuntimeError or RecursionError: callers catch Exception (each socket loop
does), not ValueError alone.
"""

from __future__ import annotations

import math
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.comm.batch import TensorBatch, concat_meta, sliced_meta
from asyncrl.comm.dtypes import torch_dtype
from asyncrl.comm.messages import Column
from asyncrl.comm.refs import is_referable, make_ref, resolve_ref
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue, Shard
from asyncrl.comm.sizes import LEAVES as _LEAVES
from asyncrl.comm.sizes import array_bytes as array_bytes  # (codec's names)
from asyncrl.comm.sizes import encodes_past as encodes_past

_REMOTE_BATCH = tuple[list[Piece], list[Column], dict[str, Any]]
# bytes of tensors decoded from workers' results and encoded again (see `count_produced`)
produced_bytes_encoded = 0
_produced: dict[int, int] = {}  # storage address -> how many marked tensors use it

EXT_TENSOR, EXT_NDARRAY, EXT_BATCH, EXT_REF, EXT_REMOTE_BATCH, EXT_REMOTE_VALUE = 1, 2, 3, 4, 5, 6
EXT_OUT_OF_BAND = 7  # [kind, dtype, shape, index]: the bytes are buffer `index`, sent apart
OOB_MIN_BYTES = 64 << 10  # smaller arrays stay in the message: a frame costs more than a copy
_KIND_TENSOR, _KIND_NDARRAY = 0, 1
_oob = threading.local()  # .out: buffers left out while encoding; .frames, .used: decoding
_HLEN = struct.Struct(">I")
# A dtype's wire name and how its bytes cross numpy (far cheaper than torch's byte views):
# the numpy dtype that carries them and its torch dtype, which a tensor is viewed as where it
# differs (bfloat16 is carried as uint16); (None, None) where no numpy dtype fits.
_Carried = tuple[str, np.dtype | None, torch.dtype | None]
_DTYPE_INFO: dict[torch.dtype, _Carried] = {}
_DTYPES: dict[str, tuple[torch.dtype, np.dtype | None, torch.dtype | None]] = {}  # by wire name
_TENSOR_HEADS: dict[tuple[torch.dtype, torch.Size], tuple[bytes, torch.dtype | None]] = {}
# bytes alone do not make a quantized tensor (torch.frombuffer gives one that crashes on use)
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_WIDEST = {"f": 8, "c": 16}  # itemsizes: a wider float is a long double (bytes by machine)
_REFUSED = (TypeError, ValueError, OverflowError, RecursionError)  # (a value holding itself)


def _dtype_info(dtype: torch.dtype) -> _Carried:
    info = _DTYPE_INFO.get(dtype)
    if info is None:
        name = str(dtype)[6:]  # "torch.float32" -> "float32"
        info = (name, None, None)
        for carrier in (name, f"u{dtype.itemsize}"):  # its numpy twin, or the uint of its size
            try:
                np_dtype = np.dtype(carrier)
                as_torch = torch.from_numpy(np.empty(0, np_dtype)).dtype
            except TypeError:
                continue
            if as_torch.itemsize == dtype.itemsize:
                info = (name, np_dtype, as_torch)
                break
        _DTYPE_INFO[dtype] = info
    return info


def _wire_dtype(name: Any) -> tuple[torch.dtype, np.dtype | None, torch.dtype | None]:
    """The dtype named on the wire and its carriers (checked once per name: an unknown
    name gets ValueError)."""
    got = _DTYPES.get(name) if isinstance(name, str) else None
    if got is None:
        dtype = torch_dtype(name)  # (never getattr(torch, name): see comm/dtypes.py)
        if dtype in _QUANTIZED:
            raise ValueError(f"tensor dtype {name!r} refused: a quantized tensor is more than "
                             f"its bytes (asyncrl's encoder never sends one)")
        got = _DTYPES[name] = (dtype, *_dtype_info(dtype)[1:])
    return got


def _pack_buffer(header: Any, raw: np.ndarray) -> bytes:
    """header length + msgpack header + raw bytes (a C-contiguous array), with one copy of
    the raw bytes."""
    return b"".join((_head(header), raw.data))


def _head(header: Any) -> bytes:
    head = msgspec.msgpack.encode(header)
    return _HLEN.pack(len(head)) + head


def _tensor_head(t: torch.Tensor) -> tuple[bytes, torch.dtype | None]:
    """The header of t's dtype and shape, and the torch dtype that carries its bytes; cached,
    as a DP call sends one chunk of the same shape per rank."""
    key = (t.dtype, t.shape)
    got = _TENSOR_HEADS.get(key)
    if got is None:
        if len(_TENSOR_HEADS) >= 1024:  # shapes vary (e.g. sequence lengths): stay small
            _TENSOR_HEADS.clear()
        name, _, as_torch = _dtype_info(t.dtype)
        got = _TENSOR_HEADS[key] = (_head([name, list(t.shape)]), as_torch)
    return got


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
            if type(item) not in _LEAVES:  # long lists of numbers or strings: skip fast
                count_produced(item)
    elif isinstance(value, dict):
        for item in value.values():
            if type(item) not in _LEAVES:
                count_produced(item)
    return value


def _forget_produced(key: int) -> None:
    left = _produced.pop(key, 1) - 1
    if left:
        _produced[key] = left


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device: a view when it is contiguous.
    (Contiguous is not stride 1: a dimension of size 1 may have any stride, and torch keeps
    it through contiguous() and reshape(), where view(uint8) refuses it: one row of a column
    sliced out of a matrix, x[:, 0][1:2].)"""
    t = t.contiguous()
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def check_sendable(t: torch.Tensor) -> None:
    """TypeError, saying what to send instead, unless `t`'s raw bytes are all of it: what
    the codec and the data plane move (a store keeps a large batch column as it is)."""
    if t.is_nested:  # (before the type: a jagged one is a subclass)
        raise TypeError("a nested tensor cannot be sent; send its tensors as a list "
                        "(t.unbind()), or t.to_padded_tensor(0) and their lengths")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # a DTensor: shards
        raise TypeError(f"a {type(t).__name__} cannot be sent; send a plain tensor "
                        f"(a DTensor's .full_tensor(), or its .to_local() shard)")
    if t.layout != torch.strided:  # sparse, mkldnn...: not one buffer of raw bytes
        raise TypeError(f"a {t.layout} tensor cannot be sent; densify it first with "
                        f".to_dense()")
    if t.is_quantized:
        raise TypeError(f"a {t.dtype} tensor cannot be sent (its scale and zero point would "
                        f"be lost); send t.dequantize(), or t.int_repr() and its qparams")
    if t.is_meta:
        raise TypeError("a meta tensor cannot be sent (it has no values); send a real one")


def _enc_hook(obj: Any) -> Any:
    global produced_bytes_encoded
    if isinstance(obj, torch.Tensor):
        check_sendable(obj)
        numel = obj.numel()
        if _produced and numel and obj.untyped_storage().data_ptr() in _produced:
            produced_bytes_encoded += numel * obj.element_size()
        t = obj.detach() if obj.requires_grad else obj  # each step only where it is needed:
        if not t.is_cpu:  # a DP call encodes one small chunk per rank
            t = t.cpu()
        if t.is_conj() or t.is_neg():  # lazy bits numpy() refuses: apply them
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        head, as_torch = _tensor_head(t)
        if as_torch is not None:
            raw = (t if as_torch == t.dtype else t.view(as_torch)).numpy()
        else:  # no numpy dtype carries it: send its bytes
            raw = byte_view(t).numpy()
        if _left_out(raw):
            return _out_of_band(_KIND_TENSOR, _dtype_info(t.dtype)[0], t.shape, raw)
        return msgspec.msgpack.Ext(EXT_TENSOR, b"".join((head, raw.data)))
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):  # its mask would be dropped
            raise TypeError("a numpy masked array cannot be sent (its mask would be lost); "
                            "send .filled(...) and the mask as two arrays")
        if obj.dtype.hasobject:
            raise TypeError("a numpy array of Python objects cannot be sent; use a list")
        if obj.dtype.names is not None:
            raise TypeError(f"a numpy array of structured dtype {obj.dtype} cannot be sent (its "
                            f"field names would be lost); send one array per field")
        if obj.dtype.kind == "V" and obj.dtype.type is not np.void:  # (ml_dtypes' bfloat16)
            raise TypeError(f"a numpy array of {obj.dtype} cannot be sent (it would arrive as "
                            f"raw {obj.dtype.str} bytes, its type lost); send a torch tensor "
                            f"(torch.bfloat16, float8...) or .view(np.uint{obj.itemsize * 8})")
        if obj.dtype.kind in "Mm":  # no buffer to hand over (a large one failed mid-send)
            raise TypeError(f"a numpy array of {obj.dtype} cannot be sent; send "
                            f".astype('int64') (counts of its unit) and view it back")
        if obj.dtype.itemsize > _WIDEST.get(obj.dtype.kind, obj.dtype.itemsize):
            raise TypeError(f"a numpy array of {obj.dtype} cannot be sent (a long double's "
                            f"bytes differ by machine); send .astype(np.float64)")
        # not np.ascontiguousarray: it makes a 0-d array 1-d
        a = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        if _left_out(a):
            return _out_of_band(_KIND_NDARRAY, a.dtype.str, obj.shape, a)
        return msgspec.msgpack.Ext(EXT_NDARRAY, _pack_buffer([a.dtype.str, list(obj.shape)], a))
    if isinstance(obj, np.generic):
        if obj.dtype.kind in "mM":  # (its item is an int, a str or a date by unit)
            raise TypeError(f"a numpy {obj.dtype} scalar cannot be sent; send "
                            f".astype('int64') (counts of its unit) and view it back")
        value = obj.item()
        if isinstance(value, np.generic):  # (np.longdouble's item is itself: no Python type)
            raise TypeError(f"a numpy {obj.dtype} scalar cannot be sent; convert it first "
                            f"(float(x))")
        return value
    if isinstance(obj, TensorBatch):
        # its columns dict as is (not a copy): the codec is the batch's wire format
        return msgspec.msgpack.Ext(EXT_BATCH, _encoder.encode([obj._data, obj.meta]))
    if is_referable(obj):
        return msgspec.msgpack.Ext(EXT_REF, msgspec.msgpack.encode(list(make_ref(obj))))
    if isinstance(obj, RemoteBatch):
        return msgspec.msgpack.Ext(EXT_REMOTE_BATCH, _encoder.encode(
            [obj.pieces, obj.columns, obj.meta]))
    if isinstance(obj, RemoteValue):
        return msgspec.msgpack.Ext(EXT_REMOTE_VALUE, _encoder.encode([obj.shard, obj.nbytes]))
    raise TypeError(
        f"an object of type {type(obj).__module__}.{type(obj).__qualname__} cannot be sent: "
        f"asyncrl sends msgspec-encodable values, tensors, ndarrays, TensorBatch, DistFutures "
        f"and module-level classes/functions, and never pickles")


def _left_out(raw: np.ndarray) -> bool:
    return raw.nbytes >= OOB_MIN_BYTES and getattr(_oob, "out", None) is not None


def _out_of_band(kind: int, dtype: str, shape: Sequence[int], raw: np.ndarray
                 ) -> msgspec.msgpack.Ext:
    out = _oob.out
    out.append(raw)
    return msgspec.msgpack.Ext(EXT_OUT_OF_BAND, msgspec.msgpack.encode(
        [kind, dtype, list(shape), len(out) - 1]))


def _from_frame(data: memoryview) -> Any:
    """The tensor or array of an EXT_OUT_OF_BAND: a view of its received frame, no copy."""
    frames = getattr(_oob, "frames", None)
    spec = msgspec.msgpack.decode(data)
    if type(spec) is not list or len(spec) != 4 or type(spec[3]) is not int:
        raise ValueError(f"bad out-of-band array {spec!r} on the wire")
    kind, dtype, shape, index = spec
    if frames is None or not 0 <= index < len(frames):
        raise ValueError(f"out-of-band array {index} on the wire, but "
                         f"{0 if frames is None else len(frames)} buffers came with it")
    if index in _oob.used:  # an encoder names each once; a frame named again could be
        raise ValueError(f"out-of-band array {index} named twice")  # copied many times
    _oob.used.add(index)
    frame = memoryview(frames[index]).cast("B")
    if kind == _KIND_NDARRAY:
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are refused")
        _check_shape(shape, dt.itemsize, frame.nbytes)
        return np.frombuffer(_aligned(frame, dt.alignment), dtype=dt).reshape(shape)
    return _tensor_view(dtype, shape, frame)


def _aligned(frame: memoryview, alignment: int) -> Any:
    """The frame, or a copy where its address does not suit the dtype (libzmq's large
    messages start 8 bytes past a 16-byte boundary: complex128 wants 16)."""
    if frame.nbytes and np.frombuffer(frame, np.uint8).ctypes.data % alignment:
        return bytearray(frame)
    return frame


def _tensor_view(name: Any, shape: list[int], frame: memoryview) -> torch.Tensor:
    dt, carrier, as_torch = _wire_dtype(name)
    _check_shape(shape, dt.itemsize, frame.nbytes)
    if frame.nbytes == 0:
        return torch.empty(shape, dtype=dt)
    return _tensor_on(_aligned(frame, min(dt.itemsize, 16)), shape, dt, carrier, as_torch)


def _tensor(name: Any, shape: list[int], raw: Any) -> torch.Tensor:
    """A tensor of dtype `name` and `shape` owning a copy of `raw` (the receive buffer may
    be reused)."""
    dt, carrier, as_torch = _wire_dtype(name)
    _check_shape(shape, dt.itemsize, len(raw))
    if len(raw) == 0:
        return torch.empty(shape, dtype=dt)
    return _tensor_on(bytearray(raw), shape, dt, carrier, as_torch)


def _tensor_on(buf: Any, shape: list[int], dt: torch.dtype, carrier: np.dtype | None,
               as_torch: torch.dtype | None) -> torch.Tensor:
    """A tensor using the (non-empty, checked) writable buffer `buf` as its memory."""
    if carrier is None or len(shape) == 1:  # torch.frombuffer: the cheapest in 1-d
        t = torch.frombuffer(buf, dtype=dt)
        return t if len(shape) == 1 and shape[0] == t.shape[0] else t.reshape(shape)
    t = torch.from_numpy(np.frombuffer(buf, carrier).reshape(shape))  # reshapes cheaper
    return t if as_torch == dt else t.view(dt)


def _check_shape(shape: Any, itemsize: int, nbytes: int) -> None:
    """ValueError unless `shape` is a list of ints >= 0 whose elements fill exactly `nbytes`
    bytes: a small hostile message must not make the receiver allocate what it never sent."""
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"bad array shape {shape!r} on the wire: it must be a list of ints >= 0")
    need = math.prod(shape) * itemsize
    if need != nbytes:
        raise ValueError(f"an array of shape {shape} needs {need} bytes but the message "
                         f"carries {nbytes}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_TENSOR:
        (name, shape), raw = _unpack_buffer(data)
        return _tensor(name, shape, raw)
    if code == EXT_NDARRAY:
        (dtype, shape), raw = _unpack_buffer(data)
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are refused")
        _check_shape(shape, dt.itemsize, len(raw))
        return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
    if code == EXT_BATCH:
        columns, meta = _decoder.decode(data)
        return TensorBatch(columns, meta)
    if code == EXT_REF:  # (a file run for the controller's commands only: refs.py)
        module, qualname, file = msgspec.msgpack.decode(data)
        return resolve_ref(module, qualname, file, load=getattr(_oob, "commands", False))
    if code == EXT_REMOTE_BATCH:
        pieces, columns, meta = _remote_batch_decoder.decode(data)
        return RemoteBatch(pieces, columns, meta)
    if code == EXT_REMOTE_VALUE:
        return RemoteValue(*msgspec.msgpack.decode(data, type=tuple[Shard, int]))
    if code == EXT_OUT_OF_BAND:
        return _from_frame(data)
    raise ValueError(f"unknown extension type {code}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
_remote_batch_decoder = msgspec.msgpack.Decoder(_REMOTE_BATCH, ext_hook=_ext_hook)


def encode(value: Any) -> bytes:
    """Encode a value; TypeError (saying what cannot be sent) if it is not sendable."""
    return _encoder.encode(value)


def decode(buf: Any) -> Any:
    return _decoder.decode(buf)


def encode_oob(value: Any) -> tuple[bytes, list[np.ndarray]]:
    """Encode a value, leaving out the bytes of its tensors and arrays of OOB_MIN_BYTES or
    more: they come back as a list of arrays (views, not copies) to send as frames of their
    own, in order. The message then holds a few bytes per array, not its bytes."""
    return _leaving_out(lambda: _encoder.encode(value))


def _leaving_out(encode: Callable[[], bytes]) -> tuple[bytes, list[np.ndarray]]:
    """What `encode()` gives with large arrays left out, and the arrays left out."""
    out: list[np.ndarray] = []
    _oob.out = out
    try:
        return encode(), out
    finally:
        _oob.out = None


def decode_oob(buf: Any, frames: Sequence[Any]) -> Any:
    """Decode what `encode_oob` gave, with its arrays received as `frames` (writable
    buffers): their tensors and arrays are views of the frames, not copies."""
    _oob.frames, _oob.used = frames, set()
    try:
        return _decoder.decode(buf)
    finally:
        _oob.frames = None


def _shallow_ext(code: int, data: memoryview) -> tuple[int, bytes]:
    return code, bytes(data)  # left encoded (a msgpack array never decodes to a tuple)


_shallow = msgspec.msgpack.Decoder(ext_hook=_shallow_ext)
_HEADS: dict[bytes, tuple[Any, Any]] = {}  # a tensor's encoded header -> (dtype, shape)


def _has_ext(value: Any) -> bool:
    """Whether a value decoded by `_shallow` holds an extension value anywhere (a tuple)."""
    todo = [value]
    while todo:
        v = todo.pop()
        kind = type(v)
        if kind is tuple:
            return True
        if kind is list:
            todo.extend(x for x in v if type(x) not in _LEAVES)  # skip numbers, str fast
        elif kind is dict:
            todo.extend(v)
            todo.extend(v.values())
    return False


def _parsed_head(data: bytes) -> tuple[Any, Any, int]:
    """dtype name, shape and where the bytes start, of an encoded tensor (headers cached:
    a DP call's parts share theirs)."""
    (hlen,) = _HLEN.unpack_from(data)
    start = _HLEN.size + hlen
    head = data[:start]
    got = _HEADS.get(head)
    if got is None:
        if len(_HEADS) >= 1024:
            _HEADS.clear()
        got = _HEADS[head] = tuple(msgspec.msgpack.decode(head[_HLEN.size:]))
    return got[0], got[1], start


def decode_concat(parts: Sequence[Any], keep: Callable[[int, int], int | None]
                  ) -> TensorBatch | None:
    """What decoding the encoded TensorBatches `parts`, cutting part i to its first
    ``keep(i, rows of part i)`` rows (``.slice(0, k)``; None: kept whole, as it is) and
    `TensorBatch.concat`-ing them gives, with one tensor made per column rather than one per
    part (a DP call's results, one part per rank). None when a part is not a TensorBatch or
    the parts' columns differ (names, order, kinds, dtypes, row shapes) or their meta or list
    columns hold extension values (e.g. tensors): decode them one by one then."""
    first: list[Any] | None = None  # per column: its key, or (key, dtype, *row shape)
    pieces: list[list[Any]] = []
    metas: list[tuple[dict[str, Any], int]] = []
    for i, part in enumerate(parts):
        top = _shallow.decode(part)
        if type(top) is not tuple or top[0] != EXT_BATCH:
            return None
        columns, meta = _shallow.decode(top[1])
        if type(meta) is not dict or _has_ext(meta) or not all(  # (tensors in it, keys not
                type(k) is str for k in (*meta, *columns)):  # str: decode() makes, refuses)
            return None
        kinds: list[Any] = []
        cut: list[Any] = []  # per column: a list's items, or (encoded tensor, start, row bytes)
        rows = -1
        for key, col in columns.items():
            if type(col) is list:
                if _has_ext(col):  # e.g. a tensor per row
                    return None
                kinds.append(key)
                cut.append(col)
                n = len(col)
            elif type(col) is tuple and col[0] == EXT_TENSOR:
                name, shape, start = _parsed_head(col[1])
                if type(shape) is not list or not shape:
                    return None
                _check_shape(shape, _wire_dtype(name)[0].itemsize, len(col[1]) - start)
                n = shape[0]
                kinds.append((key, name, *shape[1:]))
                cut.append((col[1], start, (len(col[1]) - start) // n if n else 0))
            else:
                return None
            if rows < 0:
                rows = n
            elif n != rows:
                return None
        if first is None:
            first = kinds
        elif kinds != first:
            return None
        rows = max(rows, 0)
        k = keep(i, rows)
        if k is None:
            k = rows
        else:
            meta = sliced_meta(meta, rows, 0, k)
        pieces.append([c[:k] if type(c) is list else c[0][c[1]:c[1] + k * c[2]] for c in cut])
        metas.append((meta, k))
    if first is None:
        return None
    total = sum(k for _, k in metas)
    data: dict[str, Any] = {}
    for j, kind in enumerate(first):
        if type(kind) is str:
            data[kind] = [x for p in pieces for x in p[j]]
        else:
            key, name, *row_shape = kind
            data[key] = _tensor(name, [total, *row_shape], b"".join(p[j] for p in pieces))
    return TensorBatch._of(data, total, concat_meta(metas))


def encode_call(args: tuple, kwargs: dict[str, Any], names: list[str]) -> bytes:
    """Encode call arguments as [args, kwargs]; ArgEncodeError names an argument that cannot
    be sent. `names[i]` names positional argument i (its parameter name when known)."""
    global produced_bytes_encoded
    counted = produced_bytes_encoded
    try:
        return _encoder.encode([args, kwargs])
    except _REFUSED:
        # one by one to name the failing argument (the ones before it are counted again)
        produced_bytes_encoded = counted
        named = [(names[i] if i < len(names) else f"#{i}", a) for i, a in enumerate(args)]
        for name, value in [*named, *kwargs.items()]:
            try:
                _encoder.encode(value)
            except _REFUSED as e:
                raise ArgEncodeError(name, e) from e
        raise


def encode_call_oob(args: tuple, kwargs: dict[str, Any], names: list[str]
                    ) -> tuple[bytes, list[np.ndarray]]:
    """`encode_call`, leaving out the bytes of arrays of OOB_MIN_BYTES or more as
    `encode_oob` does: they come back as the frames to send after the message, views of
    the arguments (see `own_unless_large`)."""
    return _leaving_out(lambda: encode_call(args, kwargs, names))


IN_PLACE_MIN = 32 << 20


def own_unless_large(frame_lists: Sequence[list[np.ndarray]]) -> None:
    """Replace the frames of one call's messages by copies (its caller may change its
    tensors once the call is made), unless they hold IN_PLACE_MIN bytes or more in all:
    those are sent from the arguments' own memory, as copying gigabytes would hold the
    controller's loop for seconds."""
    if sum(a.nbytes for frames in frame_lists for a in frames) < IN_PLACE_MIN:
        for frames in frame_lists:
            frames[:] = [a.copy() for a in frames]


class ArgEncodeError(Exception):
    """Which argument failed to encode; callers re-raise it with the call's context."""

    def __init__(self, name: str, cause: Exception):
        super().__init__(name, cause)
        self.name, self.cause = name, cause


def decode_call(buf: Any, frames: Sequence[Any] = ()) -> tuple[list, dict[str, Any]]:
    """[args, kwargs] from `encode_call` or `encode_call_oob` (with the frames it gave,
    received as writable buffers: its arrays are views of them). A command's: the classes
    and functions it names may have their files run (those the flow file defined)."""
    _oob.commands = True
    try:
        args, kwargs = decode_oob(buf, frames)
    finally:
        _oob.commands = False
    return args, kwargs
