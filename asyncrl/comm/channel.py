"""The control plane's sockets: one ROUTER on the controller, DEALERs on the ranks.

Every frame is signed (see `auth`); a frame that is malformed, unsigned, replayed or does
not decode is dropped and counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from asyncrl.comm import messages
from asyncrl.comm.auth import CurveKeys, Signer, Verifier, curve_client, curve_server
from asyncrl.comm.messages import Message

log = logging.getLogger("asyncrl")
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
DRAIN_MAX = 1000  # messages read in one turn of the loop; the rest in the next
DRAIN_PARTS = 4 * DRAIN_MAX  # and parts: a message of more is read over several turns
DRAIN_BYTES = 64 << 20  # and signed bodies' bytes (each hashed to be checked): a turn of
# three 2 GiB unsigned bodies, from anyone reaching the port, held the loop ~3.6 s
MAX_PARTS = 3 + (1 << 16)  # parts kept of one message (route, body, MAC, raw frames of at
# least codec.OOB_MIN_BYTES each, or their PART_BYTES parts): the rest are read and dropped,
# and so is the message
LINK_MIN_RATE = 10e6  # bytes/s: the slowest the controller's messages are taken to leave
# on a CURVE socket raw frames go in parts of at most this: CURVE encrypts (and decrypts) a
# part whole on its context's one I/O thread, and a GiB in one part held every other
# message of that thread (the heartbeats) for seconds
PART_BYTES = 8 << 20


# a frame's bytes where zmq received them (cheaper than Frame.buffer; pyzmq's stubs do not
# say a Frame is a buffer)
_view: Callable[[Any], memoryview] = memoryview


def open_frame(verifier: Verifier, route: bytes, frames: list,
               copy: bool = False) -> Message | None:
    """The message in a signed frame, or None: a malformed, unsigned, replayed or
    undecodable frame is dropped and counted by `verifier`, never raised. `copy`: decode
    from a copy of the body, made once the signature passed (the frames may be views)."""
    body = verifier.verify(route, frames)
    if body is None:
        return None
    try:
        return messages.decode(bytes(body) if copy else body)
    except Exception:  # noqa: BLE001 - DecodeError, ValidationError, RecursionError (nesting)
        verifier.drop("undecodable", route)
        return None


def in_parts(frames: Sequence[Any]) -> list[Any]:
    """`frames` cut into parts of at most PART_BYTES (views of them, not copies)."""
    parts: list[Any] = []
    for frame in frames:
        view = memoryview(frame).cast("B")
        parts += [view[at:at + PART_BYTES] for at in range(0, len(view), PART_BYTES)] or [view]
    return parts


def joined(parts: Sequence[Any], sizes: list[int]) -> list[Any] | None:
    """The frames of `sizes` that `in_parts` cut into `parts`, whole again (one of several
    parts copied once, into a writable buffer), or None: the parts are not those cuts."""
    counts = [max(1, -(-size // PART_BYTES)) for size in sizes]
    if sum(counts) != len(parts):  # (before the cuts are listed: a size of petabytes in a
        return None  # signed message would list a hundred million)
    cuts = [min(PART_BYTES, size - at) for size in sizes
            for at in range(0, size, PART_BYTES) or [0]]
    if [len(part) for part in parts] != cuts:
        return None
    frames, at = [], 0
    for count, size in zip(counts, sizes, strict=True):
        if count == 1:
            frames.append(parts[at])
        else:  # copied by numpy, which lets the GIL go: a rank's io thread (its heartbeats)
            frame, start = np.empty(size, np.uint8), 0  # runs beside a GiB being joined
            for part in parts[at:at + count]:
                frame[start:start + len(part)] = np.frombuffer(part, np.uint8)
                start += len(part)
            frames.append(frame)
        at += count
    return frames


_Framed = type[messages.Call] | type[messages.Construct] | type[messages.Fetched]


def open_with_frames(verifier: Verifier, route: bytes, signed: list, extra: Sequence[Any],
                     kinds: tuple[_Framed, ...], copy: bool = False, parts: bool = False
                     ) -> Message | None:
    """`open_frame` of the two `signed` parts; the raw parts after them (`extra`, zmq
    Frames) are allowed for a message of `kinds` (Call, Construct, Fetched) that announces
    their sizes in its `buffers`, and go in its `frames` as views, made only then. Anything
    else with raw parts is dropped as malformed. `parts`: they came `in_parts` (CURVE)."""
    msg = open_frame(verifier, route, signed, copy)
    if isinstance(msg, kinds):
        if parts and msg.buffers:
            extra = joined(extra, msg.buffers) or []  # (not theirs: dropped below)
        # `frames` is for what came here, never what a sender wrote into the message
        if msg.frames or [len(f) for f in extra] != msg.buffers:
            verifier.drop("malformed", route)
            return None
        if extra:
            msg.frames = [_view(f) for f in extra]  # the arrays use them as they are
    elif msg is not None and extra:
        verifier.drop("malformed", route)
        return None
    return msg


class ControllerChannel:
    """The controller's ROUTER, driven by the event loop's reader callback.

    A plain socket and ``loop.add_reader`` rather than zmq.asyncio: that wrapper costs more
    per message than the rest of a call. ZeroMQ's descriptor is edge-triggered, so a loop turn
    that used the socket ends with a drain (a read until EAGAIN) for messages already queued.
    Per rank and call this is the hot path: frames go out part by part and come in as zero-copy
    frames (cheaper than the multipart helpers), and one drain serves a whole burst of sends."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", curve_secret: bytes | None = None):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a control message silently
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._parts = curve_secret is not None  # raw frames go and come `in_parts`
        try:
            if curve_secret is not None:  # encrypted: only CURVE clients with our key get in
                curve_server(self._sock, curve_secret)
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except BaseException:  # (a host not of this machine's)
            self._sock.close(0)
            self._ctx.term()
            raise
        self.address = f"tcp://{host}:{port}"
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._signer = Signer(secret)
        self._verifier = Verifier(secret)
        self._handle: Callable[[bytes, Message], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._watched: dict[bytes, Unheard] = {}
        # the parts of a message a turn's budget ended in, and how many past MAX_PARTS
        self._partial: list[zmq.Frame] = []
        self._excess = 0
        self._backlog, self._backlog_at = 0.0, 0.0  # bytes (see send_encoded), and when

    @property
    def dropped(self) -> dict[str, int]:
        return dict(self._verifier.dropped)

    def drop(self, reason: str, route: bytes = b"") -> None:
        """Count a message dropped after its frame was accepted (e.g. inside a relay's);
        `route`: who sent it."""
        self._verifier.drop(reason, route)

    def forget(self, gone: Callable[[bytes], bool]) -> None:
        """Routes (socket identities) that will not speak again: see Verifier.forget."""
        self._verifier.forget(gone)

    def watch(self, identity: bytes) -> Unheard:
        """Keep account of what goes to this socket until its rank says it came."""
        return self._watched.setdefault(identity, Unheard())

    def watched(self, identity: bytes) -> Unheard | None:
        return self._watched.get(identity)

    def unwatch(self, identity: bytes) -> None:
        self._watched.pop(identity, None)

    def heard(self, identity: bytes) -> tuple[int, int]:
        """The sequence number of the last message from this socket, and how many numbers
        were passed over (messages lost on the way)."""
        verifier = self._verifier
        return verifier.last(identity), verifier.skipped.get(identity, 0)

    def start(self, handle: Callable[[bytes, Message], None]) -> None:
        """Call ``handle(identity, message)`` on the running loop for every valid frame."""
        self._handle = handle
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._wake()

    def send(self, identity: bytes, msg: Message, frames: Sequence[Any] = ()) -> None:
        """Queue a message for one rank socket, in order; never blocks the loop."""
        self.send_encoded(identity, messages.encode(msg), frames)

    def send_encoded(self, identity: bytes, message: bytes, frames: Sequence[Any] = ()
                     ) -> None:
        """`send` of a message already encoded (one encoding serves every rank it goes to).
        `frames` (raw buffers its Call or Fanout announces) follow it, unsigned and uncopied:
        zmq holds them until they have left."""
        body, mac = self._signer.sign(b">" + identity, message)
        size = len(body)
        for frame in frames:  # each a buffer, checked before the first part goes: a part
            size += memoryview(frame).nbytes  # that fails after it would leave the message
            # open, and the next one, to any rank, appended to it
        # what waits to leave, as if everything went out one after the other at the slowest
        # rate a link is taken to have: a message waits behind those sent before it
        now = time.monotonic()
        self._backlog = max(0.0, self._backlog - (now - self._backlog_at) * LINK_MIN_RATE) + size
        self._backlog_at = now
        unheard = self._watched.get(identity)
        if unheard is not None:
            unheard.sent(self._signer.seq, now, self._backlog / LINK_MIN_RATE)
        if frames and self._parts and b"/relay-" not in identity:  # (relays take them whole)
            frames = in_parts(frames)
        send = self._sock.send
        send(identity, _MORE)
        send(body, _MORE)
        send(mac, _MORE if frames else _NOBLOCK)
        for frame in frames[:-1]:
            send(frame, _MORE, copy=False)
        if frames:
            send(frames[-1], _NOBLOCK, copy=False)
        self._wake()

    def send_frames(self, frames: list[bytes]) -> None:
        """Send raw frames (already signed, or deliberately not: tests use it)."""
        self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self._wake()

    def _wake(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self._sock.closed:  # a drain scheduled by the last sends before close()
            return
        recv, handle = self._sock.recv, self._handle
        assert handle is not None
        frames, excess = self._partial, self._excess  # a message an earlier turn began
        left, hashed = DRAIN_MAX, 0
        for _ in range(DRAIN_PARTS):  # parts, not messages: one of a million parts must not
            try:  # keep the loop here either
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                self._partial, self._excess = frames, excess
                return
            if len(frames) < MAX_PARTS:
                frames.append(frame)
            else:
                excess += 1
            if frame.more:  # (the parts of one message arrive together)
                continue
            if excess:
                self._verifier.drop("too_many_parts", frames[0].bytes)
            else:
                hashed += len(frames[1]) if len(frames) > 1 else 0
                self._dispatch(frames, handle)
            frames, excess = [], 0
            left -= 1
            if not left or hashed >= DRAIN_BYTES:
                break
        self._partial, self._excess = frames, excess
        self._wake()  # more: after the loop's other work (a flood of frames, signed or not,
        # kept the loop here: no heartbeat, no call went meanwhile)

    def _dispatch(self, frames: list[zmq.Frame],
                  handle: Callable[[bytes, Message], None]) -> None:
        identity = frames[0].bytes
        if len(frames) < 3 or identity[:1] == b">":  # (">": the controller's own routes: a
            self._verifier.drop("malformed", identity)  # frame it sent, bounced back)
            return
        # checked on the received buffers (a MAC part of gigabytes is refused by its size,
        # not copied first), the body copied once it passed; a large result's arrays' bytes
        # follow it
        msg = open_with_frames(self._verifier, identity, [_view(frames[1]), _view(frames[2])],
                               frames[3:], (messages.Fetched,), copy=True, parts=self._parts)
        if msg is None:
            return
        try:
            handle(identity, msg)
        except Exception:  # a bug in one handler must not stop the control plane
            log.exception("asyncrl: handling %s from %r failed", type(msg).__name__, identity)

    def close(self) -> None:
        if self._loop is not None and not self._sock.closed:
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)
        self._ctx.term()


class Unheard:
    """What went to one rank socket that its rank has not said it received: (sequence
    number, when it went, how long it may take to leave: the seconds at LINK_MIN_RATE of it
    and of all that went to any socket before it and may not have left yet), oldest first;
    and what the socket sent that has not come."""

    __slots__ = ("count", "messages", "behind")

    def __init__(self) -> None:
        self.count = 0  # messages sent to it
        self.messages: deque[tuple[int, float, float]] = deque()
        # from it: how many it had sent when fewer had come here, and when that was seen
        self.behind: tuple[int, float] | None = None

    def sent(self, seq: int, at: float, leaves_in: float) -> None:
        self.count += 1
        self.messages.append((seq, at, leaves_in))

    def heard(self, seq: int) -> int:
        """The rank received up to `seq`: forget those; how many were sent up to it."""
        messages = self.messages
        while messages and messages[0][0] <= seq:
            messages.popleft()
        return self.count - len(messages)


class RankSocket:
    """A rank's DEALER to the controller. Blocking; each thread that sends owns one."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, secret: bytes,
                 verifier: Verifier | None = None, curve: CurveKeys | None = None):
        self.identity = identity
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.LINGER, 2000)  # let the last results leave on exit
        if curve is not None:
            curve_client(self._sock, curve.controller)
        self._parts = curve is not None  # raw frames go and come `in_parts`
        self._sock.connect(address)
        self._signer = Signer(secret)
        self._verifier = verifier or Verifier(secret)
        self._route = b">" + identity
        self._timeout = -1

    @property
    def dropped(self) -> int:
        return self._verifier.total_dropped

    @property
    def sent(self) -> int:
        """The sequence number of the last message this socket sent (they count up from 1)."""
        return self._signer.seq

    @property
    def heard(self) -> int:
        """The sequence number of the last message it accepted (the controller's numbering)."""
        return self._verifier.last(self._route)

    @property
    def received(self) -> int:
        """How many came signed by the controller (those that then failed to decode too)."""
        return self._verifier.accepted[self._route]

    def send(self, msg: Message, frames: Sequence[Any] = (), block: bool = True) -> None:
        """Send a message; `frames` (raw buffers a Fetched announces) follow it, unsigned and
        uncopied (held until sent). block=False: zmq.Again when its queue is full."""
        self._sock.send_multipart([*self._signer.sign(self.identity, messages.encode(msg)),
                                   *(in_parts(frames) if self._parts else frames)],
                                  0 if block else zmq.NOBLOCK, copy=False)

    def recv(self, timeout_ms: int) -> Message | None:
        """The next valid message, or None when `timeout_ms` passed (invalid ones dropped).
        A Call's or Construct's raw frames come as received, uncopied, in its `frames`."""
        if self._timeout != timeout_ms:
            self._sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout = timeout_ms
        sock = self._sock
        try:
            frames: list[Any] = [sock.recv()]
        except zmq.Again:
            return None
        while sock.rcvmore and len(frames) < 2:  # the signed ones: small, copied
            frames.append(sock.recv())
        extra: list[zmq.Frame] = []
        while sock.rcvmore:  # raw ones: large, used where zmq received them
            extra.append(sock.recv(copy=False))
        return open_with_frames(self._verifier, self._route, frames, extra,
                                (messages.Call, messages.Construct), parts=self._parts)

    def close(self) -> None:
        self._sock.close()
