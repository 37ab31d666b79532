"""Every message of the control plane, in one tagged union.

Payloads that hold user values (call arguments, results, constructor arguments) are
`msgspec.Raw`: they are encoded by `comm.codec` and embedded without a second copy.
"""

from __future__ import annotations

from typing import Union

import msgspec


class MethodSpec(msgspec.Struct, frozen=True):
    dispatch: str
    concurrent: bool = False


class Failure(msgspec.Struct, frozen=True):
    """An exception raised on a rank, as text: type name, message, formatted traceback."""

    type: str
    message: str
    traceback: str


class Hello(msgspec.Struct, tag=True, array_like=True):
    """rank -> controller, right after torch.distributed is initialised, once from each of
    the rank's sockets: "io" (heartbeats, concurrent calls, shutdown) and "exec" (in-order
    calls). A ROUTER can only reach a socket it has heard from."""

    group: str
    rank: int
    world_size: int
    local_rank: int
    pid: int
    host: str
    role: str


class Construct(msgspec.Struct, tag=True, array_like=True):
    """controller -> rank: build the worker. `payload`: codec call [[cls, *args], kwargs]."""

    payload: msgspec.Raw
    mesh: list[tuple[str, int]]


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """rank -> controller: the worker is built (or `error` says why not)."""

    rank: int
    methods: dict[str, MethodSpec] = {}
    coords: dict[str, int] = {}
    error: Union[Failure, None] = None


class Call(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """controller -> rank: run `method`. `payload` is codec-encoded [args, kwargs]."""

    call_id: int
    method: str
    payload: msgspec.Raw
    collect: bool = True


NONE = msgspec.Raw(b"\xc0")  # msgpack nil: the value of a call whose result is not collected


class Result(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """rank -> controller: a call finished. `value` is codec-encoded (None when not collected
    or when `error` is set)."""

    call_id: int
    rank: int
    value: msgspec.Raw = NONE
    error: Union[Failure, None] = None


class Heartbeat(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Both ways, every heartbeat interval. A rank reports how many frames it dropped."""

    dropped: int = 0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """controller -> rank: exit now."""


Message = Union[Hello, Construct, Ready, Call, Result, Heartbeat, Shutdown]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(buf) -> Message:
    """Typed decode; raises msgspec.DecodeError (or ValidationError) on anything else."""
    return _decoder.decode(buf)
