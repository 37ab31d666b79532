"""Edges of the control plane, on stubs: a concurrent call whose thread failed before it
ran, a pool thread whose executor failed to start, a frame on a retired route, a
supervisor round in which one group's check fails."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.actors import rank_main
from asyncrl.actors.rank_main import RankMain
from asyncrl.comm import channel, codec, messages
from asyncrl.comm.auth import Signer, Verifier
from asyncrl.comm.channel import Unheard
from asyncrl.comm.dataserver import _puller
from asyncrl.controller import supervisor
from asyncrl.controller.group import RankInfo
from asyncrl.controller.lost import _from_concurrent, concurrent_sockets
from asyncrl.controller.supervisor import Supervisor

PAYLOAD = msgspec.Raw(codec.encode_call((), {}, []))


def _rank(**attrs) -> RankMain:
    """A RankMain without sockets, threads or a process group: `attrs` stand in for them."""
    rank = object.__new__(RankMain)
    rank.rank, rank.group, rank.tag = 2, "g", "1.x"
    vars(rank).update(attrs)
    return rank


def _no_thread_for_it() -> None:
    raise OSError(24, "Too many open files")


def test_a_concurrent_call_that_failed_before_it_ran_is_answered_with_its_traceback():
    """The io thread answers it outside any except block: format_exc() gave the controller
    "NoneType: None" for a traceback."""
    ran: Future[None] = Future()
    try:
        _no_thread_for_it()
    except OSError as e:
        ran.set_exception(e)
    sent: list = []
    rank = _rank(io=SimpleNamespace(send=sent.append),
                 beside=[(messages.Call(7, "peek", PAYLOAD), ran)])
    rank.answer_unstarted()
    [result] = sent
    assert (result.call_id, result.rank, result.error.type) == (7, 2, "OSError")
    assert "_no_thread_for_it" in result.error.traceback
    assert "Too many open files" in result.error.traceback
    assert rank.beside == []


def test_a_pool_thread_whose_executor_failed_to_start_keeps_its_one_socket(monkeypatch):
    """A second socket of the same identity is ignored by the ROUTER: the retry's Result
    would never be read, and both sockets in the heartbeat hid the loss."""
    made: list[SimpleNamespace] = []

    def socket(role):
        made.append(SimpleNamespace(identity=f"g/2/{role}/1.x".encode(), sent=[]))
        made[-1].send = made[-1].sent.append
        return made[-1]

    new_event_loop, fails = asyncio.new_event_loop, [OSError(24, "Too many open files")]

    def event_loop_once_short_of_descriptors():
        if fails:
            raise fails.pop()
        return new_event_loop()

    monkeypatch.setattr(rank_main, "bind_gpu", lambda: None)
    monkeypatch.setattr(asyncio, "new_event_loop", event_loop_once_short_of_descriptors)
    rank = _rank(local=threading.local(), relay_addresses={}, concurrent_socks=[],
                 socket=socket, data_client=lambda: SimpleNamespace(materialize=lambda x: x),
                 worker=SimpleNamespace(peek=lambda: None), closing=False, _running=0,
                 _settled=threading.Condition())
    call = messages.Call(1, "peek", PAYLOAD)
    with pytest.raises(OSError):  # (the pool's future holds it: answer_unstarted sends it)
        rank.run_concurrent(call)
    rank.run_concurrent(messages.Call(2, "peek", PAYLOAD))
    rank.local.executor.loop.close()
    assert len(made) == 1 and rank.concurrent_socks == made
    assert [(r.call_id, r.error) for r in made[0].sent] == [(2, None)]


def _concurrent_info(concurrent: list[tuple[str, int]]) -> RankInfo:
    return RankInfo(pid=1, host="h", last_seen=0.0, identity=b"g/2/io/1.x",
                    beat=messages.Heartbeat(concurrent=concurrent))


def test_a_concurrent_socket_named_twice_in_a_heartbeat_is_one_socket():
    info = _concurrent_info([("c5", 0), ("c7", 3), ("c5", 1), ("io", 9)])
    assert concurrent_sockets(info) == [(b"g/2/c5/1.x", 1), (b"g/2/c7/1.x", 3)]


class _Channel:
    """What lost.py reads of the controller's channel: nothing came from any socket."""

    def __init__(self) -> None:
        self.unheard: dict[bytes, Unheard] = {}

    def watch(self, identity: bytes) -> Unheard:
        return self.unheard.setdefault(identity, Unheard())

    def watched(self, identity: bytes) -> Unheard | None:
        return self.unheard.get(identity)

    def heard(self, identity: bytes) -> tuple[int, int]:
        return 0, 0


