"""The frames between a rank and a function's process (`asyncrl.hybrid.fn_pool`): each a
length-prefixed msgpack value; nothing is pickled."""

from __future__ import annotations

import struct
from typing import IO, Any

import msgspec

LENGTH = struct.Struct("<I")


def _plain(obj: Any) -> Any:
    """numpy and torch scalars (a reward computed with numpy, meta from a DataFrame) as the
    Python numbers they hold; their arrays (a record's numeric column) as lists."""
    ndim = getattr(obj, "ndim", None)
    if ndim == 0 and hasattr(obj, "item"):
        return obj.item()
    if isinstance(ndim, int) and ndim > 0 and callable(getattr(obj, "tolist", None)):
        return obj.tolist()  # (what msgpack lacks in it, a complex number: refused below)
    raise TypeError(f"a {type(obj).__name__} cannot be sent to or from a function's process; "
                    f"use numbers, strings, lists and dicts")


_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)


def frame(value: Any) -> bytes:
    data = _encoder.encode(value)
    return LENGTH.pack(len(data)) + data


def write_frame(out: IO[bytes], value: Any) -> None:
    out.write(frame(value))
    out.flush()


def read_frame(src: IO[bytes]) -> Any:
    """The next frame's value; None once the other side has closed."""
    head = src.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    size = LENGTH.unpack(head)[0]
    data = src.read(size)
    return None if len(data) < size else msgspec.msgpack.decode(data)
