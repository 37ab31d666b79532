"""Garbage, unsigned, forged, replayed and undecodable frames thrown at both live sockets —
the controller's ROUTER and a rank's DEALER — are dropped and counted; calls still work.
The seeded fuzzer (benchmarks/fuzz.py) runs here for a bounded number of frames."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from helpers import ROOT, assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm import codec, messages
from asyncrl.comm.auth import Signer, read_secret


class Adder(asyncrl.Worker):
    @asyncrl.register
    def add(self, a, b):
        return a + b


def test_controller_socket_drops_hostile_frames():
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Adder, nprocs=1)
            pids = group_pids(group)
            host, port = ctl.channel.address.rsplit(":", 1)
            raw = socket.create_connection((host[len("tcp://"):], int(port)))
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)  # not even ZMTP
            raw.close()

            ctx = zmq.asyncio.Context()
            intruder = ctx.socket(zmq.DEALER)
            intruder.setsockopt(zmq.IDENTITY, b"pair/0/io/1")
            intruder.connect(ctl.channel.address)
            await intruder.send(b"one garbage frame")  # malformed: 1 part
            await intruder.send_multipart([b"x" * 40, b"y" * 32])  # bad MAC
            forged = Signer(b"0" * 32).sign(b"pair/0/io/1", messages.encode(messages.Shutdown()))
            await intruder.send_multipart(forged)  # signed with the wrong key: bad MAC
            good = Signer(read_secret(str(ctl.secret_file)))
            hb = good.sign(b"pair/0/io/1", messages.encode(messages.Heartbeat()))
            await intruder.send_multipart(hb)  # valid once (ignored: no such group)
            await intruder.send_multipart(hb)  # replayed
            await intruder.send_multipart(good.sign(b"pair/0/io/1", b"\xc1\xff not msgpack"))
            # a message of 200,000 empty parts: read over several turns, kept in part
            await intruder.send_multipart([b""] * 200_000)
            await poll_until(lambda: ctl.dropped_frames.get("too_many_parts") == 1, 30,
                             "the last frame to be dropped")  # frames of one peer stay in order
            intruder.close(0)
            ctx.term()
            dropped = ctl.dropped_frames
            # the raw bytes may parse as ZMTP 1.0 frames: dropped too, in some number
            assert dropped["malformed"] >= 1 and dropped["bad_mac"] >= 2
            assert dropped["replay"] == 1 and dropped["undecodable"] == 1
            assert dropped["unknown_sender"] == 1  # the heartbeat: signed, of no group
            assert await group.add(2, 3) == [5]
            return pids
    assert_gone(run(main()))


def test_rank_socket_drops_hostile_frames():
    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=5) as ctl:
            group = await ctl.spawn(Adder, nprocs=1)
            pids = group_pids(group)
            rank_io = group.ranks[0].identity
            send = ctl.channel.send_frames  # the live ROUTER reaches the rank's live DEALER
            send([rank_io, b"garbage"])  # malformed
            send([rank_io, b"x" * 40, b"y" * 32])  # bad MAC
            forged = Signer(b"1" * 32).sign(b">" + rank_io, messages.encode(messages.Shutdown()))
            send([rank_io, *forged])  # a forged Shutdown: bad MAC
            replay = ctl.channel._signer.sign(b">" + rank_io, messages.encode(messages.Heartbeat()))
            send([rank_io, *replay])
            send([rank_io, *replay])  # replayed
            junk = ctl.channel._signer.sign(b">" + rank_io, b"\xc1 not a message")
            send([rank_io, *junk])  # undecodable
            beat = ctl.channel._signer.sign(b">" + rank_io, messages.encode(messages.Heartbeat()))
            send([rank_io, *beat, b"raw"])  # raw frames on a message that has none: malformed
            call = messages.Call(1, "add", msgspec.Raw(codec.encode_call((1, 1), {}, [])),
                                 buffers=[8])
            send([rank_io, *ctl.channel._signer.sign(b">" + rank_io, messages.encode(call)),
                  b"four"])  # a Call whose raw frame is not the size it announced: malformed
            call = messages.Call(2, "add", msgspec.Raw(codec.encode_call((1, 1), {}, [])),
                                 frames=[b"x" * 8])  # frames are what arrived, never sent
            send([rank_io, *ctl.channel._signer.sign(b">" + rank_io, messages.encode(call))])
            build = messages.Construct(msgspec.Raw(codec.encode_call((Adder,), {}, [])), [],
                                       buffers=[8])
            send([rank_io, *ctl.channel._signer.sign(b">" + rank_io, messages.encode(build)),
                  b"four"])  # so with a Construct's
            await poll_until(lambda: group.dropped_frames[0] >= 9, 10,
                             "the rank to report drops")
            assert group.dropped_frames[0] == 9
            # signed and well formed, but no mesh of the group's ranks: the built rank says
            # so (ignored now) and its in-order calls go on
            rank_exec = group.ranks[0].exec_identity
            build = messages.Construct(msgspec.Raw(codec.encode_call((Adder,), {}, [])),
                                       [("dp", 0)])
            send([rank_exec, *ctl.channel._signer.sign(b">" + rank_exec,
                                                       messages.encode(build))])
            assert await asyncio.wait_for(group.add(1, 1), 30) == [2]  # the forged Shutdown
            # did nothing
            assert group.dead is None
            return pids
    assert_gone(run(main()))


def test_fuzzer_for_a_bounded_number_of_frames_crashes_nothing():
    """benchmarks/fuzz.py, seeded and short: every socket survives, calls still succeed."""
    out = subprocess.run([sys.executable, "benchmarks/fuzz.py", "--frames", "1500", "--seed",
                          "7"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["frames"], result["crashes"]) == (1500, 0)
    dropped = result["dropped"]
    assert sum(dropped["controller"].values()) > 0 and dropped["rank"] > 0  # they got there
    assert dropped["relay"] > 0


def test_a_message_whose_frame_cannot_be_sent_leaves_the_next_one_whole():
    """A frame that is not a buffer failed after the identity, body and MAC had gone with
    "more to come": the ROUTER's next message, to any rank, was appended to that open one,
    and both were lost. Frames are checked before the first part goes."""
    from asyncrl.comm.channel import ControllerChannel

    channel = ControllerChannel(b"s" * 32)
    ctx = zmq.Context()
    ranks = {}
    try:
        for name in (b"A", b"B"):
            sock = ranks[name] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(channel.address)
            sock.send(b"hello")  # the ROUTER knows the route once this is in
            assert channel._sock.recv_multipart() == [name, b"hello"]
        with pytest.raises(TypeError):
            channel.send_encoded(b"A", b"for-a", [object()])
        channel.send_encoded(b"B", b"for-b")
        assert ranks[b"B"].poll(10_000)
        body, mac = ranks[b"B"].recv_multipart()  # whole, and nothing appended to it
        assert body.endswith(b"for-b") and not ranks[b"B"].poll(0)
        assert not ranks[b"A"].poll(100)  # nothing of the refused message went
    finally:
        for sock in ranks.values():
            sock.close(0)
        ctx.term()
        channel.close()


def test_a_message_the_ranks_io_thread_fails_on_does_not_end_it(monkeypatch, capsys):
    """A message whose handling raised (no thread to be had for a fetch, a link that would
    not close) ended the rank's io thread: its heartbeats stopped, the controller reported
    a silence instead of the traceback, and Shutdown was never read."""
    import functools
    from types import SimpleNamespace

    from asyncrl.actors.rank_main import RankMain
    from asyncrl.comm import nccl
    from asyncrl.comm.messages import PeersGone, Shutdown

    def broken(group):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(nccl, "forget_group", broken)
    inbox = [PeersGone("other", [], 0, "closed"), Shutdown()]
    sent = []

    class Store(list):
        nbytes = 0
    rank = SimpleNamespace(io=SimpleNamespace(recv=lambda ms: inbox.pop(0) if inbox else None,
                                              send=sent.append, heard=0, received=0),
                           hello=lambda role: "hello", exec_loop=lambda: None,
                           hb_interval=0.05, hb_timeout=60.0, taken=False, controller="",
                           dropped=0, store=Store(), gone=SimpleNamespace(add=lambda m: None),
                           exec_seen=(0.0, 0, 0), exec=SimpleNamespace(sent=0), stamp_heard=0.0,
                           relays=[], concurrent_socks=[], beside=[])
    rank.on_io = functools.partial(RankMain.on_io, rank)
    rank.heartbeat = functools.partial(RankMain.heartbeat, rank)
    assert RankMain.serve(rank) == 0  # Shutdown read after the failure
    assert "can't start new thread" in capsys.readouterr().err


class Describes(asyncrl.Worker):
    @asyncrl.register
    def big(self, odd: bool) -> TensorBatch:  # past the inline limit: kept, described
        return TensorBatch({"x\udcff" if odd else "x": torch.zeros(20_000, 4)})


def test_a_result_its_rank_cannot_describe_fails_the_call_and_the_control_plane_holds():
    """A column name msgpack refuses (a lone surrogate from os.fsdecode) made the Result
    unsendable after the rank kept the value: nothing went, the call waited for ever while
    heartbeats said the rank was fine. And a flood of frames kept the controller's loop in
    its reader until the last one; a frame the controller sent, bounced back to it under its
    own route, was taken."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Describes, nprocs=1)
            pids = group_pids(group)
            with pytest.raises(asyncrl.RemoteError, match="big's result cannot be described "
                                                          "to the controller"):
                await asyncio.wait_for(group.big(True), 60)
            assert len((await group.big(False))[0]) == 20_000  # the rank goes on

            ctx = zmq.Context()
            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.SNDHWM, 0)
            flood.connect(ctl.channel.address)
            for _ in range(100_000):
                flood.send_multipart([b"x" * 40, b"y" * 32])
            await poll_until(lambda: ctl.dropped_frames.get("bad_mac", 0) > 0, 30,
                             "the flood to reach the controller")
            turn = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(turn.set_result, None)
            await turn  # the loop's turn, while the flood is still read
            read = ctl.dropped_frames["bad_mac"]
            bounced = ctl.channel._signer.sign(b">" + group.ranks[0].identity,
                                               messages.encode(messages.Heartbeat()))
            spoof = ctx.socket(zmq.DEALER)
            spoof.setsockopt(zmq.IDENTITY, b">" + group.ranks[0].identity)
            spoof.connect(ctl.channel.address)
            malformed = ctl.dropped_frames.get("malformed", 0)
            spoof.send_multipart(bounced)
            await poll_until(lambda: ctl.dropped_frames.get("malformed", 0) > malformed, 30,
                             "the bounced frame to be dropped")
            for sock in (flood, spoof):
                sock.close(0)
            ctx.term()
            return pids, read
    pids, read = run(main(), timeout=120)
    assert_gone(pids)
    assert read < 100_000  # the loop had its turn before the last frame was read


