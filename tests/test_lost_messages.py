"""Messages lost between the controller and a rank (a TCP connection broke and ZeroMQ
connected again): the call that waits on one fails, naming the loss, instead of waiting for
ever. See asyncrl/controller/lost.py.

The controller's ROUTER loses them here: a message signed and counted as sent that never
leaves (to the rank), or frames dropped before they are read (from the rank) — as the wire
loses what was in flight when a connection breaks. The ranks are real processes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl.controller.lost import concurrent_sockets

HB = dict(heartbeat_interval=0.1, heartbeat_timeout=1.0)


class Echo(asyncrl.Worker):
    @asyncrl.register
    def echo(self, value):
        return value

    @asyncrl.register(concurrent=True)
    def peek(self):
        return self.rank

    @asyncrl.register
    def compute(self, seconds):  # a step that takes a while
        time.sleep(seconds)
        return self.rank


class _LosesToOne:
    """The ROUTER, losing the next `count` messages to one rank socket (those whose signed
    part holds `marker`)."""

    def __init__(self, sock: zmq.Socket, victim: bytes, count: int = 1, marker: bytes = b""):
        self.sock, self.victim, self.left, self.marker = sock, victim, count, marker
        self.parts: list = []

    def send(self, data, flags=0, copy=True):
        self.parts.append((data, flags, copy))
        if flags & zmq.SNDMORE:
            return
        parts, self.parts = self.parts, []
        if self.left and parts[0][0] == self.victim and self.marker in bytes(parts[1][0]):
            self.left -= 1
            return
        for data, flags, copy in parts:
            self.sock.send(data, flags, copy=copy)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _lose_from(channel, victim: bytes, count: int = 1, prefix: bool = False) -> list[int]:
    """Drop the next `count` messages from one rank socket (prefix: from those whose
    identity starts with `victim`) before the channel reads them; [how many are left]."""
    dispatch, left = channel._dispatch, [count]

    def losing(frames, handle):
        if left[0] and (frames[0].bytes.startswith(victim) if prefix else
                        frames[0].bytes == victim):
            left[0] -= 1
            return
        dispatch(frames, handle)
    channel._dispatch = losing
    return left


def _relay(ctl, group, role: str = "exec") -> bytes:
    """The identity of the host relay rank 0 runs for `role` (one host: the only one)."""
    return ctl.relay_of[group.ranks[0].socket(role)]


def _dies_of_a_loss(lose, calls: int = 1, call=lambda group, i: group.echo(i),
                    relay: bool = False, rank: int = 1):
    """Spawn two ranks, let `lose(ctl, group)` break one of their links, make `calls` calls:
    the first must fail with the group's death, naming `rank`, well before the test gives
    up (a later one may have been answered before it)."""
    async def main():
        async with asyncrl.Controller(**HB) as ctl:
            group = await ctl.spawn(Echo, nprocs=2, relay=relay)
            pids = group_pids(group)
            assert await group.echo(7) == [7, 7]
            lose(ctl, group)
            first, *later = [call(group, i) for i in range(calls)]
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio.wait_for(first, 30)
            for fut in later:
                with contextlib.suppress(asyncrl.GroupDeadError):
                    await fut
            return pids, info.value
    pids, error = run(main())
    assert_gone(pids)
    assert error.rank == rank and "connection to the controller lost messages" in str(error), \
        error
    return str(error)


def test_a_call_lost_on_its_way_to_a_rank_fails_the_group():
    said = _dies_of_a_loss(lambda ctl, group: setattr(
        ctl.channel, "_sock", _LosesToOne(ctl.channel._sock, group.ranks[1].exec_identity)))
    assert "to its exec socket had not come" in said  # found while the rank waited


def test_a_lost_call_with_a_later_one_received_is_found_at_once():
    said = _dies_of_a_loss(lambda ctl, group: setattr(
        ctl.channel, "_sock", _LosesToOne(ctl.channel._sock, group.ranks[1].exec_identity)),
        calls=2)
    assert "1 message(s) to its exec socket never came (a later one did)" in said


def test_a_concurrent_call_lost_on_its_way_to_a_rank_fails_the_group():
    """Its io socket's heartbeats come after it: the loss is found by the next one."""
    said = _dies_of_a_loss(lambda ctl, group: setattr(ctl.channel, "_sock", _LosesToOne(
        ctl.channel._sock, group.ranks[1].identity, marker=b"peek")),
        call=lambda group, i: group.peek())
    assert "message(s) to its io socket never came (a later one did)" in said


def test_a_result_lost_on_its_way_back_fails_the_group():
    said = _dies_of_a_loss(lambda ctl, group: _lose_from(ctl.channel,
                                                         group.ranks[1].exec_identity))
    assert "from its exec socket had not come" in said


def test_a_lost_result_with_a_later_one_received_is_found_at_once():
    said = _dies_of_a_loss(lambda ctl, group: _lose_from(ctl.channel,
                                                         group.ranks[1].exec_identity), calls=2)
    assert "1 message(s) from its exec socket never came (a later one did)" in said


