"""The control plane's sockets: one ROUTER on the controller, DEALERs on the ranks.

Every frame is signed (see `auth`); a frame that is malformed, unsigned, replayed or does
not decode is dropped and counted, never raised.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from asyncrl.comm import messages
from asyncrl.comm.auth import Signer, Verifier
from asyncrl.comm.messages import Message

CONTROLLER_ROUTE = b"controller"


class ControllerChannel:
    """The controller's ROUTER. One reader task owns receiving (`serve`)."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1"):
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._signer = Signer(secret)
        self._verifier = Verifier(secret)

    @property
    def dropped(self) -> dict[str, int]:
        return dict(self._verifier.dropped)

    def send(self, identity: bytes, msg: Message) -> None:
        """Queue a message for one rank socket, in order; never blocks the loop."""
        frames = self._signer.sign(b">" + identity, messages.encode(msg))
        self._sock.send_multipart([identity, *frames], copy=False)

    async def serve(self, handle: Callable[[bytes, Message], None]) -> None:
        """Receive forever, calling ``handle(identity, message)`` for every valid frame."""
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            while True:  # drain what is already queued before awaiting again
                self._dispatch(frames, handle)
                ready = sock.recv_multipart(zmq.NOBLOCK)  # a future that is already done
                if ready.exception() is not None:
                    break
                frames = ready.result()

    def _dispatch(self, frames: list[bytes], handle: Callable[[bytes, Message], None]) -> None:
        if len(frames) < 2:
            self._verifier.dropped["malformed"] += 1
            return
        identity = frames[0]
        body = self._verifier.verify(identity, frames[1:])
        if body is None:
            return
        try:
            msg = messages.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._verifier.dropped["undecodable"] += 1
            return
        handle(identity, msg)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class RankSocket:
    """A rank's DEALER to the controller. Blocking; each thread that sends owns one."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, secret: bytes,
                 verifier: Verifier | None = None):
        self.identity = identity
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.LINGER, 2000)  # let the last results leave on exit
        self._sock.connect(address)
        self._signer = Signer(secret)
        self._verifier = verifier or Verifier(secret)
        self._route = b">" + identity

    @property
    def dropped(self) -> int:
        return self._verifier.total_dropped

    def send(self, msg: Message) -> None:
        self._sock.send_multipart(self._signer.sign(self.identity, messages.encode(msg)),
                                  copy=False)

    def recv(self, timeout_ms: int) -> Message | None:
        """The next valid message, or None when `timeout_ms` passed (invalid ones dropped)."""
        if not self._sock.poll(timeout_ms):
            return None
        frames = self._sock.recv_multipart()
        body = self._verifier.verify(self._route, frames)
        if body is None:
            return None
        try:
            return messages.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._verifier.dropped["undecodable"] += 1
            return None

    def close(self) -> None:
        self._sock.close()