def test_one_turn_of_the_controllers_reader_takes_a_bounded_number_of_messages():
    """Its reader read until the socket ran dry: a flood, signed or not, kept the loop there
    (no heartbeat, no call) until its last frame. A turn now takes DRAIN_MAX and leaves the
    rest to the next turn of the loop (ZeroMQ's descriptor would not say they are there)."""
    from asyncrl.comm import channel

    class Endless:  # a socket that never runs dry: a frame of one part each time
        closed = False

        def recv(self, flags, copy):
            return type("Frame", (), {"more": False})()

    ch = object.__new__(channel.ControllerChannel)
    ch._sock, ch._scheduled, ch._partial, ch._excess = Endless(), False, [], 0
    ch._handle = lambda identity, msg: None
    seen: list = []
    ch._dispatch = lambda frames, handle: seen.append(frames)
    later: list = []
    ch._loop = type("Loop", (), {"call_soon": lambda self, fn: later.append(fn)})()
    ch._drain()
    assert len(seen) == channel.DRAIN_MAX and later == [ch._drain] and ch._scheduled


def test_one_turn_of_the_reader_takes_a_bounded_number_of_parts_of_one_message():
    """A message of a million empty parts was read whole in one turn (DRAIN_MAX counted
    messages) and given a view per part before its signature was checked: seconds of a
    blocked loop, half a GB. A turn now reads DRAIN_PARTS parts, the message goes on in the
    next, and parts past MAX_PARTS are read and dropped with it."""
    from asyncrl.comm import channel
    from asyncrl.comm.auth import Verifier

    class Endless:  # one message whose parts never end (until `last` ends it)
        closed, reads, last = False, 0, None

        def recv(self, flags, copy):
            if self.last is not None and self.reads >= self.last:
                raise zmq.Again()  # the socket is dry after the message's last part
            self.reads += 1
            if self.reads > 3 * channel.DRAIN_PARTS + channel.MAX_PARTS:
                raise AssertionError("read past the turn's budget")
            return type("Frame", (), {"more": self.reads != self.last, "bytes": b"route"})()

    ch = object.__new__(channel.ControllerChannel)
    sock = Endless()
    ch._sock, ch._scheduled, ch._partial, ch._excess = sock, False, [], 0
    ch._handle, ch._verifier = (lambda identity, msg: None), Verifier(b"s" * 32)
    seen: list = []
    ch._dispatch = lambda frames, handle: seen.append(frames)
    later: list = []
    ch._loop = type("Loop", (), {"call_soon": lambda self, fn: later.append(fn)})()
    ch._drain()
    assert sock.reads == channel.DRAIN_PARTS and later == [ch._drain] and not seen
    while sock.reads < channel.MAX_PARTS + channel.DRAIN_PARTS:
        ch._drain()  # (turns of the loop)
    assert len(ch._partial) == channel.MAX_PARTS and ch._excess > 0  # the rest not kept
    sock.last = sock.reads + 1
    ch._drain()
    assert not seen and ch._verifier.dropped == {"too_many_parts": 1}
    assert ch._partial == [] and ch._excess == 0  # the next message starts afresh


