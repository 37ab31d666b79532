"""HostRelay: the controller talks to a host, not to each of its ranks.

    controller ──Fanout (one per host and call)──▶ relay ──Call──▶ each rank socket on the host
    controller ◀──Fanin (one per host and call)─── relay ◀──Result── each rank socket

A group that relays (`Controller(relay=...)`) runs two relays per host, threads of the
host's local rank 0: one for the ranks' "exec" sockets (in-order calls, which may carry big
arguments) and one for all their other sockets (heartbeats, releases, logs, concurrent
calls), so heartbeats never queue behind a big call, as with a socket per rank. The ranks'
sockets connect to them over ipc:// (in the run's private folder) instead of to the
controller, and speak the same signed protocol: the relay
checks every frame's signature, signs what it passes down, and passes everything else up as
it comes — what one drain of its socket found goes up as one Fanin. Results of a call are
held until every rank the call went to on this host answered, or one of them failed, so a
call costs the controller one message each way per host, however many ranks the host has.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from asyncrl.comm import messages
from asyncrl.comm.auth import CurveKeys, Signer, Verifier, curve_client
from asyncrl.comm.channel import DRAIN_MAX, open_frame
from asyncrl.comm.messages import Fanin, Fanout, Result, Results, Schema

_NOBLOCK = int(zmq.NOBLOCK)


RELAY_ROLES = ("exec", "io")  # a host's two relays: the "exec" sockets', everything else's


def relay_address(prefix: str, node: int, role: str) -> str:
    """Where the ranks of torchrun node `node` find their `role` relay (`prefix` from the
    controller)."""
    return f"{prefix}-{node}-{role}"


def relay_identity(group: str, rank: int, role: str, tag: str) -> bytes:
    """`tag`: the rank's pid and a part nobody can guess (`RankMain.tag`)."""
    return f"{group}/{rank}/relay-{role}/{tag}".encode()


def is_relay(identity: bytes) -> bool:
    parts = identity.split(b"/")
    return len(parts) == 4 and parts[2] in (b"relay-exec", b"relay-io")


def rank_of(identity: bytes) -> int:
    """The rank in a rank socket's identity, ``group/rank/role/pid.nonce``."""
    return int(identity.split(b"/")[1])


def pid_of(tag: bytes) -> bytes:
    """The pid in a rank socket identity's last part, ``pid.nonce`` (`RankMain.tag`)."""
    return tag.split(b".")[0]


