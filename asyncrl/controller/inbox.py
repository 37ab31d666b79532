"""Inbox: what rank sockets (and the relays speaking for them) send the controller.

    Result / Results   -> the group that made the call (by call id)
    Fanin              a relay's bundle: each message as if its rank socket had sent it
    Hello, Ready       a rank starting: its sockets, then its built worker
    Heartbeat, Fetched, Log
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.comm import messages
from asyncrl.comm.messages import (
    Fanin,
    Fetched,
    Heartbeat,
    Hello,
    Log,
    Message,
    Ready,
    Result,
    Results,
)
from asyncrl.comm.relay import is_relay, pid_of
from asyncrl.controller.group import GroupHandle, RankInfo
from asyncrl.errors import RemoteError

log = logging.getLogger("asyncrl")

if TYPE_CHECKING:
    from asyncrl.controller.controller import Controller

_HELLO_ROLES = ("io", "exec")
_FROM_RANKS = (Heartbeat, Ready, Fetched, Log)  # straight from a rank's socket (with Result,
# Hello; Fanin from a relay)


@dataclass(slots=True)
class _Known:
    """A rank as its first hello (with its spawn's token) registered it: the last part of
    its sockets' names (pid and a nonce, `RankMain.tag`), its hellos' roles, and the relays
    they came through (none: straight)."""

    group: GroupHandle
    rank: int
    tag: bytes
    roles: set[str] = field(default_factory=set)
    relays: set[bytes] = field(default_factory=set)


class Inbox:
    """Takes a message only from the socket of a registered rank (its name's group, rank and
    tag as its hello registered them, through a relay its hellos came through), of a kind
    ranks send; the rest is dropped and counted: "unknown_sender" (a name of no group),
    "foreign" (another's socket, or one claiming another rank), "stale" (a group of the name
    now replaced), "unexpected" (a kind only the controller sends)."""

    def __init__(self, ctl: Controller):
        self._ctl = ctl
        self._known: dict[bytes, _Known] = {}  # b"group/rank" -> the rank
        self._speaks: dict[bytes, tuple[GroupHandle, set[int]]] = {}  # relay -> its ranks
        self._groups: set[GroupHandle] = set()  # those registered in the two

    def on_message(self, identity: bytes, msg: Message, relay: bytes | None = None) -> None:
        """One message from a rank socket (`relay`: the relay that brought it, if any)."""
        if isinstance(msg, Result):  # the most common: the shortest way
            known = self._sender(identity, relay)
            if known is None:
                return
            group = self._ctl.calls.get(msg.call_id)
            if msg.rank != known.rank or (group is not None and group is not known.group):
                self._ctl.channel.drop("foreign", identity)  # an answer for another rank,
                return  # or another group's call (call ids are a counter)
            if group is not None:
                info = group.ranks.get(msg.rank)
                if info is not None:  # (it answers: alive, whatever its heartbeats)
                    info.last_seen = time.monotonic()
                group._on_result(msg)
            return
        if isinstance(msg, Fanin):
            self.on_fanin(identity, msg)
            return
        if isinstance(msg, Hello):
            self._on_hello(identity, msg, relay)
            return
        if not isinstance(msg, _FROM_RANKS):  # what only the controller sends, or Results
            self._ctl.channel.drop("unexpected", identity)  # not from a relay
            return
        early = self._before_hello(identity) if isinstance(msg, Log) else None
        if isinstance(msg, Log) and early is not None:  # (a failure before its hello: its
            if self._ctl.logs is not None:  # traceback)
                self._ctl.logs.write(*early, msg.lines, msg.dropped)
            return
        known = self._sender(identity, relay)
        if known is None:
            return
        group, rank = known.group, known.rank
        if isinstance(msg, Heartbeat):
            info = group.ranks.get(rank)
            if info is not None:
                info.last_seen = time.monotonic()
                info.beat = msg
        elif isinstance(msg, Log):
            if self._ctl.logs is not None:
                self._ctl.logs.write(group.name, rank, msg.lines, msg.dropped)
        elif msg.rank != rank:  # a Ready or Fetched for another rank
            self._ctl.channel.drop("foreign", identity)
        elif isinstance(msg, Fetched):
            group.fetches.answered(msg)
        elif isinstance(msg, Ready):
            self._on_ready(group, identity, msg)

    def _before_hello(self, identity: bytes) -> tuple[str, int] | None:
        """(group, rank) of a log socket's rank that has not said hello yet (its output
        starts before: what a failure there prints is kept), of a running group's ranks
        (at most one log file each); None: registered, or no rank's name."""
        parts = identity.split(b"/")
        group = self._ctl.groups.get(parts[0].decode(errors="replace"))
        if group is None or len(parts) != 4 or parts[2] != b"log" or not parts[1].isdigit():
            return None
        known = self._known.get(parts[0] + b"/" + parts[1])
        rank = int(parts[1])
        if rank >= group.nprocs or known is not None and known.group is group and (
                "io" in known.roles):  # (logs go where the io hello went: through a relay,
            return None  # its exec hello may come first, by the other relay)
        return group.name, rank

    def _sender(self, identity: bytes, relay: bytes | None) -> _Known | None:
        """The registered rank whose socket sent this, or None (dropped, counted)."""
        parts = identity.rsplit(b"/", 2)  # group/rank, role, tag
        known = self._known.get(parts[0]) if len(parts) == 3 else None
        if known is not None and known.tag == parts[2] and \
                (relay is None or relay in known.relays):
            group = known.group
            if self._ctl.groups.get(group.name) is group:
                return known
            self._ctl.channel.drop("stale", identity)  # a group of the name replaced it
            return None
        name = identity.split(b"/", 1)[0].decode(errors="replace")
        self._ctl.channel.drop("foreign" if name in self._ctl.groups else "unknown_sender",
                               identity)
        return None

    def on_fanin(self, relay: bytes, msg: Fanin) -> None:
        """A relay's bundle: each message as if its rank socket had sent it here. A relay
        speaks for its own group's sockets only, those whose hellos it brought."""
        channel = self._ctl.channel
        if not is_relay(relay) or len(msg.senders) != len(msg.frames):
            channel.drop("malformed", relay)
            return
        name, rank, _, tag = relay.split(b"/")
        known = self._known.get(name + b"/" + rank)  # (a relay's name: its rank's tag)
        if known is not None and known.tag != tag and \
                self._ctl.groups.get(known.group.name) is known.group:
            channel.drop("foreign", relay)
            return
        prefix = name + b"/"
        for sender, frame in zip(msg.senders, msg.frames, strict=True):
            try:  # from a copy of its own: a small value kept (a call's inline result, held
                # as long as its ref) would else keep the relay's whole bundle in memory
                inner = messages.decode(bytes(frame))
            except Exception:  # noqa: BLE001 - as open_frame: whatever does not decode
                inner = None
            if inner is None or type(inner) is Fanin:
                channel.drop("undecodable", relay)
            elif type(inner) is Fetched:  # comes straight, its frames with it: never relayed
                channel.drop("unexpected", relay)
            elif not sender.startswith(prefix):
                channel.drop("foreign", relay)  # a relay claimed another group's socket
            else:
                try:  # each on its own, as if sent apart: one failing loses no other
                    self._on_relayed(sender, inner, relay)
                except Exception:  # noqa: BLE001 - as the channel's own dispatch
                    log.exception("asyncrl: handling %s from %r (relayed) failed",
                                  type(inner).__name__, sender)

    def _on_relayed(self, sender: bytes, inner: Message, relay: bytes) -> None:
        if type(inner) is not Results:
            self.on_message(sender, inner, relay)
            return
        group = self._ctl.calls.get(inner.call_id)  # (most of what relays bring)
        if group is None or self._sender(sender, relay) is None:  # (its last answer's)
            return
        spoken = self._speaks.get(relay)
        if spoken is None or spoken[0] is not group or not spoken[1].issuperset(inner.ranks):
            self._ctl.channel.drop("foreign", relay)  # answers for ranks it does not
            return  # speak for (another group's relay, or another host's ranks)
        group._on_results(inner)

    def _on_hello(self, identity: bytes, msg: Hello, relay: bytes | None) -> None:
        ctl = self._ctl
        group = ctl.groups.get(msg.group)
        parts = identity.split(b"/")
        if group is None or len(parts) != 4 or \
                parts[:3] != [msg.group.encode(), b"%d" % msg.rank, msg.role.encode()] or \
                pid_of(parts[3]) != b"%d" % msg.pid:  # a hello for another socket than its
            ctl.channel.drop("unknown_sender" if group is None else "foreign", identity)
            return
        if msg.role not in _HELLO_ROLES:
            ctl.channel.drop("unexpected", identity)
            return
        if msg.world_size != group.nprocs or not 0 <= msg.rank < group.nprocs or \
                group.closing or group.dead is not None:
            return
        if msg.spawn != ctl.spawn_tokens.get(group.name):  # an earlier group's rank
            ctl.channel.drop("stale", identity)
            return
        if not self._register(group, parts, msg.role, relay):
            return
        if relay is not None:  # from now on, what goes to this socket goes through it
            ctl.relay_of[identity] = relay
        info = group.ranks.get(msg.rank)
        if info is None:
            info = group.ranks[msg.rank] = RankInfo(msg.pid, msg.host, time.monotonic())
            group.agent.rank_started(msg.rank, msg.pid, msg.host, msg.launched)
        if msg.role == "io":
            info.identity, info.data_addr, info.gpu = identity, msg.data_addr, msg.gpu
        else:
            info.exec_identity = identity
        ctl.channel.watch(identity if relay is None else relay)  # (see lost.py)
        if group.started.done() or len(group.ranks) < group.nprocs or \
                not all(i.identity and i.exec_identity for i in group.ranks.values()):
            return
        # every rank said hello on both sockets (they passed the process group's rendezvous
        # before: the hellos come together): one Construct, which a relay gets once per host
        assert group.construct_msg is not None
        encoded, box = messages.encode(group.construct_msg), ctl.outbox()
        for rank in group.ranks.values():
            box.put(rank.exec_identity, encoded, group.construct_frames)
        box.flush()
        group.started.set_result(None)

    def _register(self, group: GroupHandle, parts: list[bytes], role: str,
                  relay: bytes | None) -> bool:
        """Record a rank's socket (its hello passed the token's check): its first says the
        tag all its sockets have; each role once. False: dropped."""
        if group not in self._groups:  # a group's first: what stopped groups left goes
            self.forget_stopped()
            self._groups.add(group)
        key, rank = parts[0] + b"/" + parts[1], int(parts[1])
        known = self._known.get(key)
        if known is None or known.group is not group:
            known = self._known[key] = _Known(group, rank, parts[3])
        elif known.tag != parts[3]:  # another process, claiming the rank
            self._ctl.channel.drop("foreign", b"/".join(parts))
            return False
        if role in known.roles:  # said before: the route it gave stays
            self._ctl.channel.drop("unexpected", b"/".join(parts))
            return False
        known.roles.add(role)
        if relay is not None:
            known.relays.add(relay)
            spoken = self._speaks.get(relay)
            if spoken is None or spoken[0] is not group:
                spoken = self._speaks[relay] = (group, set())
            spoken[1].add(rank)
        return True

    def forget_stopped(self) -> None:
        """Drop the registrations of groups no longer running (closed, dead, replaced)."""
        groups = self._ctl.groups
        gone = {g for g in self._groups if groups.get(g.name) is not g}
        if gone:
            self._groups -= gone
            self._known = {k: v for k, v in self._known.items() if v.group not in gone}
            self._speaks = {k: v for k, v in self._speaks.items() if v[0] not in gone}

    def _on_ready(self, group: GroupHandle, identity: bytes, msg: Ready) -> None:
        info = group.ranks.get(msg.rank)
        if info is None or info.ready or group.ready.done():
            return
        if identity != info.exec_identity:  # sent by the rank's exec socket alone (its
            self._ctl.channel.drop("stale", identity)  # Construct went there): another's, say
            return  # an earlier group's of the name

        if msg.error is not None:
            group.ready.set_exception(RemoteError(group.name, msg.rank, "__init__",
                                                  msg.error.type, msg.error.message,
                                                  msg.error.traceback))
            return
        info.ready = True
        group.methods = dict(msg.methods)
        if all(i.ready for i in group.ranks.values()) and len(group.ranks) == group.nprocs:
            group.construct_frames = []  # every rank has its arguments: the caller's again
            group.ready.set_result(None)
