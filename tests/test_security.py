"""Security of the wire: the 0600 secret file, CurveZMQ encryption (`Controller(encrypt=True)`),
and no pickle ever read from a socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from helpers import ROOT, assert_gone, group_pids, poll_until, run
from zmq.utils.monitor import parse_monitor_message

import asyncrl
from asyncrl import TensorBatch, cli
from asyncrl.comm import codec, messages
from asyncrl.comm.auth import (
    Signer,
    Verifier,
    curve_available,
    new_curve_keys,
    read_curve,
    read_secret,
    write_secret,
)
from asyncrl.controller.inbox import Inbox

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "no_pickle.py")
needs_curve = pytest.mark.skipif(not curve_available(), reason="this libzmq has no CURVE")


class Echo(asyncrl.Worker):
    @asyncrl.register
    def add(self, a, b):
        return a + b

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, n: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": n["i"].float() * 2})

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def total(self, batch: TensorBatch) -> float:
        return float(batch["x"].sum())

    @asyncrl.register
    def numel(self, ts: list) -> int:  # (as a call's value comes: each rank's, in a list)
        return ts[0].numel()


def test_secret_file_is_private(tmp_path):
    path = str(tmp_path / "secret")
    write_secret(path, b"k" * 32)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret(path) == b"k" * 32
    assert read_curve(path) is None  # not encrypted
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_secret(path)


@needs_curve
def test_curve_keys_travel_in_the_secret_file_only(tmp_path):
    keys, controller_secret = new_curve_keys()
    path = str(tmp_path / "secret")
    write_secret(path, b"k" * 32, keys)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret(path) == b"k" * 32 and read_curve(path) == keys
    assert controller_secret.decode() not in (tmp_path / "secret").read_text()  # kept in memory
    os.chmod(path, 0o640)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_curve(path)


def _shown(pid: int, words: list[str]) -> list[str]:
    """Which of `words` are in the environment or command line of process `pid`."""
    seen = b""
    for what in ("environ", "cmdline"):
        with open(f"/proc/{pid}/{what}", "rb") as f:
            seen += f.read()
    return [w for w in words if w.encode() in seen]


async def _refused(monitor: zmq.asyncio.Socket) -> str:
    """The first monitor event that says the connection was refused, by name."""
    refused = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
               zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_DISCONNECTED}
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        assert event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a plain socket got in"
        if event["event"] in refused:
            return zmq.Event(event["event"]).name


@needs_curve
def test_encrypted_run_works_and_a_plain_socket_gets_nothing_through():
    async def main():
        async with asyncrl.Controller(encrypt=True, transport="tcp", echo_logs=False) as ctl:
            a = await ctl.spawn(Echo, nprocs=1, name="a")
            b = await ctl.spawn(Echo, nprocs=1, name="b")
            pids = group_pids(a) + group_pids(b)
            assert await a.add(2, 3) == [5]
            rows = TensorBatch({"i": torch.arange(10)})
            assert await b.total(a.make(rows)) == [90.0]  # rows over the encrypted data plane

            words = ctl.secret_file.read_text().split()  # the secret and the three keys
            for pid in a.pids.values():  # are in no rank's environment or command line
                assert not _shown(pid, words[:1] + words[2::2])

            # a plain DEALER that knows the address and even the secret: a validly signed
            # Hello that would take rank 0's route over if it got in, then garbage
            secret = read_secret(str(ctl.secret_file))
            before = (ctl.dropped_frames, a.ranks[0].identity, set(a.ranks), set(ctl.groups))
            ctx = zmq.asyncio.Context()
            intruder = ctx.socket(zmq.DEALER)
            intruder.setsockopt(zmq.IDENTITY, b"a/0/io/1")
            monitor = intruder.get_monitor_socket()
            intruder.connect(ctl.channel.address)
            hello = messages.Hello("a", 0, 1, 0, 1, socket.gethostname(), "io", "tcp://x:1")
            # without blocking: once a refused handshake has dropped the connection, a
            # DEALER has no peer to queue for (a send would wait forever): nothing got in
            with contextlib.suppress(zmq.Again):
                await intruder.send_multipart(Signer(secret).sign(
                    b"a/0/io/1", messages.encode(hello)), flags=zmq.NOBLOCK)
                await intruder.send(b"garbage", flags=zmq.NOBLOCK)
            assert await asyncio.wait_for(_refused(monitor), 10)

            # and one at a rank's data server: a signed pull of a stored object, unanswered
            puller = ctx.socket(zmq.DEALER)
            puller.setsockopt(zmq.IDENTITY, b"b/0/pull9")
            pull_monitor = puller.get_monitor_socket()
            addr = a.ranks[0].data_addr
            puller.connect(addr)
            pull = messages.Pull(1, 1)
            with contextlib.suppress(zmq.Again):
                await puller.send_multipart(Signer(secret).sign(
                    b"b/0/pull9@" + addr.encode(), messages.encode(pull)), flags=zmq.NOBLOCK)
            assert await asyncio.wait_for(_refused(pull_monitor), 10)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(puller.recv_multipart(), 1.0)

            assert await a.add(1, 1) == [2]  # answered after anything the intruders sent
            assert await b.total(a.make(rows)) == [90.0]
            assert before == (ctl.dropped_frames, a.ranks[0].identity, set(a.ranks),
                              set(ctl.groups))  # nothing reached even the MAC check
            assert a.dead is None and b.dead is None
            for sock in (intruder, monitor, puller, pull_monitor):
                sock.close(0)
            ctx.term()
            return pids
    assert_gone(run(main()))


SITECUSTOMIZE = '''
"""Put on PYTHONPATH by tests/test_security.py: records every unpickling in this process."""
import os, pickle, _pickle, traceback

_LOG = os.environ["ASYNCRL_PICKLE_LOG"]


def _write(line):
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)


def _record(what):
    stack = " < ".join(f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-2]))
    _write(f"unpickled {os.getpid()} {what} {stack}")


_loads, _load = pickle.loads, pickle.load
_Unpickler, _PyUnpickler = pickle.Unpickler, pickle._Unpickler


def loads(*args, **kwargs):
    _record("loads")
    return _loads(*args, **kwargs)


def load(*args, **kwargs):
    _record("load")
    return _load(*args, **kwargs)


class Unpickler(_Unpickler):
    def __init__(self, *args, **kwargs):
        _record("Unpickler")
        super().__init__(*args, **kwargs)


class PyUnpickler(_PyUnpickler):
    def __init__(self, *args, **kwargs):
        _record("Unpickler")
        super().__init__(*args, **kwargs)


for module in (pickle, _pickle):
    module.loads, module.load, module.Unpickler = loads, load, Unpickler
pickle._loads, pickle._load, pickle._Unpickler = loads, load, PyUnpickler
with open("/proc/self/cmdline", "rb") as f:
    _write(f"armed {os.getpid()} " + f.read().replace(b"\\0", b" ").decode(errors="replace"))
# torchrun agents forked from the agent server run no interpreter start of their own
os.register_at_fork(after_in_child=lambda: _write(f"forked {os.getpid()} {os.getppid()}"))
'''


def test_nothing_is_ever_unpickled_from_a_socket(tmp_path):
    """Controller, torchrun agents and ranks run with pickle's loaders replaced by recorders;
    real calls, a transfer between groups, and pickles that would create a marker file thrown
    at the controller's ROUTER, a rank's DEALER and a rank's data server."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    log, marker = tmp_path / "pickle.log", tmp_path / "marker"
    env = {**os.environ, "ASYNCRL_PICKLE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), ROOT,
                                                     os.environ.get("PYTHONPATH")) if p)}
    probe = subprocess.run([sys.executable, "-c", "import pickle; pickle.loads(pickle.dumps(1))"],
                           env=env, timeout=60)
    assert probe.returncode == 0 and " loads " in log.read_text()  # the recorder records
    log.unlink()

    out = subprocess.run([sys.executable, DRIVER, str(marker)], env=env, capture_output=True,
                         text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["marker"] and not marker.exists()
    assert not result["dead"]
    dropped = result["controller"]
    assert dropped["malformed"] >= 1 and dropped["bad_mac"] >= 1 and dropped["undecodable"] >= 1
    assert result["rank"] >= 5  # 2 at its DEALER, 3 at its data server

    lines = log.read_text().splitlines()
    armed = {int(line.split()[1]): line for line in lines if line.startswith("armed ")}
    assert result["driver"] in armed
    servers = {p for p, line in armed.items() if "agent_fork" in line}
    forked = {int(line.split()[1]) for line in lines if line.startswith("forked ")
              and int(line.split()[2]) in servers}
    # every rank forked from the agent server (asyncrl/actors/rank_fork.py), which was
    # armed as it started; torchrun's stand-ins for them run no site (-S) and unpickle
    # nothing (stdlib json)
    assert len(servers) == 1 and set(result["pids"]) <= forked
    agents = forked - set(result["pids"])
    assert len(agents) == 2
    # nothing at all in the controller or a rank; torchrun's agents read their own
    # rendezvous state from their c10d store with pickle (torch's, not asyncrl's sockets)
    unpickled = [line for line in lines if line.startswith("unpickled ")]
    # (who unpickles: the innermost caller, first in the stack; an agent's stack starts in
    # asyncrl's agent server, which runs torchrun's main)
    bad = [line for line in unpickled if int(line.split()[1]) not in agents
           or "torch/distributed/elastic/rendezvous/" not in line.split(" ", 3)[3].split(" < ")[0]]
    assert not bad, "\n".join(bad)


def test_launch_encrypt_reaches_the_controller_or_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # `launch` sets it for the script

    args = cli.parser().parse_args(["launch", "flow.py", "--encrypt"])
    assert cli._settings(args) == {"encrypt": True}  # launch_flow's Controller(**settings)
    assert "encrypt" not in cli._settings(cli.parser().parse_args(["launch", "flow.py"]))
    args = cli.parser().parse_args(["launch", "flow.py", "--transport", "tcp", "--no-relay",
                                    "--startup-timeout", "30", "--construct-timeout", "90"])
    assert cli._settings(args) == {"transport": "tcp", "relay": False, "startup_timeout": 30.0,
                                   "construct_timeout": 90.0}
    with pytest.raises(SystemExit):  # argparse names the choices
        cli.parser().parse_args(["launch", "flow.py", "--transport", "shm"])
    driver = tmp_path / "driver.py"
    driver.write_text("async def main():\n    pass\n")
    with pytest.raises(SystemExit, match=r"Controller\(encrypt=True\)"):  # never unencrypted
        cli.main(["launch", "--encrypt", str(driver)])


def test_a_late_hello_from_an_earlier_group_of_the_name_is_dropped():
    """A rank of a group that was stopped before it said hello (a spawn that timed out) says
    it late, to the group respawned under that name: taken, it gave rank 0 a stale pid and
    route. It carries its own spawn's token, not this group's."""

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Echo, name="g")
            before = (group.ranks[0].pid, group.ranks[0].identity)
            secret = read_secret(str(ctl.secret_file))
            ctx = zmq.asyncio.Context()
            late = ctx.socket(zmq.DEALER)
            late.setsockopt(zmq.LINGER, 0)
            late.setsockopt(zmq.IDENTITY, b"g/0/io/4242")
            late.connect(ctl.channel.address)
            hello = messages.Hello("g", 0, 1, 0, 4242, socket.gethostname(), "io",
                                   "tcp://x:1", spawn="an-earlier-spawn")
            signer = Signer(secret)  # (one sequence for the socket's frames)
            await late.send_multipart(signer.sign(b"g/0/io/4242", messages.encode(hello)))
            await poll_until(lambda: ctl.dropped_frames.get("stale") == 1, 20,
                             "the late hello to be dropped")
            # nor are its heartbeats taken for rank 0's (they kept a hung rank 0 alive), nor
            # those of a socket named with rank 0's pid but not its nonce
            beat = messages.Heartbeat(0, 999, 999)
            await late.send_multipart(signer.sign(b"g/0/io/4242", messages.encode(beat)))
            await poll_until(lambda: ctl.dropped_frames.get("foreign") == 1, 20,
                             "the late heartbeat to be dropped")
            await _forge(ctl, b"g/0/io/%d.0000" % before[0], beat, "foreign")
            assert group.store_stats[0] != (999, 999)
            late.close()
            ctx.term()
            after = (group.ranks[0].pid, group.ranks[0].identity)
            return before, after, await group.add(1, 2), group_pids(group)
    before, after, added, pids = run(main())
    assert_gone(pids)
    assert after == before and added == [3]
    # a rank's sockets are named with its pid and 64 random bits: no other process of the
    # host can connect first under the name (pid and group are in `ps`) and take its frames
    assert re.fullmatch(rb"g/0/io/%d\.[0-9a-f]{16}" % before[0], before[1]), before[1]