def test_a_relay_holds_an_answer_for_its_senders_rank_only():
    """A relay took a held call's answer for the rank the message named, not the rank of
    the socket that sent it: rank 1 answering as rank 0 marked rank 0 answered."""
    from asyncrl.comm.auth import Verifier
    from asyncrl.comm.relay import HostRelay

    relay = object.__new__(HostRelay)
    relay._group, relay._verifier = b"g", Verifier(b"s" * 32)
    relay._held = {7: ({0, 1}, [])}

    def answer(sender: bytes, rank: int):
        return relay._release(sender, memoryview(messages.encode(messages.Result(7, rank))))
    assert answer(b"g/1/exec/1.00", 0) == [] and relay._verifier.dropped == {"foreign": 1}
    assert answer(b"h/0/exec/1.00", 0) == [] and relay._verifier.dropped["foreign"] == 2
    assert answer(b"g/1/exec/1.00", 1) == []  # rank 0 has still to answer
    (sender, body), = answer(b"g/0/exec/2.00", 0)
    assert messages.decode(body).ranks == [1, 0]


def test_drops_are_said_once_a_reason_then_at_most_every_30_seconds(caplog, monkeypatch):
    """Verifier.drop only counted: a flood (or a misconfigured peer) was silent."""
    from asyncrl.comm import auth

    now = [1000.0]
    monkeypatch.setattr(auth, "monotonic", lambda: now[0], raising=False)
    verifier = auth.Verifier(b"s" * 32)
    route = b"x/0/io/" + b"n" * 200
    with caplog.at_level("WARNING", logger="asyncrl"):
        for _ in range(1000):
            verifier.verify(route, [b"\0" * 40, b"y" * 32])
        said = [r.getMessage() for r in caplog.records if "bad_mac" in r.getMessage()]
        # its group/rank/role only: a route's tag proves a socket is that rank's
        assert len(said) == 1 and "from x/0/io:" in said[0] and "nnn" not in said[0]
        now[0] += auth.WARN_EVERY_S
        verifier.verify(route, [b"\0" * 40, b"y" * 32])
    said = [r.getMessage() for r in caplog.records if "bad_mac" in r.getMessage()]
    assert len(said) == 2 and "1001 dropped for this reason (1000 since last said)" in said[1]


