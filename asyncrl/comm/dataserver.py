"""A rank's data-plane server: it answers pulls of the objects its store holds.

A pull names an object and rows; the server copies the rows into the puller's shared
segment (same host), sends them as raw frames after the signed reply (TCP), sends GPU
columns by NCCL before answering, or exports them for CUDA IPC. Requests are checked like
the control plane's (signed, routed to this server) and a bad one is refused with an error
that names it, never fatal to the server. The puller's side is `comm.dataplane.DataClient`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from asyncrl.comm import codec, messages, nccl
from asyncrl.comm.auth import CurveKeys, Signer, Verifier, curve_server
from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.channel import open_frame
from asyncrl.comm.cuda_ipc import export_rows
from asyncrl.comm.messages import NONE, Pull, Pulled
from asyncrl.comm.shm import SegmentMapper

log = logging.getLogger("asyncrl")
MAX_PULL_BYTES = 1 << 20  # a pull names rows and columns (their names split over pulls below this)


def _puller(identity: bytes) -> tuple[str, str]:
    """(group, rank) of the rank whose pull socket sent a request."""
    parts = identity.decode(errors="replace").split("/")
    return parts[0], parts[1] if len(parts) > 1 else ""


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as a flat uint8 array (no copy when it is a contiguous CPU
    tensor; GPU tensors are staged through host memory until the GPU transports exist)."""
    return codec.byte_view(t.detach().cpu()).numpy()


def check_reachable(host: str, controller: str) -> None:
    """A rank's data host given as a name must not resolve to loopback where the controller
    is on another machine: zmq binds where the name resolves (Debian's /etc/hosts maps a
    machine's own name to 127.0.1.1), and no other host could pull from this rank."""
    if _loopback(controller.removeprefix("tcp://").rpartition(":")[0]) is not False:
        return  # one machine (or unknown): loopback is fine
    try:
        ipaddress.ip_address(host)
        return  # an address: bound as given
    except ValueError:
        pass
    if _loopback(host):
        raise RuntimeError(f"this host's address {host!r} resolves to a loopback address on "
                           f"it, so ranks on other hosts could not pull from its ranks; give "
                           f"the host's IP address as its address in the cluster's hosts")


def _loopback(host: str) -> bool | None:
    """Whether every address `host` resolves to is loopback (None: it does not resolve)."""
    found = addresses(host)
    return None if found is None else bool(found) and all(map(is_loopback, found))


def addresses(host: str) -> set[str] | None:
    """The IP addresses `host` resolves to here (None: it does not)."""
    try:
        return {str(i[4][0]) for i in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.partition("%")[0]).is_loopback  # (a zone: "%eth0")


