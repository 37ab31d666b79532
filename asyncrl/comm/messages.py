"""Every message on the wire, in one tagged union: control plane and data plane.

Payloads that hold user values (call arguments, results, constructor arguments) are
`msgspec.Raw`: they are encoded by `comm.codec` and embedded without a second copy.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class MethodSpec(msgspec.Struct, frozen=True):
    dispatch: str
    concurrent: bool = False


class Failure(msgspec.Struct, frozen=True):
    """An exception raised on a rank, as text: type name, message, formatted traceback."""

    type: str
    message: str
    traceback: str


SPAWN_ENV = "ASYNCRL_SPAWN"  # a rank's environment: the token of the spawn that started it


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
    data_addr: str = ""  # the rank's data-plane server, where consumers pull its objects
    gpu: str = ""  # the UUID of the rank's GPU ("" without one)
    launched: int = 0  # the pid torchrun started for it: its own, or its stand-in's
    # (asyncrl/actors/rank_fork.py)
    spawn: str = ""  # the spawn that started it (ASYNCRL_SPAWN): an earlier group's of the
    # same name, late, is told apart


class Construct(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """controller -> rank: build the worker. `payload`: codec call [[cls, *args], kwargs];
    `buffers` and `frames`: its large arrays' raw frames, as a Call's."""

    payload: msgspec.Raw
    mesh: list[tuple[str, int]]
    buffers: list[int] = []
    frames: list[Any] = []


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """rank -> controller: the worker is built (or `error` says why not)."""

    rank: int
    methods: dict[str, MethodSpec] = {}
    coords: dict[str, int] = {}
    error: Union[Failure, None] = None


class Call(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """controller -> rank: run `method`. `payload` is codec-encoded [args, kwargs]
    (`codec.encode_call`): the bytes of its large arrays follow the signed frames as raw
    frames of the sizes in `buffers`, in order; the rank's socket checks them and puts them
    in `frames` (sent empty). `dp_rows` (a DP call): [rows of the whole batches, the first of
    them in `payload`]; the rank takes its own chunk of each batch argument from the rows it
    was sent. `collect`: the ranks, of those sent this Call, whose result the controller
    collects (None: all of them); the others answer without a value and keep nothing."""

    call_id: int
    method: str
    payload: msgspec.Raw
    collect: Union[list[int], None] = None
    dp_rows: Union[tuple[int, int], None] = None
    buffers: list[int] = []
    frames: list[Any] = []


NONE = msgspec.Raw(b"\xc0")  # msgpack nil: the value of a call whose result is not collected


class Column(msgspec.Struct, array_like=True, frozen=True):
    """One column of a stored TensorBatch: dtype ("list" for a list column), row shape, and
    the kind of device its tensor lives on ("cpu" or "cuda"). `row_bytes`: a list column's
    bytes a row, on average, as its producer estimated them (`sizes.value_bytes`): its rows
    come inside a pull's reply, which is given time and cut into buckets by them (a tensor
    column's dtype and shape say its own)."""

    key: str
    dtype: str
    shape: tuple[int, ...] = ()
    device: str = "cpu"
    row_bytes: int = 0


class Schema(msgspec.Struct, array_like=True, frozen=True):
    """What a rank holds for a stored result. rows == -1: a value that is not a TensorBatch."""

    rows: int
    columns: tuple[Column, ...] = ()
    meta: msgspec.Raw = NONE
    nbytes: int = 0


