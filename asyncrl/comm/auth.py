"""HMAC-SHA256 on every frame, with a sequence number against replay.

A frame is two ZeroMQ parts: ``body = seq (8 bytes, big endian) + message`` and
``mac = HMAC(secret, len(route) (4 bytes, big endian) + route + body)``. ``route`` binds
the frame to one link: the sender's identity for rank -> controller, ``b">" + destination
identity`` for controller -> rank, so a frame cannot be replayed on another link, and the
strictly increasing sequence number stops it being replayed on its own. The route's length
keeps the route/body boundary from moving (a frame re-sent from identity ``route +
body[:k]`` with body ``body[k:]`` would otherwise verify).

The MAC is HMAC-SHA256 from the standard library, keyed once per socket and copied per frame
(cheaper than keying it again for every frame).

Optional CurveZMQ encryption (`Controller(encrypt=True)`) for untrusted networks: the
controller's ROUTER and every rank's data server are CURVE servers, every other socket a
CURVE client with a key pair of its own. The servers' public keys (and the data servers'
secret key, which every rank serves with) travel in the secret file, beside the secret:

    <secret, hex>
    curve-controller <the ROUTER's public key, Z85>      (its secret key never leaves it)
    curve-data-public <Z85>
    curve-data-secret <Z85>

Frames stay signed as above: CURVE hides them, the HMAC still decides what is accepted.

Large arrays (a Call's arguments, a Fetched result, a Pulled batch) follow their signed
message as raw parts, unhashed: the message binds them by count and exact sizes, and a
ZeroMQ message arrives whole, so a peer that can only connect cannot attach its own parts to
another's message. Against a peer that can alter TCP traffic in flight, `encrypt=True` is
what protects their bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
from collections import Counter
from collections.abc import Callable
from time import monotonic
from typing import NamedTuple

import zmq

SECRET_BYTES = 32
_SEQ = struct.Struct(">Q")
_ROUTE_LEN = struct.Struct(">I")
_MAC_SIZE = hashlib.sha256().digest_size  # 32
WARN_EVERY_S = 30.0  # a reason's drops are said at its first, then at most once per this
log = logging.getLogger("asyncrl")


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class CurveKeys(NamedTuple):
    """A run's CurveZMQ keys as ranks read them (Z85): the controller's public key, and the
    key pair every rank's data server uses."""

    controller: bytes
    data_public: bytes
    data_secret: bytes


def curve_available() -> bool:
    """Whether this pyzmq's libzmq can do CURVE (it needs libsodium or its own tweetnacl)."""
    return bool(zmq.has("curve"))


def new_curve_keys() -> tuple[CurveKeys, bytes]:
    """Fresh keys for a run, and the controller's own secret key (it stays in its memory)."""
    controller_public, controller_secret = zmq.curve_keypair()
    data_public, data_secret = zmq.curve_keypair()
    return CurveKeys(controller_public, data_public, data_secret), controller_secret


def curve_server(sock: zmq.Socket, secret_key: bytes) -> None:
    """Make `sock` (before it binds) a CURVE server: peers must know its public key."""
    sock.curve_secretkey = secret_key
    sock.curve_publickey = zmq.curve_public(secret_key)
    sock.curve_server = True


def curve_client(sock: zmq.Socket, server_key: bytes) -> None:
    """Make `sock` (before it connects) a CURVE client of the server with `server_key`,
    with a key pair of its own."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def write_secret(path: str, secret: bytes, curve: CurveKeys | None = None) -> None:
    """Write the secret (and the CURVE keys, if any) to a file only its owner can read
    (0600), created that way."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
        if curve is not None:
            f.write(f"curve-controller {curve.controller.decode()}\n"
                    f"curve-data-public {curve.data_public.decode()}\n"
                    f"curve-data-secret {curve.data_secret.decode()}\n")


def _read_private(path: str) -> list[str]:
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:  # (a rank on another host: the file is where TMPDIR was)
        raise FileNotFoundError(
            f"secret file {path} is not on host {socket.gethostname()}: a run over several "
            f"hosts makes it under the controller's TMPDIR, which every host must see: "
            f"point TMPDIR at a folder on the shared file system before launching") from None
    if mode & 0o077:
        raise PermissionError(
            f"secret file {path} has mode {mode:o}; it must be readable by its owner only "
            f"(chmod 600 {path})")
    with open(path) as f:
        return f.read().split("\n")


def read_secret(path: str) -> bytes:
    return bytes.fromhex(_read_private(path)[0].strip())


def read_curve(path: str) -> CurveKeys | None:
    """The CURVE keys in a secret file, or None when the run is not encrypted."""
    fields = dict(line.split(" ", 1) for line in _read_private(path)[1:] if " " in line)
    if "curve-controller" not in fields:
        return None
    return CurveKeys(*(fields[k].strip().encode() for k in (
        "curve-controller", "curve-data-public", "curve-data-secret")))