class DataServer:
    """A rank's data-plane server: a thread with a ROUTER that answers Pulls. Pulls by NCCL
    are answered on a thread per communicator: a send may wait for its receiver until the
    transfer timeout, and must hold up no other pull. Their replies come back to the
    server's thread (the ROUTER's only user) over an inproc socket."""

    def __init__(self, ctx: zmq.Context, host: str, secret: bytes, lookup, peer: str,
                 run_prefix: str, on_start: Callable[[], None] | None = None,
                 timeout: float = 60.0, curve: CurveKeys | None = None):
        self._ctx = ctx
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # pulls are small: a peer sending a larger frame is cut off (a frame: a message of
        # many is still taken in before its MAC is checked; untrusted networks need CURVE)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_PULL_BYTES)
        if curve is not None:  # encrypted: every rank serves with the run's data key pair
            curve_server(self._sock, curve.data_secret)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._signer, self._verifier = Signer(secret), Verifier(secret)
        self._route = b"@" + self.address.encode()  # a pull signed for another server fails
        self._lookup = lookup  # obj_id -> stored value, KeyError if absent
        self._peer = peer
        self._run_prefix = run_prefix  # segments of this run: f"{run_prefix}{group}+{rank}-"
        self._mapper = SegmentMapper()
        self._on_start = on_start
        self._timeout = timeout  # for an NCCL send to be received
        self.rejected = 0  # well-signed requests that could not be served
        self._senders: dict[str, ThreadPoolExecutor] = {}  # NCCL key -> its thread
        self._senders_lock = threading.Lock()
        self._replies = f"inproc://asyncrl-data-replies-{id(self)}"
        self._local = threading.local()  # each sender thread's socket to the server's
        bound = threading.Event()
        threading.Thread(target=self._serve, args=(bound,), name="asyncrl-data",
                         daemon=True).start()
        bound.wait()  # a sender's connect then finds the inproc address bound

    @property
    def dropped(self) -> int:
        return self._verifier.total_dropped

    def _serve(self, bound: threading.Event) -> None:
        replies = self._ctx.socket(zmq.PULL)
        replies.bind(self._replies)
        bound.set()
        self._start_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if replies in ready:  # a sender thread's answer: signed and sent here
                    identity, body, *buffers = replies.recv_multipart(copy=False)
                    self._send(identity.bytes, body.bytes, [b.buffer for b in buffers])
                if self._sock in ready:
                    self._serve_one()
            except zmq.ContextTerminated:  # its context ends: let it (it logged this for
                replies.close(0)           # ever; term() also waits for NCCL senders' own)
                self._sock.close(0)
                return
            except Exception:  # noqa: BLE001 - this thread must outlive any one request
                log.exception("asyncrl data server %s: a request failed", self._peer)

    def _start_thread(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:  # noqa: BLE001 - CPU columns can still be served
                log.exception("asyncrl data server %s: setting up its thread failed",
                              self._peer)

    def _send(self, identity: bytes, body: bytes, buffers: list[Any]) -> None:
        frames_out = self._signer.sign(b">" + identity, body)
        self._sock.send_multipart([identity, *frames_out, *buffers], copy=False)

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(copy=True)
        if len(frames) != 3:
            self._verifier.drop("malformed")
            return
        identity = frames[0]
        req = open_frame(self._verifier, identity + self._route, frames[1:])
        if req is None:
            return
        if not isinstance(req, Pull):
            self._verifier.drop("unexpected")
            return
        if req.nccl and not self._send_later(req, identity):  # refused at once: a send
            self.rejected += 1  # here would wait on this thread for a link set up meanwhile
            reply = Pulled(req.xfer_id, error=f"LookupError: {nccl.no_link(req.nccl_key)}")
            self._send(identity, messages.encode(reply), [])
        elif not req.nccl:
            reply, buffers = self._reply(req, identity)
            self._send(identity, messages.encode(reply), buffers)

    def _send_later(self, req: Pull, identity: bytes) -> bool:
        """Queue an NCCL pull on its link's thread; False: this rank has no such link."""
        with self._senders_lock:  # (group_gone, on the rank's io thread, ends threads)
            sender = self._senders.get(req.nccl_key)
            if sender is None and nccl.has(req.nccl_key, connecting=True):
                sender = self._senders[req.nccl_key] = ThreadPoolExecutor(
                    1, thread_name_prefix="asyncrl-nccl-send", initializer=self._start_thread)
            if sender is not None:
                sender.submit(self._answer_later, req, identity)
        return sender is not None

    def _close_push(self) -> None:
        """On a sender thread, its last task: close its socket to the server's thread."""
        push = getattr(self._local, "push", None)
        if push is not None:
            push.close(0)
            del self._local.push

    def _answer_later(self, req: Pull, identity: bytes) -> None:
        """On a sender thread: answer, and hand the reply to the server's thread."""
        try:
            reply, buffers = self._reply(req, identity)
            push = getattr(self._local, "push", None)
            if push is None:
                push = self._local.push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.SNDHWM, 0)
                push.connect(self._replies)
            push.send_multipart([identity, messages.encode(reply), *buffers], copy=False)
        except Exception:  # noqa: BLE001 - a sender thread must outlive any one request
            log.exception("asyncrl data server %s: pull %d failed", self._peer, req.xfer_id)

    def _reply(self, req: Pull, identity: bytes) -> tuple[Pulled, list[Any]]:
        """The answer to a pull: the rows, or the error that refuses it."""
        try:
            reply, buffers = self._answer(req, identity)
        except Exception as e:  # noqa: BLE001 - a bad request is refused, never fatal
            self.rejected += 1
            if not isinstance(e, LookupError | ValueError | TypeError):  # not the request's
                log.exception("asyncrl data server %s: pull %d failed", self._peer,
                              req.xfer_id)  # fault: the puller gets one line, this the rest
            if req.dest:
                self._mapper.forget(req.dest)  # the puller may have given the segment up
            reply, buffers = Pulled(req.xfer_id, error=f"{type(e).__name__}: {e}"), []
        return reply, buffers

    def _answer(self, req: Pull, identity: bytes) -> tuple[Pulled, list[Any]]:
        try:
            value = self._lookup(req.obj_id)
        except KeyError:
            raise LookupError(f"object {req.obj_id} is not held by {self._peer} (released, or "
                              f"never stored: with no group dead, a bug in asyncrl, please "
                              f"report it)") from None
        if req.start == -1 and req.stop == -1:  # large arrays as raw frames: never copied
            body, arrays = codec.encode_oob(value)
            return Pulled(req.xfer_id, value=msgspec.Raw(body),
                          buffers=[str(i) for i in range(len(arrays))]), arrays
        if not isinstance(value, TensorBatch):
            raise TypeError(f"object {req.obj_id} on {self._peer} is a "
                            f"{type(value).__name__}, not a TensorBatch: pull it whole")
        if not 0 <= req.start <= req.stop <= len(value):
            raise IndexError(f"rows {req.start}:{req.stop} are outside object {req.obj_id} "
                             f"({len(value)} rows) on {self._peer}")
        lists = {} if req.no_lists else {
            k: c[req.start:req.stop] for k, c in value.items() if isinstance(c, list)}
        reply = Pulled(req.xfer_id, lists=msgspec.Raw(codec.encode(lists)) if lists else NONE)
        tensors = {k: c for k, c in value.items() if isinstance(c, torch.Tensor)}
        by_ipc = {}  # GPU columns for a puller on this host: device to device
        for key in req.ipc:
            if key not in tensors or not tensors[key].is_cuda:
                raise ValueError(f"column {key!r} of object {req.obj_id} on {self._peer} is "
                                 f"not a GPU tensor: it cannot go by CUDA IPC")
            by_ipc[key] = tensors.pop(key)
        reply, buffers = self._send_rest(req, identity, reply, tensors)
        # exported last, once nothing else can fail: rows exported into a reply that then
        # carried an error instead would never be opened, and their GPU block never freed
        for key, t in by_ipc.items():
            reply.ipc[key] = export_rows(t, req.start, req.stop)
        return reply, buffers

    def _send_rest(self, req: Pull, identity: bytes, reply: Pulled,
                   tensors: dict[str, torch.Tensor]) -> tuple[Pulled, list[Any]]:
        """The columns that go by NCCL, as frames, or into the puller's shared segment."""
        if req.nccl:  # sent before the answer: an answer means the bytes are there
            missing = [k for k in req.nccl if k not in tensors]
            if missing:
                raise KeyError(f"object {req.obj_id} on {self._peer} has no tensor columns "
                               f"{missing}")
            group, rank = _puller(identity)
            nccl.send(req.nccl_key, [tensors.pop(k)[req.start:req.stop] for k in req.nccl],
                      (group, int(rank)), self._timeout, req.nccl_uid)
        if not req.dest:
            if req.columns:  # one group of a wide row's columns
                missing = [c.key for c in req.columns if c.key not in tensors]
                if missing:
                    raise KeyError(f"object {req.obj_id} on {self._peer} has no tensor "
                                   f"columns {missing}")
                tensors = {c.key: tensors[c.key] for c in req.columns}
            reply.buffers = list(tensors)
            return reply, [bytes_of(t[req.start:req.stop]) for t in tensors.values()]
        group, rank = _puller(identity)
        own = f"{self._run_prefix}{group}+{rank}-"  # only the puller's own pool, this run
        if not req.dest.startswith(own):
            raise ValueError(f"destination {req.dest!r} is not a segment of the puller's "
                             f"pool (expected a name starting {own!r})")
        for col in req.columns:
            if col.key not in tensors:
                raise KeyError(f"object {req.obj_id} on {self._peer} has no tensor column "
                               f"{col.key!r}")
            rows = tensors[col.key][req.start:req.stop]
            nbytes = rows.numel() * rows.element_size()
            if nbytes != col.row_bytes * (req.stop - req.start):
                raise ValueError(f"column {col.key!r}: {col.row_bytes} bytes per row asked, "
                                 f"{nbytes // max(1, req.stop - req.start)} held")
            dst = np.frombuffer(self._mapper.view(
                req.dest, col.offset + req.dest_row * col.row_bytes, nbytes), np.uint8)
            if rows.is_cuda and nbytes:  # device to shared memory in one copy
                torch.from_numpy(dst).copy_(codec.byte_view(rows))
            else:
                np.copyto(dst, bytes_of(rows))
        return reply, []

    def group_gone(self, group: str) -> None:
        """Unmap the segments of `group`'s ranks that rows were written into (a closed
        consumer's pools are unlinked, and a mapping kept would pin their memory until
        this rank mapped some new segment); end the sender threads of its links (a long
        run that makes and closes groups would pile them up), each once its queue is done
        (its sends fail at once: nccl.forget_group aborts their links)."""
        self._mapper.forget_prefix(f"{self._run_prefix}{group}+")
        with self._senders_lock:
            for key in [k for k in self._senders if group in k.split("->")]:
                sender = self._senders.pop(key)
                sender.submit(self._close_push)
                sender.shutdown(wait=False)

    def close(self) -> None:
        self._mapper.close()