@pytest.mark.parametrize("later", [False, True], ids=["last", "passed-over"])
def test_a_concurrent_calls_result_lost_on_its_way_back_fails_the_group(later):
    """A concurrent call's result comes from its pool thread's own socket (its own TCP
    link): lost, the call waited for ever; the rank's heartbeats now count what it sent."""
    # passed over: found when the later result comes, long before the grace (3 heartbeat
    # timeouts) would find the first missing (under load, the later one came after it)
    hb = dict(HB, heartbeat_timeout=5.0) if later else HB

    async def main():
        async with asyncrl.Controller(**hb) as ctl:
            group = await ctl.spawn(Echo, nprocs=2)
            pids = group_pids(group)
            assert await group.peek() == [0, 1]  # each rank's pool thread, and its socket
            left = _lose_from(ctl.channel, b"%s/1/c" % group.name.encode(), prefix=True)
            first = group.peek()
            if later:  # a later one from the same thread (idle again once its result went)
                await poll_until(lambda: left[0] == 0, 10, "the first result to be lost")
                second = group.peek()
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio.wait_for(first, 30)
            if later:
                with contextlib.suppress(asyncrl.GroupDeadError):
                    await second
            # the pool's threads that answered (each its socket): the second call runs on
            # the first's thread, idle again, unless a loaded host had not let it say so yet
            threads = len(concurrent_sockets(group.ranks[1]))
            return pids, str(info.value), threads
    pids, said, threads = run(main())
    assert_gone(pids)
    assert "rank 1" in said and "from a socket of its concurrent calls" in said, said
    if not later:
        assert "had not come" in said and "a later one did" not in said, said
    elif threads == 1:
        assert "never came (a later one did)" in said, said
    else:  # (a second thread started, and either thread may have run the second call)
        assert "never came (a later one did)" in said or "had not come" in said, said


@pytest.mark.parametrize("relay", [False, True])
def test_calls_queued_behind_a_long_one_are_not_taken_for_lost(relay):
    """Calls wait in the rank's socket while one runs for longer than the heartbeat timeout,
    and results come long after their calls went: none of that is a loss."""
    async def main():
        async with asyncrl.Controller(**HB) as ctl:
            group = await ctl.spawn(Echo, nprocs=2, relay=relay)
            long = group.compute(3.0)  # 3x the heartbeat timeout
            queued = [group.echo(i) for i in range(3)]
            assert await long == [0, 1]
            assert [await q for q in queued] == [[0, 0], [1, 1], [2, 2]]
            await asyncio.sleep(2.5)  # the ranks idle for longer than the timeout...
            after = await group.echo("after")  # ...then a call: their last beats said idle
            identity = _relay(ctl, group) if relay else group.ranks[1].exec_identity
            assert ctl.channel.watched(identity) is not None
            assert await group.peek() == [0, 1]  # a concurrent call's socket, reached
            # directly, is watched once a heartbeat names it (behind relays: none named)
            await poll_until(lambda: relay or concurrent_sockets(group.ranks[1]), 10,
                             "a heartbeat to name the concurrent call's socket")
            sockets = [s for s, _ in concurrent_sockets(group.ranks[1])]
            await poll_until(lambda: all(map(ctl.channel.watched, sockets)), 10,
                             "the supervisor to watch it")
        return group.dead, after, [ctl.channel.watched(s) for s in [identity, *sockets]]
    dead, after, unheard = run(main())
    assert dead is None and after == ["after", "after"]
    assert unheard == [None] * len(unheard) and len(unheard) == 1 + (not relay)  # forgotten


@pytest.mark.parametrize("lose", [
    lambda ctl, group: setattr(ctl.channel, "_sock", _LosesToOne(ctl.channel._sock,
                                                                 _relay(ctl, group))),
    lambda ctl, group: _lose_from(ctl.channel, _relay(ctl, group))], ids=["to", "from"])
def test_a_message_lost_between_the_controller_and_a_host_relay_fails_the_group(lose):
    """Behind relays, the host's relays are the ends of the TCP links: rank 0 runs them,
    and its heartbeats say how far they have got."""
    said = _dies_of_a_loss(lose, relay=True, rank=0)
    assert "the host's exec relay it runs had not come" in said


def test_a_message_behind_big_ones_to_other_ranks_is_given_their_time():
    """A small Call queued behind gigabytes the controller sent other ranks leaves after
    them: its own size gave it no time (16 ranks' copies of a 1 GB argument: all killed)."""
    from asyncrl.comm.channel import LINK_MIN_RATE, ControllerChannel
    from asyncrl.controller.lost import _to

    channel = ControllerChannel(b"k" * 32)
    try:
        channel.watch(b"g/0/exec/1")
        big = bytearray(50_000_000)
        for rank in range(1, 5):  # (to sockets not connected: the ROUTER drops them)
            channel.send_encoded(f"g/{rank}/exec/1".encode(), b"call", [big])
        channel.send_encoded(b"g/0/exec/1", b"call")
        (_, sent_at, leaves_in), = channel.watched(b"g/0/exec/1").messages
        assert leaves_in > 0.9 * 200e6 / LINK_MIN_RATE

        def lost(late: float) -> str | None:
            return _to(channel, b"g/0/exec/1", 0, 0, float("inf"), sent_at + late, 3.0, "it")
        assert lost(3.0 + 1) is None  # (its own bytes alone: lost after 3 s)
        assert "had not come" in lost(3.0 + leaves_in + 1)
    finally:
        channel.close()