def test_a_stopped_groups_sockets_leave_the_replay_table():
    """The controller keeps each socket's last sequence number: one entry per socket any
    rank ever had grew without end over a run of respawns (and a pid given again to a rank
    had its frames dropped as replays)."""
    async def main():
        async with asyncrl.Controller() as ctl:
            sizes = []
            for _ in range(3):
                group = await ctl.spawn(Echo, name="again", nprocs=2)
                assert await group.add(1, 1) == [2, 2]
                pids = group_pids(group)
                await ctl.close_group(group)
                assert_gone(pids)
                sizes.append(len(ctl.channel._verifier._last_seq))
            return sizes
    sizes = run(main())
    # none of the 4 sockets a group had stays (bar a last log frame after its stop); they
    # were 4, 8, 12
    assert max(sizes) < 4, sizes


def test_a_stopped_sockets_frames_replayed_are_dropped():
    """Forgetting a stopped group's routes dropped their sequence numbers: a frame captured
    from one of them verified again, replayed (a dead group's Ready or Log, taken by the
    group started afresh under its name)."""
    secret = os.urandom(32)
    route = b"g/0/exec/123.00ff00ff00ff00ff"
    frame = Signer(secret).sign(route, messages.encode(messages.Heartbeat(0, 1, 1)))
    verifier = Verifier(secret)
    assert verifier.verify(route, frame) is not None
    verifier.forget(lambda r: r.startswith(b"g/"))
    assert verifier.verify(route, frame) is None and verifier.dropped["replay"] == 1
    assert verifier._last_seq == {}  # (what runs is what the sequence table holds)
    # a MAC of the wrong size is dropped before the body is hashed (a multi-GB one held
    # the controller's loop)
    assert verifier.verify(b"h/0/io/1.00", [frame[0], b"short"]) is None
    assert verifier.dropped["malformed"] == 1


