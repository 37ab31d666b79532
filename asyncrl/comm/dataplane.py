"""Worker-to-worker transfers: each rank serves its stored objects; consumers pull.

    consumer rank (DataClient)                      producer rank (DataServer thread)
    ──────────────────────────                      ─────────────────────────────────
    RemoteBatch of N rows ─▶ lease a segment from
    its own pool (same host) ── Pull(rows, dest) ─▶ copy the rows into dest (shm)
                             ◀─ Pulled ──────────── or send them as raw frames (TCP)
    tensors = zero-copy views of the segment; it returns to the pool when they are gone

Shared memory needs both ranks on one host; ZeroMQ TCP carries everything else. Every
request and reply is signed like the control plane; raw tensor frames that follow a signed
reply are bound to it by their count and sizes. A peer that does not answer within the
timeout raises TransferTimeout naming it and the operation; one whose group the controller
declared dead, InputLostError as soon as the rank hears of it (`comm.gone`). This module is
the consumer's side; the producer's is `comm.dataserver`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from asyncrl.comm import buckets, codec, cuda_ipc, dataserver, messages, nccl
from asyncrl.comm.auth import CurveKeys, Signer, Verifier, curve_client
from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.channel import LINK_MIN_RATE, open_frame
from asyncrl.comm.dtypes import torch_dtype
from asyncrl.comm.gone import GonePeers
from asyncrl.comm.messages import ColumnDest, Pull, Pulled
from asyncrl.comm.remote import Piece, RemoteBatch, RemoteValue
from asyncrl.comm.shm import SegmentPool, cleanup
from asyncrl.errors import InputLostError, TransferTimeout

log = logging.getLogger("asyncrl")
SHM_PREFIX = "asyncrl-"
_ALIGN = 64
WATCH_S = 0.1  # how often a pull waiting for answers looks for news of dead producers
MAX_LATE_SOCKETS = 64  # per client: sockets of timed-out IPC pulls still drained
BUCKET_BYTES = 32 << 20  # pulls are split into buckets of at most this many bytes, several in
# flight at once: the producer copies or sends one while the consumer takes in another
FRAMES_WINDOW = 4  # buckets asked of one producer at once when they come as frames: the rest
# waits, else every frame would sit in ZeroMQ's queue beside the batch it is copied into


def run_prefix(run_id: str) -> str:
    """The start of the name of every shared-memory segment of a run."""
    return f"{SHM_PREFIX}{run_id}-"


def own_pool_prefix() -> str:
    """This rank's pool_prefix, from its environment."""
    env = os.environ
    return pool_prefix(env.get("ASYNCRL_RUN_ID", str(os.getpid())), env.get(
        "ASYNCRL_GROUP", ""), int(env.get("RANK", "0")), os.getpid())


def unlink_own_segments() -> None:
    """This rank's shared memory unlinked by name: a way out by signal (no lock taken, and
    the mappings stay valid until the process ends)."""
    with contextlib.suppress(OSError):
        cleanup(f"{own_pool_prefix()}-")


def pool_prefix(run_id: str, group: str, rank: int, pid: int) -> str:
    """The names of one rank's segment pool: the pid, so that a respawned rank never meets
    the segments its dead predecessor left behind. '+' cannot be in a group name: no other
    group's names start with this group's and rank's ("a" rank 1 and group "a-1" would)."""
    return f"{run_prefix(run_id)}{group}+{rank}-{pid}"


def _release(rows: Any) -> None:
    """Rows sent by CUDA IPC that will not be copied: opened and closed all the same, or the
    producer keeps their block until it exits."""
    for info in rows:
        try:
            cuda_ipc.release(info)
        except Exception as e:  # noqa: BLE001 - the producer may be gone; nothing to free
            log.warning("asyncrl: could not release CUDA IPC rows on %s: %s", info.gpu, e)


