"""Inbox: what rank sockets (and the relays speaking for them) send the controller.

    Result / Results   -> the group that made the call (by call id)
    Fanin              a relay's bundle: each message as if its rank socket had sent it
    Hello, Ready       a rank starting: its sockets, then its built worker
    Heartbeat, Fetched, Log
"""

from __future__ import annotations

import logging
import time
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


class Inbox:
    def __init__(self, ctl: Controller):
        self._ctl = ctl

    def on_message(self, identity: bytes, msg: Message, relay: bytes | None = None) -> None:
        """One message from a rank socket (`relay`: the relay that brought it, if any)."""
        ctl = self._ctl
        if isinstance(msg, Fanin):
            self.on_fanin(identity, msg)
            return
        if isinstance(msg, Result):
            group = ctl.calls.get(msg.call_id)
            if group is not None:
                if not identity.startswith(b"%s/%d/" % (group.name.encode(), msg.rank)):
                    ctl.channel.drop("foreign")  # an answer from a socket not the rank's
                    return  # (another group's rank, signed with the run's secret)
                info = group.ranks.get(msg.rank)
                if info is not None:  # (it answers: alive, whatever its heartbeats)
                    info.last_seen = time.monotonic()
                group._on_result(msg)
            return
        parts = identity.split(b"/")
        group = ctl.groups.get(parts[0].decode(errors="replace"))
        if group is None or len(parts) != 4 or not parts[1].isdigit():
            return  # (not a rank socket's name: nothing of a group's)
        rank = int(parts[1])
        info = group.ranks.get(rank)
        if info is not None and pid_of(parts[3]) != str(info.pid).encode() and \
                isinstance(msg, Heartbeat | Log):  # a rank of an earlier group of the name
            self._ctl.channel.drop("stale")  # (its hello was dropped): its beats must not
            return  # keep a hung one alive
        if isinstance(msg, Heartbeat):
            if info is not None:
                info.last_seen = time.monotonic()
                info.beat = msg
        elif isinstance(msg, Fetched):
            group.fetches.answered(msg)
        elif isinstance(msg, Hello):
            self._on_hello(group, identity, msg, relay)
        elif isinstance(msg, Ready):
            self._on_ready(group, identity, msg)
        elif isinstance(msg, Log) and ctl.logs is not None:
            ctl.logs.write(group.name, rank, msg.lines, msg.dropped)

    def on_fanin(self, relay: bytes, msg: Fanin) -> None:
        """A relay's bundle: each message as if its rank socket had sent it here. A relay
        speaks for its own group's sockets only."""
        channel = self._ctl.channel
        if not is_relay(relay) or len(msg.senders) != len(msg.frames):
            channel.drop("malformed")
            return
        prefix = relay.split(b"/", 1)[0] + b"/"
        for sender, frame in zip(msg.senders, msg.frames, strict=True):
            try:  # from a copy of its own: a small value kept (a call's inline result, held
                # as long as its ref) would else keep the relay's whole bundle in memory
                inner = messages.decode(bytes(frame))
            except Exception:  # noqa: BLE001 - as open_frame: whatever does not decode
                inner = None
            if inner is None or type(inner) is Fanin:
                channel.drop("undecodable")
            elif type(inner) is Fetched:  # comes straight, its frames with it: never relayed
                channel.drop("unexpected")
            elif not sender.startswith(prefix):
                channel.drop("foreign")  # a relay claimed another group's socket
            else:
                try:  # each on its own, as if sent apart: one failing loses no other
                    self._on_relayed(sender, inner, relay)
                except Exception:  # noqa: BLE001 - as the channel's own dispatch
                    log.exception("asyncrl: handling %s from %r (relayed) failed",
                                  type(inner).__name__, sender)

    def _on_relayed(self, sender: bytes, inner: Message, relay: bytes) -> None:
        if type(inner) is Results:  # most of what relays bring: the shortest way
            group = self._ctl.calls.get(inner.call_id)
            if group is not None and relay.startswith(group.name.encode() + b"/"):
                group._on_results(inner)
            elif group is not None:  # another group's relay answering this one's call
                self._ctl.channel.drop("foreign")
        else:
            self.on_message(sender, inner, relay)

    def _on_hello(self, group: GroupHandle, identity: bytes, msg: Hello,
                  relay: bytes | None) -> None:
        if msg.world_size != group.nprocs or not 0 <= msg.rank < group.nprocs or \
                group.closing or group.dead is not None:
            return
        if msg.spawn != self._ctl.spawn_tokens.get(group.name):  # an earlier group's rank
            self._ctl.channel.drop("stale")
            return
        if relay is not None:  # from now on, what goes to this socket goes through it
            self._ctl.relay_of[identity] = relay
        info = group.ranks.get(msg.rank)
        if info is None:
            info = group.ranks[msg.rank] = RankInfo(msg.pid, msg.host, time.monotonic())
            group.agent.rank_started(msg.rank, msg.pid, msg.host, msg.launched)
        if msg.role == "io":
            info.identity, info.data_addr, info.gpu = identity, msg.data_addr, msg.gpu
        elif msg.role == "exec":
            info.exec_identity = identity
        self._ctl.channel.watch(identity if relay is None else relay)  # (see lost.py)
        if group.started.done() or len(group.ranks) < group.nprocs or \
                not all(i.identity and i.exec_identity for i in group.ranks.values()):
            return
        # every rank said hello on both sockets (they passed the process group's rendezvous
        # before: the hellos come together): one Construct, which a relay gets once per host
        assert group.construct_msg is not None
        encoded, box = messages.encode(group.construct_msg), self._ctl.outbox()
        for rank in group.ranks.values():
            box.put(rank.exec_identity, encoded, group.construct_frames)
        box.flush()
        group.started.set_result(None)

    def _on_ready(self, group: GroupHandle, identity: bytes, msg: Ready) -> None:
        info = group.ranks.get(msg.rank)
        if info is None or info.ready or group.ready.done():
            return
        if identity != info.exec_identity:  # sent by the rank's exec socket alone (its
            self._ctl.channel.drop("stale")  # Construct went there): another's, say an
            return  # earlier group's of the name

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