class _Mac:
    """HMAC-SHA256 under one key, its key schedule done once (each frame copies it)."""

    __slots__ = ("_base",)

    def __init__(self, secret: bytes):
        self._base = hmac.new(secret, digestmod=hashlib.sha256)

    def __call__(self, route: bytes, body: bytes | memoryview) -> bytes:
        """HMAC(secret, len(route) + route + body)."""
        mac = self._base.copy()
        mac.update(_ROUTE_LEN.pack(len(route)))
        mac.update(route)
        mac.update(body)
        return mac.digest()


class Signer:
    """Signs outgoing frames of one socket; one sequence counter per socket."""

    def __init__(self, secret: bytes):
        self._mac = _Mac(secret)
        self._seq = 0

    @property
    def seq(self) -> int:
        """The sequence number of the last frame signed (0: none yet)."""
        return self._seq

    def sign(self, route: bytes, message: bytes | memoryview) -> list[bytes]:
        self._seq += 1
        body = _SEQ.pack(self._seq) + message
        return [body, self._mac(route, body)]


def _who(route: bytes) -> str:
    """A route as logged: its group/rank/role, never a rank socket's tag after them (a log
    read by others must not give them the part that proves a socket is that rank's). Any
    peer picks its own route: bytes that are not text and characters that are not printable
    (a newline, a terminal escape) are written escaped, so a route cannot forge log lines."""
    who = b"/".join(route.split(b"/")[:3])[:80].decode(errors="backslashreplace")
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in who) or "?"


class Verifier:
    """Checks incoming frames; counts what it drops, by reason, and never raises."""

    def __init__(self, secret: bytes):
        self._mac = _Mac(secret)
        self._last_seq: dict[bytes, int] = {}
        self._retired: set[bytes] = set()  # routes of stopped sockets: what comes is replayed
        self.dropped: Counter[str] = Counter()
        # per route, sequence numbers passed over: messages lost on the way (a broken
        # connection) where the sender numbers that route's messages 1, 2, 3... (a rank socket)
        self.skipped: Counter[bytes] = Counter()
        self.accepted: Counter[bytes] = Counter()  # per route, frames that passed
        self.total_dropped = 0  # an int, safe to read from another thread
        self._said: dict[str, tuple[float, int]] = {}  # reason -> when said, its count then

    def drop(self, reason: str, route: bytes = b"") -> None:
        """Count a dropped frame (`route`: who sent it, where known). Said as a warning at
        the first of each reason, then at most once per WARN_EVERY_S for it: a flood of
        them costs a count each, not a line each."""
        self.dropped[reason] += 1
        self.total_dropped += 1
        said = self._said.get(reason)
        if said is None or monotonic() - said[0] >= WARN_EVERY_S:
            count = self.dropped[reason]
            self._said[reason] = (monotonic(), count)
            log.warning("asyncrl: dropped a frame (%s) from %s: %d dropped for this reason "
                        "(%d since last said), %d in all", reason, _who(route), count,
                        count - (said[1] if said else 0), self.total_dropped)

    def last(self, route: bytes) -> int:
        """The sequence number of the last frame accepted from `route` (0: none yet)."""
        return self._last_seq.get(route, 0)

    def forget(self, gone: Callable[[bytes], bool]) -> None:
        """Retire the routes that will not speak again (a stopped group's sockets; each
        socket's identity carries a nonce of its own, never used again): their sequence
        counters go, the routes stay named, so that their frames, replayed by whoever
        captured them, are dropped as before (a dead group's Ready or Log would reach a
        group of its name started afresh)."""
        for route in [r for r in self._last_seq if gone(r)]:
            del self._last_seq[route]
            self.skipped.pop(route, None)
            self.accepted.pop(route, None)
            self._retired.add(route)

    def verify(self, route: bytes, frames: list[bytes] | list[memoryview]) -> memoryview | None:
        """Return the message bytes of a valid frame from ``route``, or None (dropped)."""
        if len(frames) != 2 or len(frames[0]) < _SEQ.size:
            self.drop("malformed", route)
            return None
        body, mac = frames
        if len(mac) != _MAC_SIZE:  # (before hashing a body of any size)
            self.drop("malformed", route)
            return None
        if not hmac.compare_digest(self._mac(route, body), mac):
            self.drop("bad_mac", route)
            return None
        if route in self._retired:  # (after the MAC: unsigned junk is not a replay)
            self.drop("replay", route)
            return None
        (seq,) = _SEQ.unpack_from(body)
        last = self._last_seq.get(route, 0)
        if seq <= last:
            self.drop("replay", route)
            return None
        if seq != last + 1:  # frames that never came (from a sender that counts per route)
            self.skipped[route] += seq - last - 1
        self._last_seq[route] = seq
        self.accepted[route] += 1
        return memoryview(body)[_SEQ.size:]
