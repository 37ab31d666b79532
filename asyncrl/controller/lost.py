"""Messages lost on a rank's links, found before a call waits on them for ever.

A rank's heartbeats run on its "io" socket; its in-order calls and their results on its
"exec" socket, a TCP connection of its own that may sit idle for minutes. When a connection
breaks (a middlebox drops an idle link, a reset), ZeroMQ connects again without a word and
what was on the wire is gone: a Call the rank never runs, or a Result the controller never
gets. So every heartbeat says how far the rank's sockets have got (`Heartbeat.exec_*`,
`io_*`; behind host relays, the relays the rank runs: `relays`, the TCP links being theirs),
and the supervisor compares it with what the controller sent and got:

    to the rank     fewer received than were sent up to the last one it received (one was
      (exec, io)    passed over: on io, where heartbeats flow, that finds any loss)
      (exec)        or one not received while its thread has waited for `grace`, sent
                    `grace` before a controller heartbeat the rank had then, and more if
                    it waited to leave behind big ones (Unheard): the controller's clock
    from the rank   a sequence number passed over; or one it sent that has not come
      (exec,        `grace` after the controller first found it missing
       concurrent)

`grace` is LOST_AFTER heartbeat timeouts: a message that much slower than the heartbeats
beside it is not coming. Any loss ends the group as a death does (recovery restarts it):
what else was lost with it cannot be known. The results of a directly reached rank's
concurrent calls come from its pool threads' sockets, each its own link: checked as exec's,
from the counts its heartbeats give (`Heartbeat.concurrent`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.comm.channel import ControllerChannel
from asyncrl.comm.messages import CONCURRENT_THREADS
from asyncrl.comm.relay import RELAY_ROLES

if TYPE_CHECKING:
    from asyncrl.controller.group import RankInfo

LOST_AFTER = 3  # heartbeat timeouts


def lost_messages(channel: ControllerChannel, relay_of: dict[bytes, bytes], info: RankInfo,
                  heartbeat_timeout: float, now: float) -> str | None:
    """The rank's death, said, if messages on its links are lost; else None. `relay_of`:
    rank socket -> the host relay it reaches the controller through."""
    why = _why(channel, relay_of, info, LOST_AFTER * heartbeat_timeout, now)
    return None if why is None else (
        f"its connection to the controller lost messages: {why}. A TCP connection that broke "
        f"and was made again loses what was on the wire, and a call would wait for it for "
        f"ever (found with heartbeat_timeout={heartbeat_timeout:g} s)")


def _why(channel: ControllerChannel, relay_of: dict[bytes, bytes], info: RankInfo,
         grace: float, now: float) -> str | None:
    beat = info.beat
    if not beat.stamp_heard:  # (no heartbeat yet)
        return None
    if channel.watched(info.identity) is not None:  # reached directly
        return (_to(channel, info.identity, beat.io_heard, beat.io_received, 0.0,
                    beat.stamp_heard, grace, "its io socket")
                or _to(channel, info.exec_identity, beat.exec_heard, beat.exec_received,
                       beat.exec_idle_s, beat.stamp_heard, grace, "its exec socket")
                or _from(channel, info.exec_identity, beat.exec_sent, grace, now,
                         "its exec socket")
                or _from_concurrent(channel, info, grace, now))
    for role, (heard, received, sent) in zip(RELAY_ROLES, beat.relays, strict=False):
        # the host's relays it runs, always waiting for what the controller sends
        relay = relay_of.get(info.socket(role))
        name = f"the host's {role} relay it runs"
        why = relay and (_to(channel, relay, heard, received, float("inf"), beat.stamp_heard,
                             grace, name) or _from(channel, relay, sent, grace, now, name))
        if why:
            return why
    return None


def concurrent_sockets(info: RankInfo) -> list[tuple[bytes, int]]:
    """The sockets of the rank's concurrent calls its last heartbeat named (reached
    directly), each with how many it sent; names not of that form are ignored. A name
    given twice (two sockets made under one identity) is one socket here, with the most
    either sent: judged with each in turn, its `behind` would be reset every round."""
    group, rank, _, tag = info.identity.split(b"/")
    sent_by: dict[bytes, int] = {}
    for role, sent in info.beat.concurrent:
        identity = b"/".join((group, rank, role.encode(), tag))
        if role[:1] == "c" and role[1:].isdigit() and (
                identity in sent_by or len(sent_by) < CONCURRENT_THREADS):
            sent_by[identity] = max(sent, sent_by.get(identity, 0))
    return list(sent_by.items())


def _from_concurrent(channel: ControllerChannel, info: RankInfo, grace: float, now: float
                     ) -> str | None:
    for identity, sent in concurrent_sockets(info):
        channel.watch(identity)  # (unwatched with the rank's other sockets when it stops)
        why = _from(channel, identity, sent, grace, now, "a socket of its concurrent calls")
        if why:
            return why
    return None


def _to(channel: ControllerChannel, identity: bytes, heard: int, received: int,
        idle_s: float, stamp_heard: float, grace: float, name: str) -> str | None:
    """Lost on the way to a socket that had received up to `heard`, `received` in all, and
    waited `idle_s` for more, when its rank had the controller's heartbeat `stamp_heard`
    (its heartbeat says)."""
    unheard = channel.watched(identity)
    if unheard is None:
        return None
    sent = unheard.heard(heard)  # (what it received is forgotten here)
    if received < sent:
        return f"{sent - received} message(s) to {name} never came (a later one did)"
    if unheard.messages and idle_s >= grace:
        # the rank had the controller's heartbeat stamped `stamp_heard` (on its io link)
        # when it found the socket waiting: a message sent well before that is lost
        _, sent_at, leaves_in = unheard.messages[0]
        late = stamp_heard - sent_at
        if late >= grace + leaves_in:
            waited = "" if idle_s == float("inf") else \
                f", while the rank waited for one for {idle_s:.1f} s"
            return f"a message to {name} had not come {late:.1f} s after it was sent{waited}"
    return None


def _from(channel: ControllerChannel, identity: bytes, sent: int, grace: float, now: float,
          name: str) -> str | None:
    """Lost on the way from a socket that had sent `sent` (its rank's heartbeat says)."""
    unheard = channel.watched(identity)
    if unheard is None:
        return None
    last, skipped = channel.heard(identity)
    if skipped:
        return f"{skipped} message(s) from {name} never came (a later one did)"
    if sent <= last:
        unheard.behind = None
    elif unheard.behind is None or unheard.behind[0] <= last:
        unheard.behind = (sent, now)  # (or still behind, on later messages)
    elif now - unheard.behind[1] >= grace:
        return (f"{unheard.behind[0] - last} message(s) from {name} had not come "
                f"{now - unheard.behind[1]:.1f} s after its heartbeat said they were sent")
    return None
