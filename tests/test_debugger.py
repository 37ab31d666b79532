"""breakpoint() inside a worker: the rank waits, `asyncrl attach` reaches its pdb, the call
completes after `c`; the group's next call waits, another group goes on."""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading

import pytest
from helpers import ROOT, assert_gone, group_pids, poll_until, run

import asyncrl


class Stops(asyncrl.Worker):
    @asyncrl.register
    def compute(self, x: int) -> int:
        y = x * 2
        breakpoint()
        return y + 1

    @asyncrl.register
    def ping(self) -> str:
        return "pong"


class Other(asyncrl.Worker):
    @asyncrl.register
    def ping(self) -> str:
        return "other pong"


def test_attach_drives_pdb_in_a_rank_and_the_call_completes(tmp_path):
    async def main():
        async with asyncrl.Controller(run_dir=tmp_path, echo_logs=False) as ctl:
            stops = await ctl.spawn(Stops, nprocs=1, name="stops")
            other = await ctl.spawn(Other, nprocs=1, name="other")
            pids = group_pids(stops) + group_pids(other)
            call = stops.compute(21)
            await poll_until(lambda: any((tmp_path / "debug").glob("stops-0-*.json")), 60,
                             "the rank to wait for a debugger")
            session = next((tmp_path / "debug").glob("stops-0-*.json"))
            info = json.loads(session.read_text())
            assert info["where"].endswith("in compute") and (session.stat().st_mode & 0o77) == 0
            later = stops.ping()  # waits behind the call in the debugger
            assert await other.ping() == ["other pong"]  # another group goes on
            assert not later.done() and not call.done()
            listing = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl", "attach", str(tmp_path), "--list", cwd=ROOT,
                stdout=asyncio.subprocess.PIPE)
            listed = (await listing.communicate())[0].decode()
            assert "stops:0" in listed and "in compute" in listed
            attach = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl", "attach", str(tmp_path), "--group", "stops",
                "--rank", "0", cwd=ROOT, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(attach.communicate(b"p y\nc\n"), 60)
            result = await call
            assert await later == ["pong"]
            return out.decode(), result, pids
    out, result, pids = run(main())
    assert_gone(pids)
    assert "attached to stops:0" in out and "42" in out and "continuing" in out
    assert result == [43]
    assert not any((tmp_path / "debug").glob("stops-0-*.json"))


