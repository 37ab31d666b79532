"""Outbox: how the controller sends to rank sockets, directly or through their host's relay.

    box = ctl.outbox()
    box.put(identity, encoded)      a socket the controller reaches directly: sent now;
    ...                             one behind a relay: gathered per relay
    box.flush(call_id)              one Fanout per relay; one frame per distinct message

A message may bring raw frames (the bytes of a Call's large arguments, `codec.encode_oob`):
they follow it, to the socket or inside its relay's Fanout, and are never copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl.comm.channel import ControllerChannel
from asyncrl.comm.messages import Fanout


class Outbox:
    __slots__ = ("_channel", "_relay_of", "_fanouts")

    def __init__(self, channel: ControllerChannel, relay_of: dict[bytes, bytes]):
        self._channel = channel
        self._relay_of = relay_of  # rank socket identity -> its relay's, for relayed groups
        # relay -> (destinations, frame index of each, frames, the raw frames of each frame,
        # id of each distinct message -> its index; `frames` keeps the messages alive, so
        # their ids stay theirs)
        self._fanouts: dict[bytes, tuple[list[bytes], list[int], list[msgspec.Raw],
                                         list[Sequence[Any]], dict[int, int]]] = {}

    def put(self, identity: bytes, message: bytes, raw: Sequence[Any] = ()) -> None:
        """Send an encoded message (and the raw frames it announces) to one rank socket
        (relayed ones at `flush`)."""
        self.put_many(self._relay_of.get(identity), [identity], message, raw)

    def put_many(self, relay: bytes | None, identities: list[bytes], message: bytes,
                 raw: Sequence[Any] = ()) -> None:
        """`put` of one message to sockets behind one relay (None: reached directly), without
        a lookup per socket."""
        if relay is None:
            for identity in identities:
                self._channel.send_encoded(identity, message, raw)
            return
        box = self._fanouts.get(relay)
        if box is None:
            box = self._fanouts[relay] = ([], [], [], [], {})
        to, which, frames, raws, index = box
        i = index.get(id(message))  # the same message object again: no need to compare
        if i is None:
            i = index[id(message)] = len(frames)
            frames.append(msgspec.Raw(message))
            raws.append(raw)
        to += identities
        which += [i] * len(identities)

    def flush(self, call_id: int = 0) -> None:
        """Send what waits for relays; `call_id`: the messages are that call's Calls."""
        for relay, (to, which, frames, raws, _) in self._fanouts.items():
            counts = [len(r) for r in raws] if any(raws) else []  # [] is left off the wire
            self._channel.send(relay, Fanout(to, which, frames, call_id, counts),
                               [f for r in raws for f in r])
        self._fanouts = {}