class Result(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """rank -> controller: a call finished. `value` is codec-encoded when it is small (None
    when not collected, when `error` is set, or when only `schema` describes it); `schema` is
    set when the rank keeps the value in its object store under the call id."""

    call_id: int
    rank: int
    value: msgspec.Raw = NONE
    error: Union[Failure, None] = None
    schema: Union[Schema, None] = None
    inline: bool = True  # whether `value` is the value (False: fetch it from the store)
    busy: float = 0.0  # seconds the call ran on the rank, pulling its inputs included
    # with `error`: the NCCL links this rank aborted (key -> the uid it was made from)
    aborted_links: dict[str, bytes] = {}


class Results(msgspec.Struct, tag=True, array_like=True, gc=False):
    """a host's relay -> controller: one call's answers from the host's ranks, all of them
    successful, in columns: each rank's value and inline flag, and an index into `schemas`
    (the distinct schemas: a DP call's ranks mostly keep the same kind of part)."""

    call_id: int
    ranks: list[int]
    values: list[msgspec.Raw]
    inline: list[bool]
    schema_of: list[int]  # -1: the rank kept nothing (it returned None)
    schemas: list[Schema]
    busy: float  # the longest a rank spent on it


CONCURRENT_THREADS = 4  # a rank's pool for its concurrent calls, each thread with a socket


class Heartbeat(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Both ways, every heartbeat interval. A rank reports how many frames it dropped, what
    its object store holds, and how far its sockets (and the host relays it runs) have got
    both ways (the controller finds messages lost on their links with them: see
    controller/lost.py)."""

    dropped: int = 0
    objects: int = 0
    object_bytes: int = 0
    exec_heard: int = 0  # the sequence number of the last message the exec socket received
    exec_received: int = 0  # how many it received
    exec_idle_s: float = 0.0  # how long its thread has waited for one (0: it runs one)
    exec_sent: int = 0  # how many it sent
    stamp: float = 0.0  # controller -> rank: the controller's clock when it sent this one
    stamp_heard: float = 0.0  # rank -> controller: the last stamp it received
    io_heard: int = 0  # as exec_heard and exec_received, of its io socket
    io_received: int = 0
    relays: list[tuple[int, int, int]] = []  # the host relays it runs: HostRelay.counts
    # reached directly: its concurrent calls' threads' sockets (their roles, "c<thread>")
    # and how many each sent (behind relays their link is the io relay's)
    concurrent: list[tuple[str, int]] = []


class Log(msgspec.Struct, tag=True, array_like=True, gc=False):
    """rank -> controller: lines the rank printed (stdout and stderr), and how many it did
    not stream (over the rate limit)."""

    lines: list[str]
    dropped: int = 0


class Release(msgspec.Struct, tag=True, array_like=True, gc=False):
    """controller -> rank: nothing names these objects any more; free them."""

    obj_ids: list[int]


class Fetch(msgspec.Struct, tag=True, array_like=True):
    """controller -> rank: send me this stored object (a driver awaits it)."""

    obj_id: int


class Fetched(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """rank -> controller: the stored object (`codec.encode_oob`), or why not (`missing`:
    the rank does not hold it; else it could not be sent). The bytes of its large arrays
    follow the signed frames as raw frames of the sizes in `buffers`, in order; the
    controller's channel checks them and puts them in `frames` (sent empty)."""

    obj_id: int
    rank: int
    value: msgspec.Raw = NONE
    error: str = ""
    buffers: list[int] = []
    frames: list[Any] = []
    missing: bool = False


class ColumnDest(msgspec.Struct, array_like=True, frozen=True):
    """Where one tensor column goes in the puller's shared-memory segment."""

    key: str
    offset: int  # byte offset of the column's region in the segment
    row_bytes: int


class IpcRows(msgspec.Struct, array_like=True, frozen=True):
    """Rows of a GPU tensor shared by CUDA IPC: the allocation's handle and where the rows
    are in it (what torch.multiprocessing sends, without pickle)."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: Union[bytes, None]
    event_sync: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, within the storage
    gpu: str = ""  # the UUID of the GPU the rows are on (device is the producer's index)


class Pull(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """consumer rank -> producer rank's data server: rows [start, stop) of a stored object
    (start == stop == -1: the whole value). With `dest` set, the producer writes the tensor
    rows into that shared-memory segment at row `dest_row`; without, it replies with raw
    buffers over the socket: of `columns` only, when given (a row wider than a bucket is
    asked for a group of columns at a time)."""

    xfer_id: int
    obj_id: int
    start: int = -1
    stop: int = -1
    dest: str = ""
    dest_row: int = 0
    columns: list[ColumnDest] = []
    ipc: list[str] = []  # GPU columns to share by CUDA IPC instead (puller on this host)
    nccl: list[str] = []  # columns to send by NCCL, in this order, on communicator nccl_key
    nccl_key: str = ""
    no_lists: bool = False  # a row's later column group: its list columns came with the first
    nccl_uid: bytes = b""  # the making of link nccl_key it is for (its uid; b"": any): a
    # producer never sends it on a link set up again since (its consumer gave it up)


class Pulled(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """producer -> consumer: done. `lists`: the rows of list columns (codec-encoded); `value`:
    the whole value (`codec.encode_oob`: its large arrays follow as frames "0", "1"...); raw
    tensor buffers follow as extra frames when `dest` was empty."""

    xfer_id: int
    error: str = ""
    lists: msgspec.Raw = NONE
    value: msgspec.Raw = NONE
    buffers: list[str] = []  # keys of the raw frames that follow, in order
    ipc: dict[str, IpcRows] = {}


class PeersGone(msgspec.Struct, tag=True, array_like=True):
    """controller -> rank: group `group` died or was closed; its ranks' data servers `addrs`
    will never answer for the objects they held (ids below `below`): pulls of them fail at
    once instead of at the transfer timeout. A respawned group of that name holds only
    objects of later calls, whatever ports it binds."""

    group: str
    addrs: list[str]
    below: int
    reason: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """controller -> rank: exit now."""


class Fanout(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """controller -> a host's relay: deliver `frames[which[i]]` (an encoded message) to the
    rank socket `to[i]` behind it. One frame serves every socket that gets the same message.
    `call_id`: these are that call's Calls; the relay holds their Results until all of `to`
    answered (or one failed) and sends them up together. `buffers[j]`: how many of the raw
    frames that follow the signed ones go with message j (its Call's `buffers`), in order."""

    to: list[bytes]
    which: list[int]
    frames: list[msgspec.Raw]
    call_id: int = 0
    buffers: list[int] = []


class Fanin(msgspec.Struct, tag=True, array_like=True, gc=False):
    """a host's relay -> controller: messages of the rank sockets behind it, each as its
    socket sent it (the relay checked every signature)."""

    senders: list[bytes]
    frames: list[msgspec.Raw]


Message = Union[Hello, Construct, Ready, Call, Result, Heartbeat, Shutdown, Release, Fetch,
                Fetched, Pull, Pulled, Log, Fanout, Fanin, Results, PeersGone]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(buf) -> Message:
    """Typed decode; raises msgspec.DecodeError (or ValidationError) on anything else."""
    return _decoder.decode(buf)