def test_attach_says_who_waits_when_the_choice_is_wrong(tmp_path, capsys):
    from asyncrl.cli import main

    with pytest.raises(SystemExit, match="no rank waits for a debugger .* waiting: none"):
        main(["attach", str(tmp_path)])
    assert main(["attach", str(tmp_path), "--list"]) == 0  # an empty list says so
    assert capsys.readouterr().out == f"no rank waits for a debugger in {tmp_path}\n"
    with pytest.raises(SystemExit, match="no run directory .*/typo"):  # (it said none waits)
        main(["attach", str(tmp_path / "typo"), "--list"])
    # a rank that died at its breakpoint leaves its file (it exits with os._exit): not
    # listed, and removed; one still running that no longer answers is named
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    debug = tmp_path / "debug"
    debug.mkdir()
    # a rank of another host (a shared run directory): its pid means nothing here
    for name, pid, host in (("dead", gone.pid, socket.gethostname()),
                            ("stuck", os.getpid(), "127.0.0.1"), ("far", gone.pid, "node7")):
        (debug / f"{name}.json").write_text(json.dumps({
            "group": name, "rank": 0, "pid": pid, "host": host, "port": 9,
            "token": "t", "where": "flow.py:3"}))
    assert main(["attach", str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [x.split()[:3] for x in listed] == [["far:0", "host", "node7"],
                                               ["stuck:0", "host", "127.0.0.1"]]
    assert not (debug / "dead.json").exists() and (debug / "far.json").exists()
    with pytest.raises(SystemExit, match="far:0 waits for a debugger on host node7: run "
                                         "`asyncrl attach` there"):
        main(["attach", str(tmp_path), "--group", "far"])
    with pytest.raises(SystemExit, match=r"stuck:0 no longer waits at flow.py:3 \(.*--list"):
        main(["attach", str(tmp_path), "--group", "stuck"])


def _namespaces() -> dict[str, str]:
    """This process's pid and net namespaces, as a rank writes them in its session."""
    return {"pid_ns": os.readlink("/proc/self/ns/pid"),
            "net_ns": os.readlink("/proc/self/ns/net")}


def _write_session(debug, name: str, **fields) -> None:
    debug.mkdir(mode=0o700, exist_ok=True)
    (debug / f"{name}.json").write_text(json.dumps({
        "group": name, "rank": 0, "host": socket.gethostname(), "port": 9, "token": "t",
        "where": "flow.py:3", **fields}))


def test_a_session_in_another_namespace_of_this_host_is_kept_and_named(tmp_path):
    """Ranks in a `docker --network host` container share the hostname but not the pids:
    attach on the host read a live rank's pid as dead and removed its session (the rank
    then waited forever); they share the loopback, so they are here all the same (they were
    refused as elsewhere). A netns host's rank shares the pids but not the loopback: attach
    said it no longer waits (connection refused)."""
    from asyncrl.actors.procs import birth
    from asyncrl.cli import main
    from asyncrl.controller.attach import waiting

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # (a pid that means nothing here, as a container's would)
    debug = tmp_path / "debug"
    _write_session(debug, "container", pid=gone.pid, start="1",
                   **{**_namespaces(), "pid_ns": "pid:[1]", "net_ns": "net:[1]"})
    _write_session(debug, "netns", pid=os.getpid(), start=birth(os.getpid()),
                   **{**_namespaces(), "net_ns": "net:[1]"})
    _write_session(debug, "hostnet", pid=gone.pid, start="1",  # docker --network host
                   **{**_namespaces(), "pid_ns": "pid:[1]"})
    listed = {s["group"]: s for s in waiting(tmp_path)}
    assert sorted(listed) == ["container", "hostnet", "netns"]
    assert [g for g, s in listed.items() if s["here"]] == ["hostnet"]
    assert all((debug / f"{g}.json").exists() for g in listed)
    with pytest.raises(SystemExit, match=r"container:0 waits for a debugger on this host in "
                                         r"another network namespace \(net:\[1\]\).*docker "
                                         r"exec"):
        main(["attach", str(tmp_path), "--group", "container"])
    with pytest.raises(SystemExit, match=r"netns:0 waits for a debugger on this host in "
                                         r"another network namespace \(net:\[1\]\).*ip "
                                         r"netns exec"):
        main(["attach", str(tmp_path), "--group", "netns"])
    with pytest.raises(SystemExit, match=r"hostnet:0 no longer waits at flow.py:3"):
        main(["attach", str(tmp_path), "--group", "hostnet"])  # (here: connected to)
    assert (debug / "container.json").exists() and (debug / "hostnet.json").exists()


def test_a_session_whose_pid_another_process_now_has_is_pruned(tmp_path):
    """A rank that died at its breakpoint (os._exit: its file stays) whose pid a later
    process got was listed as waiting, and attach sent the token, and then the keystrokes,
    to whatever listened on its old port."""
    from asyncrl.controller.attach import waiting

    debug = tmp_path / "debug"
    _write_session(debug, "reused", pid=os.getpid(), start="1", **_namespaces())
    assert waiting(tmp_path) == []
    assert not (debug / "reused.json").exists()

# -- in process: a thread stops in breakpoint(), the test is the attach client ---------------
class _Rank:
    """breakpoint() on threads of this process, as on a rank's threads; `stops` says when
    one waits for a debugger (the line it prints comes after its session file)."""

    def __init__(self, tmp_path, monkeypatch):
        from asyncrl.actors import debugger

        self.dir = tmp_path
        self.stops: queue.Queue[str] = queue.Queue()
        self.results: dict[str, object] = {}
        monkeypatch.setenv(debugger.DEBUG_DIR_ENV, str(tmp_path / "debug"))
        monkeypatch.setenv("ASYNCRL_GROUP", "g")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(debugger, "print", lambda *a, **k: self.stops.put(a[0]),
                            raising=False)
        self.threads: list[threading.Thread] = []

    def start(self, name: str, fn) -> None:
        def body() -> None:
            try:
                self.results[name] = fn()
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                self.results[name] = e
        thread = threading.Thread(target=body, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def next_stop(self) -> str:
        return self.stops.get(timeout=30)

    def session(self, where: str = "") -> dict:
        from asyncrl.controller.attach import waiting

        found = [s for s in waiting(self.dir) if where in s["where"]]
        assert len(found) == 1, found
        return found[0]

    def join(self) -> None:
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive(), f"{thread.name} is still in the debugger"


def _connect(session: dict, token: bytes | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", session["port"]), timeout=30)
    sock.sendall((session["token"].encode() if token is None else token) + b"\n")
    return sock


def _until(sock: socket.socket, marker: bytes) -> str:
    got = b""
    while marker not in got:
        data = sock.recv(65536)
        if not data:
            break
        got += data
    return got.decode()


def _helper(x: int) -> int:
    doubled = x * 2
    return doubled


def _stops_then_calls_helper() -> int:
    x = 20
    asyncrl.breakpoint()
    return _helper(x) + 2


@pytest.fixture
def rank(tmp_path, monkeypatch):
    import bdb

    yield _Rank(tmp_path, monkeypatch)
    bdb.Breakpoint.clearBreakpoints()  # pdb keeps breakpoints process-wide


def test_a_breakpoint_set_in_pdb_waits_for_a_new_attach_after_continue(rank):
    rank.start("call", _stops_then_calls_helper)
    assert "in _stops_then_calls_helper" in rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"b _helper\n")
        assert "Breakpoint" in _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
        said = _until(sock, b"\n")
    assert "continuing; 1 breakpoint(s) set" in said and "asyncrl attach" in said
    assert "in _helper" in rank.next_stop()  # not a write to the closed connection
    with _connect(rank.session("in _helper")) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"p x\n")
        assert _until(sock, b"(asyncrl-pdb g:0)").startswith("20\n")
        sock.sendall(b"c\n")
        assert "continuing" in _until(sock, b"\n")
    rank.join()
    assert rank.results == {"call": 42}


def test_a_token_with_non_ascii_bytes_is_refused_and_the_rank_still_waits(rank):
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    session = rank.session()
    with _connect(session, "é".encode() + b"\xff") as bad:
        assert bad.recv(100) == b""  # refused: the rank closed it
    assert "call" not in rank.results  # still waiting, not failed
    with _connect(session) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
        _until(sock, b"\n")
    rank.join()
    assert rank.results == {"call": 42}


def test_the_attach_client_going_away_lets_the_method_go_on(rank):
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")  # then the client leaves without `c`
    rank.join()
    assert rank.results == {"call": 42}  # not BdbQuit


def test_quit_in_pdb_leaves_the_debugger_and_the_method_goes_on(rank):
    """`q` does not fail the call (its group's other ranks would wait in collectives): it
    continues, and closes the attach client's connection."""
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"q\n")
        said = _until(sock, b"\x00")  # to the end: the rank closes the connection
    assert "quit: the call goes on" in said and "continuing" in said
    rank.join()
    assert rank.results == {"call": 42}  # not BdbQuit


def test_two_breakpoints_of_one_rank_are_each_reachable(rank, tmp_path):
    from asyncrl.controller.attach import attach, choose, waiting

    def other() -> str:
        asyncrl.breakpoint()
        return "other"

    rank.start("first", _stops_then_calls_helper)
    assert "in _stops_then_calls_helper" in rank.next_stop()
    rank.start("second", other)
    assert "in other" in rank.next_stop()
    sessions = waiting(tmp_path)
    assert sorted(s["thread"] for s in sessions) == ["first", "second"]
    with pytest.raises(LookupError, match="several ranks"):  # other ranks: still asked
        choose([*sessions, {**sessions[0], "rank": 1}], "g", None)
    assert choose(sessions, "g", 0, thread="second")["thread"] == "second"  # asked for
    with pytest.raises(LookupError, match=r"thread=third; waiting: .*\(thread first\)"):
        choose(sessions, "g", 0, thread="third")
    for expected, also in (("first", "in other"), ("second", None)):
        session = choose(waiting(tmp_path), "g", 0)  # the longest waiting first
        assert session["thread"] == expected
        assert (also in session["also"][0]) if also else session["also"] == []
        keys, typed = os.pipe()
        os.write(typed, b"c\n")
        os.close(typed)
        out = io.StringIO()
        with open(keys, "rb") as stdin:
            attach(session, stdin, out)
        assert f"(thread {expected})" in out.getvalue() and "continuing" in out.getvalue()
        assert ("also waits at" in out.getvalue()) == bool(also)
    rank.join()
    assert rank.results == {"first": 42, "second": "other"}
    assert waiting(tmp_path) == []


def test_a_session_of_a_live_process_of_the_same_rank_stays_a_dead_ones_goes(rank, tmp_path):
    """A forked child's (a DataLoader worker's) session: removed at the rank's next stop."""
    from asyncrl.actors.debugger import birth, place

    debug, dead = tmp_path / "debug", subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        for name, pid in (("live", live.pid), ("dead", dead.pid)):
            _write_session(debug, name, group="g", pid=pid, start=birth(pid), **place())
        rank.start("call", _stops_then_calls_helper)
        rank.next_stop()
        assert (debug / "live.json").exists() and not (debug / "dead.json").exists()
        with _connect(rank.session("in _stops")) as sock:
            _until(sock, b"(asyncrl-pdb g:0)")
            sock.sendall(b"c\n")
        rank.join()
    finally:
        live.kill()
        live.wait()
    assert rank.results == {"call": 42}


def test_a_token_trickled_a_byte_at_a_time_is_cut_off_at_the_deadline(rank, monkeypatch):
    """The timeout was per byte: a local user sending one every 9 s held the breakpoint's
    one connection for ~40 minutes, and `asyncrl attach` waited behind it."""
    monkeypatch.setattr("asyncrl.actors.debugger.TOKEN_TIMEOUT_S", 1.0)
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    session = rank.session()
    with socket.create_connection(("127.0.0.1", session["port"]), timeout=0.3) as slow:
        for _ in range(16):  # a byte every 0.3 s, until the rank hangs up (or ~5 s)
            try:
                if slow.recv(1) == b"":
                    break
            except TimeoutError:
                slow.sendall(b"0")
            except ConnectionResetError:  # (it closed with a byte unread)
                break
        else:
            pytest.fail("the rank still reads a token trickled for 5 s")
    with _connect(session) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
    rank.join()
    assert rank.results == {"call": 42}


class Screen(io.StringIO):
    """A terminal: what is written is kept (getvalue) and handed to a test waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: queue.Queue[str] = queue.Queue()

    def write(self, text: str) -> int:
        self.shown.put(text)
        return super().write(text)


def pdb_listening() -> socket.socket:
    """A socket standing in for a rank's debugger."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server


def attach_typing_nothing(server: socket.socket, screen: Screen) -> None:
    """`asyncrl attach` to `server`'s session, no keys typed, until the session ends."""
    from asyncrl.controller.attach import attach

    keys = os.pipe()
    try:
        with os.fdopen(keys[0]) as stdin:
            attach({"port": server.getsockname()[1], "token": "t", "group": "g", "rank": 0,
                    "where": "w"}, stdin=stdin, stdout=screen)
    finally:
        os.close(keys[1])
        server.close()


def test_attach_shows_a_character_split_between_two_reads_whole():
    """pdb's output arrives in pieces: a UTF-8 character cut between two showed as two
    replacement characters."""
    server, screen = pdb_listening(), Screen()

    def rank() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(100)  # the token
            conn.sendall("é".encode()[:1])
            while "attached" in screen.shown.get(timeout=30):  # the first byte was read
                pass  # and shown
            conn.sendall("é".encode()[1:] + b"\n")

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    attach_typing_nothing(server, screen)
    thread.join(30)
    rest = []
    while not screen.shown.empty():
        rest.append(screen.shown.get())
    assert "".join(rest) == "é\n"


def test_a_rank_that_continues_with_input_unread_ends_the_session_not_an_error():
    """The rank's close with typed input unread sends a reset: `asyncrl attach` said the rank
    "no longer waits" and exited 1 after a session that went as it should."""
    import struct

    server, screen = pdb_listening(), Screen()

    def rank() -> None:
        conn, _ = server.accept()
        conn.recv(100)  # the token
        conn.sendall(b"(Pdb) ")
        while "(Pdb)" not in screen.shown.get(timeout=30):  # shown: what follows is the
            pass  # reset
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset, as a close with input unread sends

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    attach_typing_nothing(server, screen)
    thread.join(30)
    assert screen.getvalue().endswith("(Pdb) ")


def test_the_attach_clients_end_of_input_continues_the_rank_as_pdb_does(rank):
    """Ctrl-D (or a file of commands with no `c` at its end): the client stopped reading
    its input and waited, and the rank's pdb waited for a command: both hung."""
    from asyncrl.controller.attach import attach

    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    keys, typed = os.pipe()
    os.write(typed, b"p x\n")
    os.close(typed)
    out = io.StringIO()
    done = threading.Event()

    def client() -> None:
        with open(keys, "rb") as stdin:
            attach(rank.session(), stdin, out)
        done.set()
    threading.Thread(target=client, daemon=True).start()
    assert done.wait(30), "the attach client still waits after its input ended"
    rank.join()
    assert rank.results == {"call": 42}
    assert "g:0) 20\n" in out.getvalue() and "continuing" in out.getvalue()


def test_restart_and_interact_are_refused_on_a_rank_and_the_call_goes_on(rank):
    """pdb's `restart` raised pdb.Restart into the worker's method (the call failed, the
    connection stayed open); `interact` read the rank's own stdin."""
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        for command in (b"restart\n", b"run\n", b"interact\n"):
            sock.sendall(command)
            assert "is not available on a rank" in _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
        _until(sock, b"\n")
    rank.join()
    assert rank.results == {"call": 42}


def test_pythonbreakpoint_0_turns_breakpoints_off_on_ranks(monkeypatch):
    from asyncrl.actors import debugger

    monkeypatch.setenv(debugger.DEBUG_DIR_ENV, "/nonexistent/never-used")
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    called = []
    monkeypatch.setattr(debugger, "_break", called.append)
    assert debugger.breakpointhook() is None and called == []
    monkeypatch.setenv("PYTHONBREAKPOINT", "")
    debugger.breakpointhook()
    assert len(called) == 1  # unset: asyncrl's wait for `asyncrl attach`


def test_a_link_planted_where_the_session_file_goes_is_replaced_not_followed(rank, tmp_path):
    """The session file was written through `<session>.partial` opened with O_TRUNC: a link
    planted there (a run dir others can write) truncated and overwrote the file it named."""
    import stat

    go = threading.Event()

    def call() -> int:
        go.wait(30)  # (until the link is planted: the file's name holds this thread's id)
        return _stops_then_calls_helper()
    rank.start("call", call)
    folder, victim = tmp_path / "debug", tmp_path / "victim"
    folder.mkdir(0o700)
    victim.write_text("mine")
    (folder / f"g-0-{os.getpid()}-{rank.threads[-1].ident}.partial").symlink_to(victim)
    go.set()
    rank.next_stop()
    assert victim.read_text() == "mine"
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
    rank.join()
    assert rank.results == {"call": 42}
    shutil.rmtree(folder)
    rank.start("again", _stops_then_calls_helper)
    rank.next_stop()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # made for its owner alone
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
    rank.join()
    assert rank.results["again"] == 42


def test_a_debug_folder_others_can_use_is_refused_and_a_planted_fifo_blocks_nothing(
        rank, tmp_path):
    """A debug folder another user of a shared run directory made first was used as it
    was: a session swapped there sends `asyncrl attach`, and what is typed into pdb, to
    their listener; a FIFO named *.json there blocked breakpoint() and `asyncrl attach`."""
    from asyncrl.cli import main

    folder = tmp_path / "debug"
    folder.mkdir(0o700)
    os.mkfifo(folder / "planted.json")  # read by both sides: never opened for a read that
    assert main(["attach", str(tmp_path), "--list"]) == 0  # blocks
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
    rank.join()
    assert rank.results["call"] == 42
    folder.chmod(0o770)  # a group's: others could swap a session in it
    rank.start("refused", _stops_then_calls_helper)
    rank.join()
    assert isinstance(rank.results["refused"], PermissionError)
    assert "is not this user's alone" in str(rank.results["refused"])


def test_a_rank_waiting_here_writes_its_identity_and_is_listed_as_here(rank):
    """What tells the rank apart past its hostname and pid (start time, namespaces) is in
    its session, and attach from the same process's namespaces lists it as here."""
    from asyncrl.actors.procs import birth

    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    session = rank.session()
    with _connect(session) as sock:  # (first: a failed check leaves no rank waiting)
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"c\n")
    rank.join()
    assert rank.results["call"] == 42
    assert session["here"] and session["pid"] == os.getpid()
    assert session.get("start") == birth(os.getpid())
    assert {k: session.get(k) for k in ("pid_ns", "net_ns")} == _namespaces()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert session.get("boot") == f.read().strip()