async def _forge(ctl, route: bytes, msg, dropped_as: str) -> None:
    """Send `msg`, signed with the run's secret, from a socket named `route`, and wait for
    the controller to drop it as `dropped_as` (once more)."""
    count = ctl.dropped_frames.get(dropped_as, 0) + 1
    ctx = zmq.asyncio.Context()
    forged = ctx.socket(zmq.DEALER)
    try:
        forged.setsockopt(zmq.LINGER, 0)
        forged.setsockopt(zmq.IDENTITY, route)
        forged.connect(ctl.channel.address)
        await forged.send_multipart(Signer(read_secret(str(ctl.secret_file))).sign(
            route, messages.encode(msg)))
        await poll_until(lambda: ctl.dropped_frames.get(dropped_as) == count, 20,
                         f"the forged {type(msg).__name__} to be dropped")
    finally:
        forged.close()
        ctx.term()


class Gated(asyncrl.Worker):
    """Constructed once a file exists (the test says when)."""

    def __init__(self, gate: str):
        while not os.path.exists(gate):
            time.sleep(0.01)

    @asyncrl.register
    def add(self, a, b):
        return a + b


def test_a_ready_from_another_socket_than_the_ranks_exec_is_dropped(tmp_path):
    """A group's Ready was taken from any socket naming the group (a captured one of an
    earlier group of the name, replayed): its error failed the spawn, its success marked a
    rank constructed that was not."""
    gate = tmp_path / "gate"

    async def main():
        async with asyncrl.Controller() as ctl:
            spawn = asyncio.ensure_future(ctl.spawn(Gated, str(gate), name="gated"))
            await poll_until(lambda: "gated" in ctl.groups and ctl.groups["gated"].started
                             .done(), 120, "the group's ranks to say hello")
            pid = ctl.groups["gated"].ranks[0].pid
            route = b"gated/0/exec/%d.0000000000000000" % pid  # not its socket's nonce
            failure = messages.Failure("ValueError", "an earlier group's failure", "")
            await _forge(ctl, route, messages.Ready(0, error=failure), "foreign")
            gate.touch()
            group = await spawn
            return await group.add(1, 2), group_pids(group)
    added, pids = run(main())
    assert_gone(pids)
    assert added == [3]