def test_a_result_lost_from_a_socket_named_twice_is_found_after_the_grace():
    """Judged entry by entry, (c5, 0) reset what (c5, 1) had found behind: every round."""
    channel, info, grace = _Channel(), _concurrent_info([("c5", 0), ("c5", 1)]), 9.0
    assert _from_concurrent(channel, info, grace, 100.0) is None
    why = _from_concurrent(channel, info, grace, 100.0 + grace)
    assert why is not None and "1 message(s) from a socket of its concurrent calls" in why


def test_junk_on_a_retired_route_is_counted_as_a_bad_mac_not_a_replay():
    secret, route = b"s" * 32, b"g/0/io/1.x"
    verifier = Verifier(secret)
    assert verifier.verify(route, Signer(secret).sign(route, b"hello")) is not None
    verifier.forget(lambda r: r == route)
    assert verifier.verify(route, [b"x" * 40, b"y" * 32]) is None
    assert verifier.dropped == {"bad_mac": 1}
    replayed = Signer(secret).sign(route, b"again")  # signed: a replay on a retired route
    assert verifier.verify(route, replayed) is None
    assert verifier.dropped == {"bad_mac": 1, "replay": 1}


def test_pull_sockets_and_dropped_frame_logs_do_not_give_away_the_ranks_tag(caplog):
    """A producer saw its consumer's pull socket named "<group>/<rank>/exec/<tag>/pull0",
    and the tag is what the controller takes for proof that a socket is that rank's: a
    rank of another group could then send Results as this one. The warnings of dropped
    frames named it too."""
    ctx = zmq.Context()
    rank = _rank(data_ctx=ctx, secret=b"s" * 32, host="h", segments=None, transfer_timeout=1.0,
                 transport="auto", curve=None, data=SimpleNamespace(address="tcp://x:1"),
                 store=SimpleNamespace(get=None), gone=None)
    ex = rank_main._Executor(rank, SimpleNamespace(identity=b"g/2/exec/1.x"))
    try:
        sock = ex.data._socket("tcp://127.0.0.1:9")[0]
        identity = sock.getsockopt(zmq.IDENTITY)
        assert b"1.x" not in identity and _puller(identity) == ("g", "2")
    finally:
        ex.loop.close()
        ctx.destroy(0)
    with caplog.at_level(logging.WARNING, "asyncrl"):
        Verifier(b"s" * 32).drop("bad_mac", b"g/2/io/1.x")
    assert "g/2/io" in caplog.text and "1.x" not in caplog.text


def test_a_value_of_more_arrays_than_a_message_may_carry_is_refused_saying_so(
        monkeypatch):
    """The controller's reader dropped it as too_many_parts, and the driver waited for a
    TransferTimeout whose advice (a longer transfer_timeout) could not help."""
    monkeypatch.setattr(rank_main, "MAX_FETCHED_ARRAYS", 2, raising=False)
    sent: list = []
    arrays = [np.zeros(64 << 10, np.uint8)] * 3
    rank = _rank(fetch_sock=SimpleNamespace(
        send=lambda reply, frames=(): sent.append((reply, list(frames)))),
        store=SimpleNamespace(get=lambda _: arrays), curve=None)
    rank.send_fetched(5)
    [(reply, frames)] = sent
    assert frames == [] and reply.obj_id == 5 and reply.value is messages.NONE
    assert "holds 3 arrays" in reply.error and "past the 2" in reply.error
    assert "stack them into fewer arrays" in reply.error
    # encrypted, they go in parts (channel.in_parts): two arrays, four parts, past it too
    monkeypatch.setattr(channel, "PART_BYTES", 32 << 10)
    rank.curve, arrays[:] = object(), arrays[:2]
    rank.send_fetched(6)
    assert "holds 2 arrays" in sent[-1][0].error and "4 parts as sent" in sent[-1][0].error


class _Box:
    def __init__(self) -> None:
        self.put: list[str] = []
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed, self.put = self.flushed + self.put, []


def _group(name: str) -> SimpleNamespace:
    info = SimpleNamespace(host="elsewhere", gone=False, pid=1, last_seen=float("inf"))
    return SimpleNamespace(name=name, closing=False, dead=None, ranks={0: info},
                           post_all=lambda box, role, beat: box.put.append(name))


def test_one_groups_failed_check_costs_no_group_its_heartbeats(monkeypatch, caplog):
    def lost_messages(channel, relay_of, info, timeout, now):
        if info is broken.ranks[0]:
            raise RuntimeError("a bug in finding lost messages")
        return None

    broken, box = _group("broken"), _Box()
    monkeypatch.setattr(supervisor, "lost_messages", lost_messages)
    ctl = SimpleNamespace(groups={"broken": broken, "fine": _group("fine")},
                          outbox=lambda: box, channel=None, relay_of={}, heartbeat_timeout=3.0)
    with caplog.at_level(logging.ERROR, "asyncrl"):
        Supervisor(ctl).check()
    assert box.flushed == ["broken", "fine"]
    assert "checking group 'broken' failed" in caplog.text
