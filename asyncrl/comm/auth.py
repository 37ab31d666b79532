"""HMAC-SHA256 on every frame, with a sequence number against replay.

A frame is two ZeroMQ parts: ``body = seq (8 bytes, big endian) + message`` and
``mac = HMAC(secret, route + body)``. ``route`` binds the frame to one link: the sender's
identity for rank -> controller, ``b">" + destination identity`` for controller -> rank,
so a frame cannot be replayed on another link, and the strictly increasing sequence number
stops it being replayed on its own.
"""

from __future__ import annotations

import hmac
import os
import secrets
import struct
from collections import Counter

SECRET_BYTES = 32
_SEQ = struct.Struct(">Q")


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def write_secret(path: str, secret: bytes) -> None:
    """Write the secret to a file only its owner can read (0600), created that way."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())


def read_secret(path: str) -> bytes:
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(
            f"secret file {path} has mode {mode:o}; it must be readable by its owner only "
            f"(chmod 600 {path})")
    with open(path) as f:
        return bytes.fromhex(f.read().strip())


class Signer:
    """Signs outgoing frames of one socket; one sequence counter per socket."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._seq = 0

    def sign(self, route: bytes, message: bytes) -> list[bytes]:
        self._seq += 1
        body = _SEQ.pack(self._seq) + message
        return [body, hmac.digest(self._secret, route + body, "sha256")]


class Verifier:
    """Checks incoming frames; counts what it drops, by reason, and never raises."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._last_seq: dict[bytes, int] = {}
        self.dropped: Counter[str] = Counter()
        self.total_dropped = 0  # an int, safe to read from another thread

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self.total_dropped += 1

    def verify(self, route: bytes, frames: list[bytes]) -> memoryview | None:
        """Return the message bytes of a valid frame from ``route``, or None (dropped)."""
        if len(frames) != 2 or len(frames[0]) < _SEQ.size:
            self.drop("malformed")
            return None
        body, mac = frames
        if not hmac.compare_digest(hmac.digest(self._secret, route + body, "sha256"), mac):
            self.drop("bad_mac")
            return None
        (seq,) = _SEQ.unpack_from(body)
        if seq <= self._last_seq.get(route, 0):
            self.drop("replay")
            return None
        self._last_seq[route] = seq
        return memoryview(body)[_SEQ.size:]