def test_a_hello_for_another_socket_than_its_sender_is_dropped():
    """A Hello with its spawn's token was taken for whatever rank and role it named: one
    from rank 0's exec socket, naming rank 1's io, took rank 1's route over."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Echo, name="two", nprocs=2)
            before, token = group.ranks[1].identity, ctl.spawn_tokens["two"]
            pid = group.ranks[1].pid
            hello = messages.Hello("two", 1, 2, 1, pid, socket.gethostname(), "io",
                                   "tcp://x:1", spawn=token)
            await _forge(ctl, b"two/0/exec/%d.0000000000000000" % pid, hello, "foreign")
            await _forge(ctl, b"two/1/io/%d.0000000000000000" % pid, hello, "foreign")
            assert group.ranks[1].identity == before
            return await group.add(1, 2), group_pids(group)
    added, pids = run(main())
    assert_gone(pids)
    assert added == [3, 3]


class Slow(asyncrl.Worker):
    @asyncrl.register
    def wait_for(self, gate: str):
        while not os.path.exists(gate):
            time.sleep(0.01)
        return "real"


def test_an_answer_to_a_call_from_another_groups_socket_is_dropped(tmp_path):
    """Results were taken by call id and the name's group and rank alone: any holder of the
    secret (another group's rank) could answer a group's call with its own value, naming its
    socket as the rank's (its pid is in `ps`), or a relay of the group's."""
    gate = tmp_path / "gate"

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Slow, name="slow")
            pending = group.wait_for(str(gate))
            await poll_until(lambda: group._pending, 20, "the call to be sent")
            call_id, pid = next(iter(group._pending)), group.ranks[0].pid
            forged = msgspec.Raw(codec.encode("forged"))
            answer = messages.Result(call_id, 0, forged)
            await _forge(ctl, b"other/0/exec/1.0000000000000000", answer, "unknown_sender")
            await _forge(ctl, b"slow/0/exec/%d.0000000000000000" % pid, answer, "foreign")
            bundle = messages.Fanin([group.ranks[0].exec_identity], [msgspec.Raw(
                messages.encode(messages.Results(call_id, [0], [forged], [True], [-1], [], 0.0)))])
            await _forge(ctl, b"slow/0/relay-exec/%d.0000000000000000" % pid, bundle, "foreign")
            bundle.frames = [msgspec.Raw(messages.encode(answer))]  # (the rank's own name)
            await _forge(ctl, b"slow/3/relay-io/x", bundle, "foreign")
            # nor a log file opened for each rank a name claims, nor a Shutdown taken
            await _forge(ctl, b"slow/1000000/log/1.0", messages.Log(["x"]), "foreign")
            assert not ctl.logs.path("slow", 10**6).exists()
            await _forge(ctl, b"slow/0/io/1.0", messages.Shutdown(), "unexpected")
            assert not pending.done()
            gate.touch()
            return await pending, group_pids(group)
    value, pids = run(main())
    assert_gone(pids)
    assert value == ["real"]


def test_what_a_rank_prints_before_its_hello_reaches_its_log():
    """Only registered ranks' sockets are heard, but a rank's output starts before its hello
    (a failure there prints its traceback): its log socket's lines are kept, for the group's
    own ranks alone (no file opened for a rank a name claims past the group's size)."""
    class Group:  # (a handle: hashable, as the inbox keeps registered groups in a set)
        name, nprocs = "g", 2

    written, dropped = [], []
    group = Group()
    ctl = SimpleNamespace(groups={"g": group}, calls={},
                          logs=SimpleNamespace(write=lambda *a: written.append(a)),
                          channel=SimpleNamespace(drop=lambda why, route=b"": dropped.append(why)))
    inbox = Inbox(ctl)
    inbox.on_message(b"g/1/log/4242.0123456789abcdef", messages.Log(["Traceback: boom"], 2))
    assert written == [("g", 1, ["Traceback: boom"], 2)] and dropped == []
    for route in (b"g/2/log/1.0", b"g/1/io/1.0", b"other/0/log/1.0"):
        inbox.on_message(route, messages.Log(["x"]))
    assert len(written) == 1 and dropped == ["foreign", "foreign", "unknown_sender"]
    # through relays, its exec hello may come first (by the exec relay): its logs, which go
    # by the io relay, are still kept until the io hello registers that relay
    tag = b"4242.0123456789abcdef"
    assert inbox._register(group, [b"g", b"0", b"exec", tag], "exec", b"g/0/relay-exec/" + tag)
    inbox.on_message(b"g/0/log/" + tag, messages.Log(["early"]), b"g/0/relay-io/" + tag)
    assert written[-1] == ("g", 0, ["early"], 0)


def test_a_value_from_a_peer_never_runs_the_file_a_reference_in_it_names(tmp_path):
    """A class or function travels as (module, qualname, file), and a module not found
    by name was loaded from the file: a holder of the secret (a rank's result, a pulled
    batch, a shared inputs file) could have any .py on the receiver's disk run. Only the
    controller's commands (decode_call) may now; a value finds the modules loaded here."""
    evil = tmp_path / "evil_module_xyz.py"
    ran = tmp_path / "ran"
    evil.write_text(f"open({str(ran)!r}, 'w').close()\nclass Thing:\n    pass\n")
    ref = msgspec.msgpack.Ext(codec.EXT_REF, msgspec.msgpack.encode(
        ["evil_module_xyz", "Thing", str(evil)]))
    value = msgspec.msgpack.encode({"x": ref})
    with pytest.raises(ImportError, match="values from peers never run a file"):
        codec.decode(value)
    with pytest.raises(ImportError, match="values from peers never run a file"):
        codec.decode_oob(value, [])
    assert not ran.exists()
    args, _ = codec.decode_call(msgspec.msgpack.encode([[ref], {}]))  # a command's: loads
    assert ran.exists() and args[0].__name__ == "Thing"
    assert codec.decode(value)["x"] is args[0]  # loaded here now: found, not run again
    assert codec.decode(codec.encode([asyncrl.Worker]))[0] is asyncrl.Worker  # by name
    # nor an import by name (a module's code runs: any .py on sys.path), nor a name that is
    # not a class or function (os.environ: a module's live state)
    side = tmp_path / "sidefx_module_xyz.py"
    side.write_text(f"open({str(ran)!r} + '2', 'w').close()\nclass Thing:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        named = msgspec.msgpack.Ext(codec.EXT_REF, msgspec.msgpack.encode(["sidefx_module_xyz",
                                                                           "Thing", ""]))
        with pytest.raises(ImportError, match="not imported here"):
            codec.decode(msgspec.msgpack.encode(named))
        assert not (tmp_path / "ran2").exists()
    finally:
        sys.path.remove(str(tmp_path))
    environ = msgspec.msgpack.Ext(codec.EXT_REF, msgspec.msgpack.encode(["os", "environ", ""]))
    with pytest.raises(TypeError, match="only classes and functions travel by name"):
        codec.decode(msgspec.msgpack.encode(environ))
    # nor a module's lazy __getattr__ (numpy imports numpy.fft on first use), checked in a
    # process where nothing imported it yet
    lazy = subprocess.run([sys.executable, "-c", (
        "import sys, msgspec, numpy; from asyncrl.comm import codec\n"
        "ref = msgspec.msgpack.encode(['numpy', 'fft.fft', ''])\n"
        "try:\n    codec.decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_REF, ref)))\n"
        "except ImportError:\n    pass\n"
        "print('numpy.fft' in sys.modules, codec.decode(codec.encode(numpy.zeros)) is "
        "numpy.zeros)")], capture_output=True, text=True, timeout=120)
    assert lazy.stdout.split() == ["False", "True"], lazy.stderr[-2000:]


