"""Host relays (Controller(relay=True)): a group's control messages go through one relay per
host, a thread of its local rank 0. Real torchrun groups; every call still behaves as a
direct one, a call's Results come up in one bundle per host, a failure is not held back
behind slower ranks, deaths and silences are still reported per rank, and the relay drops
what is not signed.

The worker class is defined in this file: the ranks load it by path."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl import Dispatch, TensorBatch
from asyncrl.comm import messages
from asyncrl.comm.auth import Signer, read_secret
from asyncrl.comm.messages import Fanin, Fanout, Result, Results


class Host(asyncrl.Worker):
    @asyncrl.register
    def ping(self, x):
        return [self.rank, x]

    @asyncrl.register(dispatch=Dispatch.ALL_TO_ALL)
    def plus_rank(self, x):
        return x + 100 * self.rank

    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def zero(self):
        return self.rank

    @asyncrl.register(dispatch=Dispatch.DP)
    def double(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": batch["x"] * 2, "dp": [self.rank] * len(batch)})

    @asyncrl.register(concurrent=True)
    def beside(self, x):
        return x + 1

    @asyncrl.register
    def tensor(self, n: int):
        return torch.full((n, 256), float(self.rank))

    @asyncrl.register
    def fail_or_wait(self, marker: str, failing: int = 1):
        """Rank `failing` fails at once; the others wait for `marker` (bounded)."""
        if self.rank == failing:
            raise ValueError("rank 1 fails at once")
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.path.exists(marker)

    @asyncrl.register
    def say(self, text: str):
        print(f"rank {self.rank}: {text}", flush=True)


def count_fanins(ctl: asyncrl.Controller) -> dict[int, list[str]]:
    """call id -> the answers to that call each Fanin brought, by kind: "Results" (all of a
    host's, in one message) or "Result" (one rank's) (a hook on the controller)."""
    bundles: dict[int, list[str]] = {}
    on_fanin = ctl.inbox.on_fanin

    def counting(relay: bytes, msg: Fanin) -> None:
        for m in map(messages.decode, msg.frames):
            if isinstance(m, (Result, Results)):
                bundles.setdefault(m.call_id, []).append(type(m).__name__)
        on_fanin(relay, msg)

    ctl.inbox.on_fanin = counting  # type: ignore[method-assign]
    return bundles


def test_relayed_group_answers_every_protocol_with_one_bundle_per_call():
    async def main():
        async with asyncrl.Controller(relay=True) as ctl:
            bundles = count_fanins(ctl)
            group = await ctl.spawn(Host, nprocs=3)
            relays = {ctl.relay_of[i.exec_identity] for i in group.ranks.values()}
            assert len(relays) == 1 and len(ctl.relay_of) == 6  # io + exec of 3 ranks
            assert next(iter(relays)).startswith(b"host/0/relay-exec/")  # rank 0's threads
            relays = {ctl.relay_of[i.identity] for i in group.ranks.values()}
            assert len(relays) == 1 and next(iter(relays)).startswith(b"host/0/relay-io/")
            bundles.clear()
            assert await group.ping(5) == [[0, 5], [1, 5], [2, 5]]
            assert await group.plus_rank([1, 2, 3]) == [1, 102, 203]
            assert await group.zero() == 0
            out = await group.double(TensorBatch({"x": torch.arange(7)}))
            assert out["x"].tolist() == [0, 2, 4, 6, 8, 10, 12]  # padding dropped, in order
            assert out["dp"] == [0, 0, 0, 1, 1, 2, 2]
            assert await group.beside(1) == [2, 2, 2]
            # every call: all of its answers (3, or rank 0's alone) came up in one message
            return bundles
    bundles = run(main())
    assert len(bundles) == 5 and all(b == ["Results"] for b in bundles.values()), bundles


def test_a_failing_rank_is_not_held_back_behind_its_waiting_host_peers(tmp_path):
    marker = tmp_path / "go"

    async def main():
        async with asyncrl.Controller(relay=True) as ctl:
            group = await ctl.spawn(Host, nprocs=3)
            with pytest.raises(asyncrl.RemoteError) as info:
                # ranks 0 and 2 still wait for the marker: the relay sent the failure on
                await asyncio.wait_for(group.fail_or_wait(str(marker)), 30)
            assert not marker.exists()
            marker.write_text("go")
            assert await group.ping(1) == [[0, 1], [1, 1], [2, 1]]  # order kept behind it
            return info.value
    err = run(main())
    assert (err.rank, err.method) == (1, "fail_or_wait")
    assert "rank 1 fails at once" in str(err)


def test_relayed_results_are_freed_on_every_rank_encrypted():
    async def main():
        async with asyncrl.Controller(relay=True, encrypt=True, heartbeat_interval=0.1) as ctl:
            group = await ctl.spawn(Host, nprocs=2)
            for _ in range(30):
                await group.tensor(64)  # each rank keeps 64 KiB; the future is dropped
            kept = group.tensor(64)
            value = await kept
            assert [t[0, 0].item() for t in value] == [0.0, 1.0]
            await poll_until(lambda: group.store_stats == {0: (1, 65536), 1: (1, 65536)}, 10,
                             "every rank to hold only the one live result")
            del kept
            await poll_until(lambda: group.store_stats == {0: (0, 0), 1: (0, 0)}, 10,
                             "every rank to free it")
    run(main())


@pytest.mark.parametrize("how,victim", [("kill", 2), ("stop", 2), ("stop", 0)])
def test_a_dead_or_silent_rank_behind_a_relay_is_named(how, victim):
    """Rank 0 runs the host's relays: when it stops, its host's ranks go silent with it,
    and it is the one named."""
    async def main():
        # (4 s: a rank is blamed for its host when its own heartbeat is 2 s old, which a
        # loaded machine's stall of 0.55 s made it at 1.5 s)
        async with asyncrl.Controller(relay=True, heartbeat_interval=0.2,
                                      heartbeat_timeout=4.0) as ctl:
            group = await ctl.spawn(Host, nprocs=3)
            pids = group_pids(group)
            await group.say("still here")
            await poll_until(lambda: f"rank {victim}: still here" in group.agent.tail(), 20,
                             "the rank's output thread to log its line")
            pending = group.fail_or_wait("/nonexistent", failing=-1)  # all wait 60 s
            os.kill(group.pids[victim], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio.wait_for(pending, 30)
            return pids, info.value
    pids, err = run(main())
    assert err.rank == victim, str(err)
    if how == "kill":  # torchrun's report (exit code) or the supervisor's (process gone)
        assert "signal 9" in str(err) or "its process is gone" in str(err), str(err)
    elif victim == 2:  # its heartbeats stopped although its host's others came through
        assert "no heartbeat" in str(err) and "relay" not in str(err), str(err)
    else:
        assert "no heartbeat" in str(err) and "it runs its host's relays" in str(err), str(err)
    assert f"rank {victim}: still here" in str(err)  # the last lines of its output
    assert_gone(pids)


def test_relay_drops_hostile_frames_and_the_controller_drops_false_claims():
    async def main():
        async with asyncrl.Controller(relay=True, heartbeat_interval=0.2) as ctl:
            group = await ctl.spawn(Host, nprocs=2)
            relay = ctl.relay_of[group.ranks[1].identity]  # io: heartbeats, releases...
            send = ctl.channel.send_frames  # the live ROUTER reaches the relay's live DEALER
            send([relay, b"garbage"])  # malformed
            send([relay, b"x" * 40, b"y" * 32])  # bad MAC
            forged = Signer(b"1" * 32).sign(b">" + relay, messages.encode(messages.Shutdown()))
            send([relay, *forged])  # bad MAC
            replay = ctl.channel._signer.sign(b">" + relay, messages.encode(messages.Heartbeat()))
            send([relay, *replay])  # valid, but a relay takes Fanouts only: dropped
            send([relay, *replay])  # replayed
            fanout = Fanout([group.ranks[1].identity], [0], [msgspec.Raw(messages.encode(
                messages.Shutdown()))], buffers=[1])  # a raw frame announced, none sent
            send([relay, *ctl.channel._signer.sign(b">" + relay, messages.encode(fanout))])
            await poll_until(lambda: group.dropped_frames[0] >= 6, 10,
                             "rank 0 to report its relay's drops")
            assert group.dropped_frames[0] == 6

            # signed Fanins with the run's secret from sockets that are not that group's relay
            secret = read_secret(str(ctl.secret_file))
            ctx, intruders = zmq.asyncio.Context(), []
            try:
                for identity, sender in ((b"host/0/io/1", b"host/0/io/1"),  # not a relay
                                         (b"host/7/relay-io/1", b"other/0/io/1")):  # foreign
                    intruder = ctx.socket(zmq.DEALER)
                    intruders.append(intruder)
                    intruder.setsockopt(zmq.IDENTITY, identity)
                    intruder.connect(ctl.channel.address)
                    fanin = Fanin([sender], [msgspec.Raw(messages.encode(messages.Shutdown()))])
                    await intruder.send_multipart(Signer(secret).sign(
                        identity, messages.encode(fanin)))
                await poll_until(lambda: ctl.dropped_frames.get("foreign") == 1 and
                                 ctl.dropped_frames.get("malformed") == 1, 10,
                                 f"the controller to drop both: {ctl.dropped_frames}")
            finally:
                for intruder in intruders:
                    intruder.close(0)
                ctx.term()
            assert await group.ping(2) == [[0, 2], [1, 2]]
            assert group.dead is None
    run(main())


def test_relay_refused_where_its_socket_path_cannot_fit(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # where the run's private folder goes

    async def main():
        async with asyncrl.Controller(relay=True) as ctl:
            with pytest.raises(ValueError, match="set TMPDIR to a shorter folder") as info:
                await ctl.spawn(Host, nprocs=2)
            assert "relay=False" in str(info.value) and not ctl.groups
            group = await ctl.spawn(Host, nprocs=1, relay=False)  # nothing was left behind
            assert await group.ping(1) == [[0, 1]]
    run(main())


def test_a_malformed_message_in_a_relays_bundle_loses_neither_the_others_nor_the_call(tmp_path):
    """A Results whose columns disagree is dropped before it touches the call (the ranks'
    real answers still complete it), and the messages after it in the same Fanin count."""
    marker = tmp_path / "go"

    async def main():
        async with asyncrl.Controller(relay=True) as ctl:
            group = await ctl.spawn(Host, nprocs=2)
            pending = asyncio.ensure_future(group.fail_or_wait(str(marker), failing=-1))
            await poll_until(lambda: bool(ctl.calls), 10, "the call to be sent")
            (call_id,) = ctl.calls
            none = msgspec.Raw(messages.encode(None))
            bad = Results(call_id, [0, 1], [none, none], [True, True], [-1], [], 0.0)
            io = group.ranks[1].identity
            ctl.inbox.on_fanin(ctl.relay_of[io], Fanin(
                [group.ranks[0].exec_identity, io],
                [msgspec.Raw(messages.encode(bad)),
                 msgspec.Raw(messages.encode(messages.Heartbeat(dropped=7)))]))
            assert group.ranks[1].beat.dropped == 7  # the message after the bad one counted (now)
            assert ctl.dropped_frames.get("malformed") == 1
            marker.touch()
            return await asyncio.wait_for(pending, 30)
    assert run(main()) == [True, True]


def test_a_relayed_small_result_does_not_keep_the_relays_whole_bundle():
    """A relay's Fanin holds whatever it read in one pass (other calls' answers, log lines):
    a call's small inline value, decoded from it, kept the whole body alive for as long as
    its ref lived."""
    from types import SimpleNamespace

    from asyncrl.comm.messages import Log
    from asyncrl.controller.inbox import Inbox

    kept = []
    group = SimpleNamespace(_on_results=kept.append)
    ctl = SimpleNamespace(calls={7: group}, channel=SimpleNamespace(drop=lambda why: None))
    answers = Results(7, [0], [msgspec.Raw(messages.encode(Log(["ok"])))], [True], [0], [],
                      0.0)
    noise = Log(["x" * 1000] * 1000)  # a megabyte of another rank's lines
    body = bytearray(messages.encode(Fanin([b"g/0/io/1.a", b"g/1/io/2.b"],
                                           [msgspec.Raw(messages.encode(answers)),
                                            msgspec.Raw(messages.encode(noise))])))
    fanin = messages.decode(body)
    inbox = Inbox(ctl)
    inbox._on_relayed = lambda sender, inner, relay: (  # (the log lines: not for here)
        group._on_results(inner) if type(inner) is Results else None)
    inbox.on_fanin(b"g/0/relay-io/1.r", fanin)
    del fanin
    assert len(kept) == 1 and bytes(kept[0].values[0]) == messages.encode(Log(["ok"]))
    body.extend(b"!")  # BufferError while anything still points into it


def test_a_silent_rank_running_its_hosts_relays_is_not_said_to_silence_the_others_alone():
    """The rank running a host's relays, silent alone, was named with "it runs its host's
    relays, so the host's other ranks go silent with it" while they spoke on: said only
    when another silent rank reaches the controller through it."""
    from types import SimpleNamespace

    from asyncrl.controller.supervisor import Supervisor

    relay = b"g/0/relay-io/1.r"
    ranks = {r: SimpleNamespace(identity=f"g/{r}/io/{r}.x".encode(), last_seen=100.0,
                                gone=False) for r in range(3)}
    ctl = SimpleNamespace(relay_of={info.identity: relay for info in ranks.values()},
                          heartbeat_timeout=3.0)
    supervisor = Supervisor(ctl)
    group = SimpleNamespace(ranks=ranks)
    assert supervisor.culprit(group, [0], 101.0) == (0, "")  # the others spoke at 100
    assert not supervisor.falling_silent_behind(group, [0], 101.0)  # so it is named now


def test_a_silent_relay_runner_is_named_a_round_later_when_the_ranks_behind_it_fall_silent():
    """Stopping the rank that runs a host's relays silences the ranks behind it a moment
    after its own last heartbeat: it crossed the timeout alone and was named without its
    reason (test_a_dead_or_silent_rank_behind_a_relay_is_named[stop-0], 1 run in 4).
    While they are past half the timeout it waits a round, then names it with them."""
    from types import SimpleNamespace

    from asyncrl.controller.supervisor import Supervisor

    relay = b"g/0/relay-io/1.r"
    ranks = {r: SimpleNamespace(identity=f"g/{r}/io/{r}.x".encode(), last_seen=100.0 + r / 10,
                                gone=False) for r in range(3)}
    ctl = SimpleNamespace(relay_of={info.identity: relay for info in ranks.values()},
                          heartbeat_timeout=3.0)
    supervisor, group = Supervisor(ctl), SimpleNamespace(ranks=ranks)
    assert supervisor.falling_silent_behind(group, [0], 103.1)  # 1 and 2: 2.9 and 2.8 s
    assert not supervisor.falling_silent_behind(group, [2], 103.3)  # 2 runs no relay
    assert not supervisor.falling_silent_behind(group, [0, 1, 2], 103.4)  # all silent: name
    rank, why = supervisor.culprit(group, [0, 1, 2], 103.4)
    assert rank == 0 and "runs its host's relays" in why
    ranks[2].gone = True  # a rank gone is named as such, not waited for
    ranks[1].last_seen = 103.0  # one heard lately: the runner's relay works
    assert not supervisor.falling_silent_behind(group, [0], 103.1)
    rank, why = supervisor.culprit(group, [2], 105.0)  # the runner silent too, by then
    assert rank == 0 and "runs its host's relays" in why