def _encoded(req: Pull) -> bytes:
    """The pull as sent; ValueError if a data server would refuse it (it cuts off a peer
    that sends more than MAX_PULL_BYTES at once: the pull would time out unexplained)."""
    body = messages.encode(req)
    if len(body) + 64 > dataserver.MAX_PULL_BYTES:  # (+ the signer's sequence number)
        raise ValueError(
            f"a pull of object {req.obj_id} names {len(req.ipc) + len(req.nccl)} GPU columns "
            f"and {len(req.columns)} others in {len(body)} bytes, past the "
            f"{dataserver.MAX_PULL_BYTES} a data server takes (GPU columns are asked for in "
            f"one pull): send fewer, larger GPU columns, e.g. flat buckets as sync_pack does")
    return body


def _error_type(error: str) -> type[Exception]:
    """A producer's error reply is raised here as there where a caller may catch it
    (IpcUnavailable: pulled again through host memory; TransferTimeout), else RuntimeError."""
    return {k.__name__: k for k in (cuda_ipc.IpcUnavailable, TransferTimeout)}.get(
        error.partition(":")[0], RuntimeError)


@dataclass
class _Retired:
    """A socket whose CUDA IPC pulls timed out, kept only to release their late replies."""

    sock: zmq.Socket
    verifier: Verifier
    identity: bytes
    owed: set[int]  # the transfer ids still unanswered
    addr: str = ""  # the producer's data server


