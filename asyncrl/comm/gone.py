"""Producers known to be gone: a pull of their objects fails at once, not at its timeout.

A rank's data client waits for a producer's answer up to the transfer timeout; a producer
that died never answers. When the controller declares a group dead (or closes it), it tells
every other rank (`PeersGone`), and each data client polling for an answer from one of its
ranks gives up with `InputLostError` naming the group and the cause. Entries never match a
respawned group: they name only objects of calls made before the announcement.
"""

from __future__ import annotations

from asyncrl.comm.messages import PeersGone
from asyncrl.comm.remote import Piece
from asyncrl.errors import InputLostError


class GonePeers:
    """What a rank heard of dead producers. Written by its io thread, read by the threads
    that pull; each field is replaced whole, so readers never see one half updated. Indexed
    by address: a pull polls for every piece it waits on, and a long run that closes an
    evaluation group every few steps hears of thousands."""

    def __init__(self) -> None:
        self._gone: tuple[PeersGone, ...] = ()
        self._by_addr: dict[str, tuple[PeersGone, ...]] = {}

    def add(self, msg: PeersGone) -> None:
        by_addr = dict(self._by_addr)
        for addr in set(msg.addrs):
            by_addr[addr] = (*by_addr.get(addr, ()), msg)
        self._by_addr = by_addr
        self._gone = (*self._gone, msg)

    def since(self, seen: int) -> tuple[PeersGone, ...]:
        """The announcements after the first `seen`."""
        return self._gone[seen:]

    def lost(self, piece: Piece) -> InputLostError | None:
        """Why `piece` can never arrive, if its producer is gone."""
        shard = piece.shard
        for gone in self._by_addr.get(shard.addr, ()):
            if shard.group == gone.group and shard.obj_id < gone.below:
                what = "a whole value" if piece.start < 0 else f"rows {piece.start}:{piece.stop}"
                return InputLostError(f"cannot pull {what} of object {shard.obj_id} from "
                                      f"{shard.peer}: group {gone.group!r} {gone.reason}; "
                                      f"its results are gone with it: make them again")
        return None