class HostRelay:
    """One host's relay for one group: a thread between the controller and the host's ranks."""

    def __init__(self, controller: str, address: str, identity: bytes, secret: bytes,
                 curve: CurveKeys | None = None):
        self.identity = identity
        self._route = b">" + identity
        self._ctx = zmq.Context()  # its own: terminating it lets the last messages leave
        ctx = self._ctx
        self._up = ctx.socket(zmq.DEALER)
        self._up.setsockopt(zmq.IDENTITY, identity)
        self._up.setsockopt(zmq.LINGER, 2000)  # the last messages leave when the rank exits
        self._up.setsockopt(zmq.SNDHWM, 0)  # a controller that reads late must not block
        # this thread at its 1000th message (nothing would reach the ranks meanwhile)
        if curve is not None:
            curve_client(self._up, curve.controller)
        self._up.connect(controller)
        self._down = ctx.socket(zmq.ROUTER)
        self._down.setsockopt(zmq.LINGER, 2000)
        self._down.setsockopt(zmq.SNDHWM, 0)  # never drop a control message silently
        self._down.setsockopt(zmq.RCVHWM, 0)
        self._down.bind(address)
        self._up_signer, self._up_verifier = Signer(secret), Verifier(secret)
        self._signer, self._verifier = Signer(secret), Verifier(secret)
        # how far its link to the controller has got, as a rank's heartbeat reports it (one
        # tuple, for a consistent read from another thread): the sequence number of the last
        # frame from the controller, how many came, how many went up
        self.counts = (0, 0, 0)
        # call id -> (ranks that have not answered, the answers held back)
        self._held: dict[int, tuple[set[int], list[tuple[bytes, Result]]]] = {}
        # this rank's own sockets are served last: the rank may exit on what it gets
        self._own = identity.rsplit(b"/", 2)[0] + b"/"
        self._group = identity.split(b"/", 1)[0]
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="asyncrl-relay", daemon=True)

    @property
    def dropped(self) -> int:
        """Frames dropped (bad signature, replay, undecodable), both ways."""
        return self._up_verifier.total_dropped + self._verifier.total_dropped

    def start(self) -> HostRelay:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop after passing up what the ranks sent last, and let it leave (bounded)."""
        self._stopping = True
        self._thread.join(5)

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._up, zmq.POLLIN)
        poller.register(self._down, zmq.POLLIN)
        while not self._stopping:
            ready = dict(poller.poll(100))  # the timeout only bounds how long close() waits
            self._guarded(self._from_controller, self._up in ready)
            self._guarded(self._from_ranks, self._down in ready)
        self._guarded(lambda: self._from_ranks(None), True)  # the host's ranks' last lines
        self._up.close()
        self._down.close()
        self._ctx.term()  # lingers (bounded) until what is queued has left

    def _guarded(self, work: Callable[[], None], ready: bool) -> None:
        """A bug or a resource error in one pass must not end the host's control plane."""
        if not ready:
            return
        try:
            work()
        except Exception:  # noqa: BLE001 - reported, counted, and the relay goes on
            self._verifier.drop("relay_error")
            print(f"[asyncrl] relay {self.identity.decode()}: {traceback.format_exc()}",
                  file=sys.stderr, flush=True)

    def _from_controller(self) -> None:
        for _ in range(DRAIN_MAX):  # (then the ranks' side's turn: the poll comes back here)
            try:
                frames = self._up.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = open_frame(self._up_verifier, self._route, [f.buffer for f in frames[:2]])
            self._count()  # (a drain may go on for long)
            extra = frames[2:]  # the raw frames of the Calls' large arguments
            if isinstance(msg, Fanout) and _well_formed(msg, len(extra)):
                self._deliver(msg, extra)
            elif msg is not None:
                self._up_verifier.drop("unexpected")

    def _deliver(self, msg: Fanout, extra: list[zmq.Frame]) -> None:
        if msg.call_id:
            self._held[msg.call_id] = ({rank_of(to) for to in msg.to}, [])
        raw: list[list[zmq.Frame]] = []  # per message, its raw frames
        for n in msg.buffers or [0] * len(msg.frames):
            raw.append(extra[:n])
            extra = extra[n:]
        own = []
        for to, which in zip(msg.to, msg.which, strict=True):
            if to.startswith(self._own):
                own.append((to, which))
            else:
                self._send_down(to, msg.frames[which], raw[which])
        for to, which in own:
            self._send_down(to, msg.frames[which], raw[which])

    def _send_down(self, to: bytes, frame: msgspec.Raw, raw: list[zmq.Frame]) -> None:
        body, mac = self._signer.sign(b">" + to, memoryview(frame))  # one copy: into body
        # received frames go on as they are (zmq shares their bytes); pyzmq still copies
        # parts under its copy_threshold, as the small signed ones are
        self._down.send_multipart((to, body, mac, *raw), _NOBLOCK, copy=False)

    def _from_ranks(self, limit: int | None = DRAIN_MAX) -> None:
        senders: list[bytes] = []
        bodies: list[msgspec.Raw] = []
        for _ in itertools.count() if limit is None else range(limit):  # (then the
            # controller's side, as above)
            try:
                frames = self._down.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) != 3:
                self._verifier.drop("malformed")
                continue
            sender = frames[0].bytes
            body = self._verifier.verify(sender, [frames[1].buffer, frames[2].buffer])
            if body is not None:
                for who, answer in self._release(sender, body):
                    senders.append(who)
                    bodies.append(msgspec.Raw(answer))
        if senders:
            message = messages.encode(Fanin(senders, bodies))
            self._up.send_multipart(self._up_signer.sign(self.identity, message))
            self._count()

    def _count(self) -> None:
        verifier = self._up_verifier
        self.counts = (verifier.last(self._route), verifier.accepted[self._route],
                       self._up_signer.seq)

    def _release(self, sender: bytes, body: memoryview) -> list[tuple[bytes, Any]]:
        """What can go up now: a call's Results wait for the rest of the call's ranks, and
        go up as one `Results` when all of them succeeded."""
        if not self._held:
            return [(sender, body)]
        try:
            msg = messages.decode(body)
        except Exception:  # noqa: BLE001 - not only DecodeError: e.g. nesting too deep
            self._verifier.drop("undecodable")
            return []
        if not isinstance(msg, Result) or msg.call_id not in self._held:
            return [(sender, body)]
        if sender.split(b"/")[:2] != [self._group, b"%d" % msg.rank]:  # an answer for
            self._verifier.drop("foreign", sender)  # another rank (the checked sender is
            return []  # who answered): held, it would mark that rank answered
        waiting, answers = self._held[msg.call_id]
        waiting.discard(msg.rank)
        answers.append((sender, msg))
        if waiting and msg.error is None:
            return []
        del self._held[msg.call_id]  # answers after a failure go up as they come
        if msg.error is not None:
            return [(who, messages.encode(result)) for who, result in answers]
        return [(sender, messages.encode(_in_columns(msg.call_id,
                                                     [result for _, result in answers])))]


def _in_columns(call_id: int, answers: list[Result]) -> Results:
    """A call's successful answers as one message."""
    schemas: list[Schema] = []
    index: dict[bytes, int] = {}
    schema_of = []
    for result in answers:
        if result.schema is None:
            schema_of.append(-1)
            continue
        key = msgspec.msgpack.encode(result.schema)
        if key not in index:
            index[key] = len(schemas)
            schemas.append(result.schema)
        schema_of.append(index[key])
    return Results(call_id, [r.rank for r in answers], [r.value for r in answers],
                   [r.inline for r in answers], schema_of, schemas,
                   max(r.busy for r in answers))


def _well_formed(msg: Fanout, raw_frames: int) -> bool:
    """Every destination a rank socket's identity, with a frame, and the raw frames that
    came are those announced (a signed Fanout comes from the controller, but a bug there
    must not stop the relay)."""
    buffers = msg.buffers
    return len(msg.to) == len(msg.which) and all(
        0 <= w < len(msg.frames) for w in msg.which) and all(
        to.count(b"/") == 3 and to.split(b"/")[1].isdigit() for to in msg.to) and (
        len(buffers) in (0, len(msg.frames)) and all(n >= 0 for n in buffers)
        and sum(buffers) == raw_frames)