def test_a_run_dir_every_user_can_write_is_refused_before_anything_is_written(
        tmp_path, monkeypatch):
    """Only --resume checked who could write a run's folder: a run in a folder every user
    can write wrote its logs and checkpoints there, where a planted link redirects a log and
    a replaced checkpoint is unpickled on --resume (refused only then). Another user's
    folder is used (root on NFS sees its own as nobody's; a container's bind mount), and
    ASYNCRL_TRUST_RUN_DIR=1 uses one whose mode says so falsely (some FUSE mounts)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    others = tmp_path / "others"
    others.mkdir()
    if os.getuid() == 0:  # root can hand a folder to another user
        os.chown(others, 54321, -1)
    monkeypatch.delenv("ASYNCRL_TRUST_RUN_DIR", raising=False)

    async def main():
        with pytest.raises(PermissionError, match=f"run_dir {shared} is writable by every "
                                                  f"user: another user could redirect"):
            async with asyncrl.Controller(run_dir=shared):
                pass
        assert asyncrl.Controller.current() is None and list(shared.iterdir()) == []
        async with asyncrl.Controller(run_dir=others) as ctl:
            assert ctl.run_dir == others
        monkeypatch.setenv("ASYNCRL_TRUST_RUN_DIR", "1")
        async with asyncrl.Controller(run_dir=shared) as ctl:
            assert ctl.run_dir == shared
    run(main())




@needs_curve
def test_encrypted_large_values_leave_the_heartbeats_flowing():
    # CURVE encrypts a part whole on its context's one I/O thread: 384 MiB in one part, an
    # argument or a pull, held its heartbeats past 0.5 s (here: the values arrive, no death)
    w = torch.ones(1 << 27)  # (not filled on the loop: it would stop them itself)

    async def main():
        async with asyncrl.Controller(encrypt=True, transport="tcp", heartbeat_interval=0.1,
                                      heartbeat_timeout=1.0, echo_logs=False) as ctl:
            a, b = await ctl.spawn(Echo, name="a"), await ctl.spawn(Echo, name="b")
            got = [await a.numel([w]), await b.numel(a.add(w, 0))]  # (kept on a, pulled by b)
            return group_pids(a) + group_pids(b), got, a.dead, b.dead
    pids, got, *dead = run(main())
    assert_gone(pids)
    assert got == [[w.numel()]] * 2 and dead == [None, None]