def test_a_frame_is_checked_before_its_parts_are_copied_or_viewed():
    """The controller copied a message's body (and MAC) and made a view of each raw part
    before checking its signature: an unsigned message cost a copy of all it sent."""
    from asyncrl.comm import channel
    from asyncrl.comm.auth import Verifier

    class Untouched:  # a raw part that must not be looked at before the signature passed
        def __len__(self):
            return 4

        def __getattr__(self, name):
            raise AssertionError(f"{name} of a raw part read before the signature passed")

    secret, route = b"s" * 32, b"g/0/fetch/1.00"
    ch = object.__new__(channel.ControllerChannel)
    ch._verifier, ch._parts, got, checked = Verifier(secret), False, [], []
    verify = ch._verifier.verify
    ch._verifier.verify = lambda r, parts: checked.append(parts) or verify(r, parts)
    fetched = messages.encode(messages.Fetched(1, 0, buffers=[4]))
    body, _ = Signer(secret).sign(route, fetched)
    unsigned = [zmq.Frame(route), zmq.Frame(body), zmq.Frame(b"m" * 32), Untouched()]
    ch._dispatch(unsigned, lambda identity, msg: got.append(msg))
    assert ch._verifier.dropped == {"bad_mac": 1} and got == []
    # checked where zmq received them, not on copies
    assert [part.obj for part in checked[0]] == unsigned[1:3]
    signed = [zmq.Frame(route), *map(zmq.Frame, Signer(secret).sign(route, fetched)),
              zmq.Frame(b"four")]
    ch._dispatch(signed, lambda identity, msg: got.append(msg))
    assert [(bytes(f), f.obj) for f in got[0].frames] == [(b"four", signed[3])]


