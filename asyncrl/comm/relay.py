"""HostRelay: the controller talks to a host, not to each of its ranks.

    controller ──Fanout (one per host and call)──▶ relay ──Call──▶ each rank socket on the host
    controller ◀──Fanin (one per host and call)─── relay ◀──Result── each rank socket

A group that relays (`Controller(relay=...)`) runs one relay per host, a thread of the
host's local rank 0. The ranks' control sockets connect to it over ipc:// (in the run's
private folder) instead of to the controller, and speak the same signed protocol: the relay
checks every frame's signature, signs what it passes down, and passes everything else up as
it comes — what one drain of its socket found goes up as one Fanin. Results of a call are
held until every rank the call went to on this host answered, or one of them failed, so a
call costs the controller one message each way per host, however many ranks the host has.
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from asyncrl.comm import messages
from asyncrl.comm.auth import CurveKeys, Signer, Verifier, curve_client
from asyncrl.comm.channel import open_frame
from asyncrl.comm.messages import Fanin, Fanout, Result

_NOBLOCK = int(zmq.NOBLOCK)


def relay_address(prefix: str, node: int) -> str:
    """Where the ranks of torchrun node `node` find their relay (`prefix` from the controller)."""
    return f"{prefix}-{node}"


def rank_of(identity: bytes) -> int:
    """The rank in a rank socket's identity, ``group/rank/role/pid``."""
    return int(identity.split(b"/")[1])


class HostRelay:
    """One host's relay for one group: a thread between the controller and the host's ranks."""

    def __init__(self, ctx: zmq.Context, controller: str, address: str, identity: bytes,
                 secret: bytes, curve: CurveKeys | None = None):
        self.identity = identity
        self._route = b">" + identity
        self._up = ctx.socket(zmq.DEALER)
        self._up.setsockopt(zmq.IDENTITY, identity)
        self._up.setsockopt(zmq.LINGER, 2000)  # the last messages leave when the rank exits
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
        # call id -> (ranks that have not answered, the answers held back)
        self._held: dict[int, tuple[set[int], list[tuple[bytes, memoryview]]]] = {}
        # this rank's own sockets are served last: the rank may exit on what it gets
        self._own = identity.rsplit(b"/", 2)[0] + b"/"
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
        """Stop, letting what is queued leave (the sockets linger)."""
        self._stopping = True
        self._thread.join(5)
        if not self._thread.is_alive():
            self._up.close()
            self._down.close()

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._up, zmq.POLLIN)
        poller.register(self._down, zmq.POLLIN)
        while not self._stopping:
            ready = dict(poller.poll(100))  # the timeout only bounds how long close() waits
            if self._up in ready:
                self._from_controller()
            if self._down in ready:
                self._from_ranks()

    def _from_controller(self) -> None:
        while True:
            try:
                frames = self._up.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            msg = open_frame(self._up_verifier, self._route, frames)
            if isinstance(msg, Fanout) and _well_formed(msg):
                self._deliver(msg)
            elif msg is not None:
                self._up_verifier.drop("unexpected")

    def _deliver(self, msg: Fanout) -> None:
        if msg.call_id:
            self._held[msg.call_id] = ({rank_of(to) for to in msg.to}, [])
        own = []
        for to, which in zip(msg.to, msg.which, strict=True):
            if to.startswith(self._own):
                own.append((to, which))
            else:
                self._send_down(to, msg.frames[which])
        for to, which in own:
            self._send_down(to, msg.frames[which])

    def _send_down(self, to: bytes, frame: msgspec.Raw) -> None:
        body, mac = self._signer.sign(b">" + to, bytes(frame))
        self._down.send_multipart((to, body, mac), _NOBLOCK)

    def _from_ranks(self) -> None:
        senders: list[bytes] = []
        bodies: list[msgspec.Raw] = []
        while True:
            try:
                frames = self._down.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3:
                self._verifier.drop("malformed")
                continue
            body = self._verifier.verify(frames[0], frames[1:])
            if body is not None:
                for sender, answer in self._release(frames[0], body):
                    senders.append(sender)
                    bodies.append(msgspec.Raw(answer))
        if senders:
            message = messages.encode(Fanin(senders, bodies))
            self._up.send_multipart(self._up_signer.sign(self.identity, message))

    def _release(self, sender: bytes, body: memoryview) -> list[tuple[bytes, memoryview]]:
        """What can go up now: a call's Results wait for the rest of the call's ranks."""
        if not self._held:
            return [(sender, body)]
        try:
            msg = messages.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._verifier.drop("undecodable")
            return []
        held = self._held.get(msg.call_id) if isinstance(msg, Result) else None
        if held is None:
            return [(sender, body)]
        waiting, answers = held
        waiting.discard(msg.rank)
        answers.append((sender, body))
        if waiting and msg.error is None:
            return []
        del self._held[msg.call_id]  # answers after a failure go up as they come
        return answers


def _well_formed(msg: Fanout) -> bool:
    """Every destination a rank socket's identity, with a frame (a signed Fanout comes from
    the controller, but a bug there must not stop the relay)."""
    return len(msg.to) == len(msg.which) and all(
        0 <= w < len(msg.frames) for w in msg.which) and all(
        to.count(b"/") == 3 and to.split(b"/")[1].isdigit() for to in msg.to)
