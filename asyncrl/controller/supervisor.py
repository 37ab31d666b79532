"""Supervisor: heartbeats out, dead or silent ranks in. A group whose rank dies is marked
dead with the rank named and why, and whatever is left of it is killed.

    every heartbeat_interval: one Heartbeat to every rank (one frame per relayed host);
    a local rank whose pid is gone, or any rank silent for heartbeat_timeout, ends its group
    so do messages lost on a rank's links (see lost.py)
    the torchrun agent's exit (watcher thread -> loop): the root cause torchrun reported
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import TYPE_CHECKING

from asyncrl.comm import messages
from asyncrl.comm.messages import Heartbeat
from asyncrl.controller.launcher import pid_alive
from asyncrl.controller.lost import lost_messages

if TYPE_CHECKING:
    from asyncrl.controller.controller import Controller
    from asyncrl.controller.group import GroupHandle
    from asyncrl.controller.outbox import Outbox

log = logging.getLogger("asyncrl")


class Supervisor:
    def __init__(self, ctl: Controller):
        self._ctl = ctl
        self._skipped = False  # the last round judged no silence (the loop had been busy)

    async def run(self) -> None:
        while True:
            slept = time.monotonic()
            await asyncio.sleep(self._ctl.heartbeat_interval)
            # the loop busy (a node's own work on it) for longer than an interval: the ranks'
            # heartbeats of that time wait unread, and a silence now would be the loop's
            busy = time.monotonic() - slept > 2 * self._ctl.heartbeat_interval
            self._skipped = busy and not self._skipped  # (one round only: a loop busy all
            try:                                        # the time still finds a hung rank)
                self.check(judge=not self._skipped)
            except Exception:  # a bug here must not stop the heartbeats
                log.exception("asyncrl supervisor: checking the ranks failed")

    def check(self, judge: bool = True) -> None:
        """Send one round of heartbeats; declare ranks whose process is gone or (`judge`)
        silent."""
        ctl = self._ctl
        now, here = time.monotonic(), socket.gethostname()
        beat = messages.encode(Heartbeat(stamp=now))
        box = ctl.outbox()
        for group in list(ctl.groups.values()):
            if group.closing or group.dead is not None:
                continue
            try:
                self.check_group(group, box, beat, judge, now, here)
            except Exception:  # one group's failure must not cost the others their heartbeats
                log.exception("asyncrl supervisor: checking group %r failed", group.name)
        box.flush()

    def check_group(self, group: GroupHandle, box: Outbox, beat: bytes, judge: bool,
                    now: float, here: str) -> None:
        """Put the group's heartbeats in `box`; declare it dead if a rank of it is."""
        ctl = self._ctl
        group.post_all(box, "io", beat)
        silent, lost = [], None
        for rank, info in list(group.ranks.items()):
            if info.host == here and not info.gone and not pid_alive(info.pid):
                info.gone = True
                ctl.loop.create_task(self.rank_gone(group, rank))
            elif judge and not info.gone and now - info.last_seen > ctl.heartbeat_timeout:
                silent.append(rank)
            elif judge and not info.gone and lost is None:
                why = lost_messages(ctl.channel, ctl.relay_of, info, ctl.heartbeat_timeout, now)
                lost = None if why is None else (rank, why)
        if lost is not None and not silent and not any(  # (a death named as such)
                i.gone for i in group.ranks.values()):
            group._mark_dead(lost[0], None, lost[1])
            group.agent.signal_all(signal.SIGKILL)
        if silent and not self.falling_silent_behind(group, silent, now):
            rank, why = self.culprit(group, silent, now)
            group._mark_dead(rank, None, f"no heartbeat for "
                             f"{now - group.ranks[rank].last_seen:.1f} s (heartbeat_timeout="
                             f"{ctl.heartbeat_timeout} s){why}")
            group.agent.signal_all(signal.SIGKILL)

    def falling_silent_behind(self, group: GroupHandle, silent: list[int], now: float) -> bool:
        """Whether a silent rank runs relays that ranks not yet past the timeout, but past
        half of it, reach the controller through: they are going silent with it (their last
        heartbeats came through it a moment later), and naming it a round later, when they
        are silent too, names it with its reason."""
        ctl, half = self._ctl, self._ctl.heartbeat_timeout / 2
        for rank, info in group.ranks.items():
            relay = ctl.relay_of.get(info.identity)
            if (relay is not None and rank not in silent and not info.gone
                    and int(relay.split(b"/")[1]) in silent and now - info.last_seen > half):
                return True
        return False

    def culprit(self, group: GroupHandle, silent: list[int], now: float) -> tuple[int, str]:
        """Which of the silent ranks to name: the rank whose process runs the relays a
        silent rank reaches the controller through, if that rank is falling silent too (its
        silence silences its host: all go quiet together, and it may not have crossed the
        timeout yet when another has); else the first."""
        ctl = self._ctl
        for rank in silent:
            relay = ctl.relay_of.get(group.ranks[rank].identity)
            if relay is None:
                continue
            runner = int(relay.split(b"/")[1])
            info = group.ranks.get(runner)
            if runner != rank and info is not None and (runner in silent or
                                     now - info.last_seen > ctl.heartbeat_timeout / 2):
                return runner, ("; it runs its host's relays, so the host's other ranks go "
                                "silent with it")
        return silent[0], ""

    async def rank_gone(self, group: GroupHandle, rank: int) -> None:
        """A rank's process is gone: give torchrun a moment to report why, then declare."""
        # torchrun notices within its monitor interval and reports the exit code; declared
        # within the heartbeat timeout either way
        ctl = self._ctl
        wait = max(1.0, ctl.heartbeat_timeout - 2 * ctl.heartbeat_interval)
        try:
            await asyncio.wait_for(group.exited.wait(), wait)
        except asyncio.TimeoutError:
            if group.dead is None:
                culprit = self.first_gone(group, rank)
                code = group.agent.exit_seen(culprit)  # (a forked rank's, from its server)
                group._mark_dead(culprit, code, "its process is gone" if code is None else
                                 "its process exited")
        group.agent.signal_all(signal.SIGKILL)

    def first_gone(self, group: GroupHandle, rank: int) -> int:
        """Which gone rank to name: one torchrun did not stop itself. When one rank dies,
        torchrun stops the others, and a loaded host may let the supervisor see them all
        gone in one round, the followers first."""
        stopped = group.agent.stopped_pids()
        if group.ranks[rank].pid not in stopped:
            return rank
        causes = [r for r, info in group.ranks.items() if info.gone and info.pid not in stopped]
        return causes[0] if causes else rank

    def agent_exited(self, group: GroupHandle, code: int) -> None:
        """The group's torchrun agent exited (on the loop, called from its watcher thread)."""
        group.exited.set()
        if group.closing:
            return
        cause = group.agent.root_cause()
        if cause is not None:
            group._mark_dead(cause[0], cause[1], "its process exited; torchrun stopped the group")
        else:
            group._mark_dead(None, code, f"the torchrun agent exited with code {code}")
        group.agent.signal_all(signal.SIGKILL)  # leave nothing behind