class DataClient:
    """Pulls remote pieces for one thread (each thread that runs calls owns one)."""

    def __init__(self, ctx: zmq.Context, secret: bytes, identity: str, host: str,
                 pool: SegmentPool | None, timeout: float, transport: str = "auto",
                 curve: CurveKeys | None = None,
                 own: tuple[str, Callable[[int], Any]] | None = None,
                 gone: GonePeers | None = None):
        self._ctx, self._secret, self._identity = ctx, secret, identity
        self._gone = gone if gone is not None else GonePeers()  # producers known dead
        # this rank's data server and store: its own rows are copied, not pulled
        self._own_addr = own[0] if own else ""
        self._lookup: Callable[[int], Any] | None = own[1] if own else None
        self._curve = curve
        self._host, self._pool, self._timeout = host, pool, timeout
        self._transport = transport
        self._group = identity.split("/")[0]
        self._socks: dict[str, tuple[zmq.Socket, Signer, Verifier, bytes]] = {}
        self._late: list[_Retired] = []  # sockets of timed-out CUDA IPC pulls, drained
        self._gone_seen = 0  # the dead groups whose sockets are closed already
        self._xfer = itertools.count(1)
        self._names = itertools.count()

    def materialize(self, value: Any) -> Any:
        """The value with every RemoteBatch / RemoteValue in it replaced by its data."""
        if isinstance(value, RemoteBatch):
            return self.fetch_batch(value)
        if isinstance(value, RemoteValue):
            return self.fetch_value(value)
        if isinstance(value, list):
            return [self.materialize(v) for v in value]
        if isinstance(value, dict):
            return {k: self.materialize(v) for k, v in value.items()}
        return value

    def _socket(self, addr: str) -> tuple[zmq.Socket, Signer, Verifier, bytes]:
        entry = self._socks.get(addr)
        if entry is None:
            sock = self._ctx.socket(zmq.DEALER)
            # never an identity still in use: a retired socket keeps its own connected
            identity = f"{self._identity}/pull{next(self._names)}".encode()
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # sending a pull never blocks: only replies are waited
            if self._curve is not None:
                curve_client(sock, self._curve.data_public)
            sock.connect(addr)
            entry = (sock, Signer(self._secret), Verifier(self._secret), identity)
            self._socks[addr] = entry
        return entry

    def _exchange(self, requests: list[tuple[Piece, Pull]],
                  take: Callable[[Pull, Pulled, list], None],
                  sent: Callable[[], None] | None = None, window: int = 0,
                  nbytes: Callable[[Pull], int] | None = None) -> None:
        """Send the requests (at most `window` unanswered per producer, when > 0), call
        `sent()`, then hand each reply to `take` as it arrives (so the copy of one bucket
        overlaps the transfer of the next), all within the timeout: of silence, plus the
        time the largest reply awaited takes at LINK_MIN_RATE (`nbytes`: a reply's bytes
        over the socket; a reply is heard of only once all of it came)."""
        self._close_gone()  # (first: a dead producer's late CUDA IPC rows cannot be opened)
        self._drain_late()
        self._check_alive(piece for piece, _ in requests)  # before anything is sent
        pending: dict[int, tuple[Piece, Pull]] = {}
        poller = zmq.Poller()
        queued: dict[str, deque[tuple[Piece, Pull]]] = {}  # per producer, in order
        for piece, req in requests:
            queued.setdefault(piece.shard.addr, deque()).append((piece, req))

        bodies = {req.xfer_id: _encoded(req) for _, req in requests}  # (before any is sent)

        def send_next(addr: str) -> None:
            piece, req = queued[addr].popleft()
            sock, signer, _, identity = self._socket(addr)
            sock.send_multipart(signer.sign(identity + b"@" + addr.encode(),
                                            bodies.pop(req.xfer_id)))
            pending[req.xfer_id] = (piece, req)
            poller.register(sock, zmq.POLLIN)
        try:
            for addr, todo in queued.items():
                for _ in range(min(len(todo), window) if window > 0 else len(todo)):
                    send_next(addr)
            if sent is not None:
                sent()
        except BaseException:  # (posting the NCCL receives failed): the pulls gone out are
            self._give_up(pending)  # given up, their late replies not left for the next
            raise

        def silence() -> float:  # how long the awaited replies may take
            most = max((nbytes(r) for _, r in pending.values()), default=0) if nbytes else 0
            return self._timeout + most / LINK_MIN_RATE
        deadline = time.monotonic() + silence()
        late = {id(r.sock): r for r in self._late}
        for r in self._late:  # late replies that come meanwhile are released too
            poller.register(r.sock, zmq.POLLIN)
        by_sock = {id(s): (s, v, i) for s, _, v, i in self._socks.values()}
        while pending:
            try:
                self._check_alive(p for p, _ in pending.values())
            except InputLostError:  # a producer died: no answer will ever come
                self._give_up(pending)
                raise
            left = deadline - time.monotonic()
            # in slices: news of a dead producer comes on another thread
            ready = dict(poller.poll(max(0, int(min(left, WATCH_S) * 1000)))) if left > 0 \
                else {}
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                piece, _ = next(iter(pending.values()))
                what = "whole value" if piece.start < 0 else f"rows {piece.start}:{piece.stop}"
                limit, unanswered = silence(), len(pending)  # (the timeout and the bytes')
                self._give_up(pending)
                raise TransferTimeout(
                    f"no answer from {piece.shard.peer} ({piece.shard.addr}) to a pull of "
                    f"{what} of object {piece.shard.obj_id} within {limit:.4g} s "
                    f"({unanswered} pull(s) unanswered)")
            for sock in ready:
                if id(sock) in late:
                    if self._drain(late[id(sock)]):  # owes nothing more
                        poller.unregister(sock)
                        self._close_retired(late.pop(id(sock)))
                    continue
                s, verifier, identity = by_sock[id(sock)]
                frames = s.recv_multipart(copy=False)
                reply = open_frame(verifier, b">" + identity, [f.bytes for f in frames[:2]])
                if isinstance(reply, Pulled) and reply.xfer_id in pending:
                    deadline = time.monotonic() + silence()  # the timeout is for silence
                    piece, req = pending.pop(reply.xfer_id)
                    try:
                        if reply.error:
                            raise _error_type(reply.error)(
                                f"pull from {piece.shard.peer} failed: {reply.error}")
                        if len(frames) - 2 != len(reply.buffers):
                            raise RuntimeError(f"pull from {piece.shard.peer}: "
                                               f"{len(frames) - 2} buffers for "
                                               f"{len(reply.buffers)} columns")
                    except (RuntimeError, TransferTimeout):
                        _release(reply.ipc.values())
                        self._give_up(pending)  # the others' replies: not for the next pull
                        raise
                    try:
                        take(req, reply, frames[2:])
                    except BaseException:
                        self._give_up(pending)
                        raise
                    if queued[piece.shard.addr]:  # the window moves on
                        send_next(piece.shard.addr)
                elif isinstance(reply, Pulled):  # for a pull given up when another failed
                    _release(reply.ipc.values())

    def fetch_value(self, ref: RemoteValue) -> Any:
        req = Pull(next(self._xfer), ref.shard.obj_id)
        got: list[Any] = []
        self._exchange([(Piece(ref.shard, -1, -1), req)],
                       lambda req, reply, frames: got.append(
                           codec.decode_oob(reply.value, [f.buffer for f in frames])),
                       nbytes=lambda req: ref.nbytes)  # (a large value: its bytes take time)
        return got[0]

    def fetch_batch(self, rb: RemoteBatch) -> TensorBatch:
        compact = rb.compacted()
        if compact is None:
            return self._fetch_rows(rb)
        held, order = compact  # each row pulled once (a pull per repeat would cost k times)
        data = self._fetch_rows(held).take(order).to_dict()
        if len(set(order)) < len(order):  # a repeated row's list items: each its own copy,
            for key, col in data.items():  # as each pull of it decoded its own
                if isinstance(col, list):
                    data[key] = codec.decode(codec.encode(col))
        return TensorBatch(data, rb.meta)

    def _fetch_rows(self, rb: RemoteBatch) -> TensorBatch:
        try:
            return self._pull_rows(rb)
        except RuntimeError as e:  # (rows a dead producer left: its death said as such)
            self._check_alive(rb.pieces)
            if not isinstance(e, cuda_ipc.IpcUnavailable):
                raise
            cuda_ipc.give_up(e)  # torch could not share the rows here (comm/cuda_ipc.py):
            return self._pull_rows(rb)  # this pull again, through host memory

    def _pull_rows(self, rb: RemoteBatch) -> TensorBatch:
        n = len(rb)
        tensor_cols = [c for c in rb.columns if c.dtype != "list"]
        all_cols = tensor_cols
        row_bytes = {c.key: buckets.row_bytes(c.dtype, c.shape) for c in tensor_cols}
        list_bytes = buckets.list_row_bytes(rb.columns)  # a row's, in a reply's message
        same_host = all(p.shard.host == self._host for p in rb.pieces)
        on_gpu = torch.cuda.is_available()
        # GPU columns go device to device by CUDA IPC when this rank sees every producer's
        # GPU (the same host, and the same GPUs: colocated groups); else by NCCL when the
        # controller set up a communicator with their group (another host, or other GPUs;
        # transport="nccl": every tensor column, for tests on CPUs); else through host
        # memory and back onto this rank's GPU, if it has one
        by_ipc = on_gpu and same_host and self._transport not in ("tcp", "nccl") and \
            cuda_ipc.usable() and all(p.shard.gpu in cuda_ipc.visible_gpus()
                                      for p in rb.pieces if p.shard.addr != self._own_addr)
        keys = {p.shard.group: f"{p.shard.group}->{self._group}" for p in rb.pieces
                if p.shard.addr != self._own_addr}
        linked = bool(keys) and all(nccl.has(k) for k in keys.values())
        # NCCL moves device memory only: with a GPU here, CPU columns never go by it; nor
        # do columns of no bytes (shape (n, 0)), whose storage CUDA IPC cannot export
        by_nccl = {c.key: torch.empty((n, *c.shape), dtype=torch_dtype(c.dtype),
                                      device="cuda" if c.device == "cuda" and on_gpu else "cpu")
                   for c in tensor_cols if linked and row_bytes[c.key] and (
                       (self._transport == "nccl" and (c.device == "cuda" or not on_gpu)) or
                       (c.device == "cuda" and on_gpu and not by_ipc))}
        ipc = {c.key: torch.empty((n, *c.shape), dtype=torch_dtype(c.dtype), device="cuda")
               for c in tensor_cols if c.device == "cuda" and by_ipc and row_bytes[c.key]
               and c.key not in by_nccl}
        tensor_cols = [c for c in tensor_cols if c.key not in ipc and c.key not in by_nccl]
        offsets, total = {}, 0
        for c in tensor_cols:
            offsets[c.key] = total
            total += -(-row_bytes[c.key] * n // _ALIGN) * _ALIGN
        # the destination is a segment of this rank's pool (warm memory, reused): producers
        # on this host write into it directly; over TCP their frames are copied into it
        lease = self._pool.acquire(total) if self._pool is not None and total else None
        heap = np.empty(total, np.uint8) if lease is None and total else None  # no pool
        direct = lease is not None and self._transport != "tcp" and same_host
        dests = {c.key: ColumnDest(c.key, offsets[c.key], row_bytes[c.key]) for c in tensor_cols}
        requests: list[tuple[Piece, Pull]] = []
        mine: list[tuple[Piece, Pull]] = []  # pieces of this rank's own store
        rows_at, row = {}, 0
        framed = bool(total) and not direct  # tensor columns come as frames over a socket
        for piece in buckets.rows_of(rb.pieces, sum(row_bytes.values()) + list_bytes,
                                     BUCKET_BYTES):
            own = piece.shard.addr == self._own_addr  # (copied here: never by NCCL, no key)
            # (into shared memory, grouped only so that each pull's column names fit a message)
            groups = buckets.column_groups({k: row_bytes[k] for k in offsets},
                                           piece.stop - piece.start, by_bytes=framed,
                                           limit=BUCKET_BYTES) if not own else [[]]
            for first, cols in zip(itertools.count(), groups):
                req = Pull(next(self._xfer), piece.shard.obj_id, piece.start, piece.stop)
                if direct and lease is not None:
                    req.dest, req.dest_row = lease.name, row
                    req.columns = [dests[k] for k in cols]
                elif len(groups) > 1:
                    req.columns = [dests[k] for k in cols]
                if first == 0:  # the rest of the row comes with its first group
                    req.ipc = list(ipc)
                    if by_nccl and not own:
                        req.nccl, req.nccl_key = list(by_nccl), keys[piece.shard.group]
                else:
                    req.no_lists = True
                (mine if own else requests).append((piece, req))
                rows_at[req.xfer_id] = row
            row += piece.stop - piece.start
        buf = heap if heap is not None else lease.buf if lease is not None and not direct \
            else None
        lists: dict[int, Any] = {}

        def framed_keys(req: Pull) -> list[str]:  # the columns its frames bring (not direct)
            return [c.key for c in req.columns] or list(offsets)

        def take(req: Pull, reply: Pulled, frames: list) -> None:
            start, count = rows_at[req.xfer_id], req.stop - req.start
            left = dict(reply.ipc)
            try:
                # a column left out would leave its rows as whatever the buffer held before
                lacking = [k for k in req.ipc if k not in reply.ipc] + (
                    [k for k in framed_keys(req) if k not in reply.buffers] if buf is not None
                    else [])
                if lacking:
                    raise RuntimeError(f"pull of object {req.obj_id}: the reply lacks "
                                       f"column(s) {lacking}")
                if len(reply.lists) > 1:  # more than a msgpack nil
                    lists[req.xfer_id] = codec.decode(reply.lists)
                for key, info in reply.ipc.items():
                    cuda_ipc.copy_rows_into(info, ipc[key][start:start + count])
                    del left[key]
            finally:
                _release(left.values())
            if buf is None:
                return
            for key, frame in zip(reply.buffers, frames, strict=True):
                size = count * row_bytes.get(key, -1)  # a frame must fill its rows exactly
                if frame.buffer.nbytes != size:  # (numpy would broadcast a short one)
                    raise RuntimeError(f"pull of object {req.obj_id}: column {key!r} came "
                                       f"with {frame.buffer.nbytes} bytes, {size} expected")
                at = offsets[key] + start * row_bytes[key]
                buf[at:at + size] = np.frombuffer(frame.buffer, np.uint8)

        for _, req in mine:  # this rank's own rows: a copy (CUDA cannot open its own handles)
            self._copy_own(req, rows_at[req.xfer_id], lists, ipc, by_nccl,
                           lease.buf if lease is not None else heap, offsets, row_bytes)
        links = {k: nccl.link(k) for k in sorted({r.nccl_key for _, r in requests if r.nccl})}
        for _, req in requests:  # bound to this making of its link (see Pull.nccl_uid)
            req.nccl_uid = links[req.nccl_key].uid if req.nccl else b""

        def post() -> None:  # the receives of every bucket, once its pull is on its way
            for key, end in links.items():
                nccl.receive(key, end, [
                    ((piece.shard.group, piece.shard.rank),
                     by_nccl[col][rows_at[req.xfer_id]:rows_at[req.xfer_id] + req.stop
                                  - req.start])
                    for piece, req in requests if req.nccl_key == key for col in req.nccl],
                    self._timeout)

        for end in links.values():  # one puller at a time per communicator: receives match
            end.lock.acquire()      # sends in order
        try:
            # frames and list columns over a socket come in a window of buckets (else all
            # of them would wait in ZeroMQ's queue; NCCL's receives are posted all at once)
            def reply_bytes(req: Pull) -> int:  # over the socket: frames and list columns
                frames = sum(row_bytes[k] for k in framed_keys(req)) if buf is not None else 0
                return (req.stop - req.start) * (frames + (0 if req.no_lists else list_bytes))
            self._exchange(requests, take, post if links else None,
                           window=FRAMES_WINDOW if (buf is not None or list_bytes) and not links
                           else 0, nbytes=reply_bytes)
            for key, end in links.items():
                nccl.finish(key, end, self._timeout)
        except BaseException:
            if lease is not None:  # a late producer may still write into it: never reuse
                lease.discard()
            for key, end in links.items():  # a receive may never complete: give the
                nccl.forget(key, end, "a pull on it failed")  # communicator up
            raise
        finally:
            for end in links.values():
                end.lock.release()
        data: dict[str, Any] = {}
        if lease is not None:
            del buf  # the arrays below take the lease over
            arrays = lease.arrays([(offsets[c.key], np.uint8, (row_bytes[c.key] * n,))
                                   for c in tensor_cols])
            for c, arr in zip(tensor_cols, arrays, strict=True):
                data[c.key] = torch.from_numpy(arr).view(torch_dtype(c.dtype)).reshape(
                    n, *c.shape)
        else:  # no pool (or no bytes): in process memory
            for c in tensor_cols:
                if heap is None:  # no bytes (no rows): np.empty(0)'s stride 0 cannot be viewed
                    data[c.key] = torch.empty((n, *c.shape), dtype=torch_dtype(c.dtype))
                    continue
                raw = heap[offsets[c.key]:offsets[c.key] + row_bytes[c.key] * n]
                data[c.key] = torch.from_numpy(raw).view(torch_dtype(c.dtype)).reshape(
                    n, *c.shape)
        data.update(ipc)
        data.update(by_nccl)
        for c in all_cols:
            if c.device == "cuda" and on_gpu and not data[c.key].is_cuda:
                data[c.key] = data[c.key].cuda()
        for c in rb.columns:
            if c.dtype == "list":
                data[c.key] = [x for xfer in sorted(lists) for x in lists[xfer][c.key]]
        return TensorBatch({c.key: data[c.key] for c in rb.columns}, rb.meta)

    def _copy_own(self, req: Pull, row: int, lists: dict[int, Any], ipc: dict[str, Any],
                  by_nccl: dict[str, Any], buf: np.ndarray | None, offsets: dict[str, int],
                  row_bytes: dict[str, int]) -> None:
        """Rows [req.start, req.stop) of an object in this rank's own store, copied to where
        a pull would have put them (row `row` of the batch being built)."""
        assert self._lookup is not None
        try:
            value = self._lookup(req.obj_id)
        except KeyError:
            raise LookupError(f"object {req.obj_id} is not held by this rank (released, or "
                              f"never stored: with no group dead, a bug in asyncrl, please "
                              f"report it)") from None
        start, stop, count = req.start, req.stop, req.stop - req.start
        if not isinstance(value, TensorBatch) or not 0 <= start <= stop <= len(value):
            raise ValueError(f"object {req.obj_id} of this rank has no rows {start}:{stop}")
        cols = {k: c[start:stop] for k, c in value.items() if isinstance(c, list)}
        if cols:  # as a pull decodes them: copies (the store's stay as they were), same types
            lists[req.xfer_id] = codec.decode(codec.encode(cols))
        for key, dst in (*ipc.items(), *by_nccl.items()):
            dst[row:row + count].copy_(value.tensor(key)[start:stop])
        if buf is not None:
            for key, at in offsets.items():
                src = dataserver.bytes_of(value.tensor(key)[start:stop])
                at += row * row_bytes[key]
                buf[at:at + src.nbytes] = src

    def _close_gone(self) -> None:
        """Close the sockets to dead groups' data servers (each would go on reconnecting; a
        long run's restarts would pile them up towards zmq's socket limit). A respawned
        rank's server, at the same address by chance, gets a socket of its own again."""
        gone = self._gone.since(self._gone_seen)
        self._gone_seen += len(gone)
        for msg in gone:
            for addr in msg.addrs:
                entry = self._socks.pop(addr, None)
                if entry is not None:
                    entry[0].close(0)
            for retired in [r for r in self._late if r.addr in msg.addrs]:
                self._close_retired(retired)  # (its GPU blocks went with the producer)

    def _check_alive(self, pieces: Iterable[Piece]) -> None:
        """InputLostError if the producer of one of these pieces is known to be gone."""
        for piece in pieces:
            lost = self._gone.lost(piece)
            if lost is not None:
                raise lost

    def _give_up(self, pending: dict[int, tuple[Piece, Pull]]) -> None:
        """Stop waiting for these pulls: late replies must not reach the next pull."""
        for addr in {p.shard.addr for p, _ in pending.values()}:
            self._give_up_socket(addr, [r for p, r in pending.values() if p.shard.addr == addr])

    def _give_up_socket(self, addr: str, unanswered: list[Pull]) -> None:
        """Stop using the socket to `addr`: its pulls timed out. Closed, unless a late reply
        may bring CUDA IPC rows (the producer frees their block only once they are opened
        and closed here): then drained until every pull is answered. A TCP reply is never
        waited for: it may be a whole bucket of bytes."""
        entry = self._socks.pop(addr, None)
        if entry is None:
            return
        sock, _, verifier, identity = entry
        if not any(req.ipc for req in unanswered):
            sock.close(0)
            return
        self._late.append(_Retired(sock, verifier, identity, {r.xfer_id for r in unanswered},
                                   addr))
        while len(self._late) > MAX_LATE_SOCKETS:  # peers that never answer again
            oldest = self._late[0]
            self._drain(oldest)
            self._close_retired(oldest)

    def _drain(self, retired: _Retired) -> bool:
        """Release the CUDA IPC rows of the late replies already in; whether all came."""
        while retired.owed and retired.sock.poll(0, zmq.POLLIN):
            frames = retired.sock.recv_multipart(copy=False)
            reply = open_frame(retired.verifier, b">" + retired.identity,
                               [f.bytes for f in frames[:2]])
            if isinstance(reply, Pulled) and reply.xfer_id in retired.owed:
                retired.owed.discard(reply.xfer_id)
                _release(reply.ipc.values())
        return not retired.owed

    def _close_retired(self, retired: _Retired) -> None:
        retired.sock.close(0)
        self._late.remove(retired)

    def _drain_late(self) -> None:
        for retired in list(self._late):
            if self._drain(retired):
                self._close_retired(retired)

    def close(self) -> None:
        self._drain_late()
        for sock in [e[0] for e in self._socks.values()] + [r.sock for r in self._late]:
            sock.close(0)
        self._socks.clear()
        self._late.clear()