def test_an_encrypted_frame_goes_in_parts_and_only_its_own_cuts_are_joined(monkeypatch):
    """On a CURVE socket a raw frame went as one part, which CURVE encrypts whole on the
    context's one I/O thread (384 MiB held the heartbeats past 0.5 s): it goes in parts of
    PART_BYTES, joined on receipt only where they are the cuts the signed sizes say."""
    from asyncrl.comm import channel
    from asyncrl.comm.auth import Verifier

    monkeypatch.setattr(channel, "PART_BYTES", 8)
    frames = [bytes(range(20)), b"", bytes(range(8)), b"xyz"]
    parts = channel.in_parts(frames)
    assert [len(p) for p in parts] == [8, 8, 4, 0, 8, 3]
    assert [bytes(f) for f in channel.joined(parts, [20, 0, 8, 3])] == frames
    assert channel.joined(parts, [21, 0, 8, 2]) is None  # another cut of as many parts
    assert channel.joined(parts[1:], [20, 0, 8, 3]) is None  # a part short
    secret, route = b"s" * 32, b"g/0/fetch/1.00"
    ch = object.__new__(channel.ControllerChannel)
    ch._verifier, ch._parts, got = Verifier(secret), True, []
    fetched, signer = messages.encode(messages.Fetched(1, 0, buffers=[20, 3])), Signer(secret)
    signed = [zmq.Frame(route), *map(zmq.Frame, signer.sign(route, fetched))]
    ch._dispatch([*signed, *map(zmq.Frame, channel.in_parts(frames[:1] + frames[3:]))],
                 lambda identity, msg: got.append(msg))
    assert [bytes(f) for f in got[0].frames] == [frames[0], b"xyz"]
    ch._dispatch([zmq.Frame(route), *map(zmq.Frame, signer.sign(route, fetched)),
                  *map(zmq.Frame, [b"a" * 8, b"b" * 12, b"xyz"])], got.append)
    assert ch._verifier.dropped == {"malformed": 1} and len(got) == 1
