"""`breakpoint()` inside a worker: a pdb session the user reaches with `asyncrl attach`.

    rank: breakpoint() ──▶ listen on 127.0.0.1:<free port>
          ──▶ RUN_DIR/debug/<group>-<rank>-<pid>-<thread>.json (one per waiting breakpoint: a
          concurrent=True call may stop beside the in-order one; host, port, pid, thread,
          where, a one-time token, and what tells the rank apart past its hostname and pid:
          boot id, pid and net namespaces, start time; the file is 0600)
          prints "<group>:<rank> waits for a debugger on <host>: asyncrl attach RUN_DIR"
    user, on that host (in the rank's container or net namespace, if it runs in one):
          asyncrl attach RUN_DIR ──▶ lists waiting ranks ──▶ connects, sends the token ──▶ pdb

The call stays in the debugger until the user continues (`c`, `q`, or the attach client
goes away: its connection closes either way; `q` is `c` here: failing the call would leave
its group's other ranks waiting in their collectives); a breakpoint set with `b` then waits
for a new `asyncrl attach` when reached. The group's later calls wait behind it, other
groups go on, heartbeats keep flowing (they run on another thread).
"""

from __future__ import annotations

import json
import os
import pdb
import secrets
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from asyncrl.actors.procs import birth, pid_alive

DEBUG_DIR_ENV = "ASYNCRL_DEBUG_DIR"
TOKEN_TIMEOUT_S = 10.0


class _Conn:
    """The socket as the text stream pdb reads and writes. A client that went away reads as
    end of input (pdb then continues), and what is written after that is dropped."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        # two streams: one text stream for both would drop what it read ahead on a write;
        # a byte that is not UTF-8 (a latin-1 terminal) read as EOF would end the session,
        # and a lone surrogate (a filename's) written would drop the output: both replaced
        self._in = sock.makefile("r", encoding="utf-8", errors="replace", newline="\n")
        self._out = sock.makefile("w", buffering=1, encoding="utf-8",
                                  errors="backslashreplace", newline="\n")
        self.closed = False

    def readline(self) -> str:
        try:
            return self._in.readline()
        except (OSError, ValueError):  # reset by the client, or closed here
            return ""

    def write(self, text: str) -> int:
        try:
            self._out.write(text)
        except (OSError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            self._out.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.closed = True
        for closing in (self._in.close, self._out.close, self._sock.close):
            try:
                closing()
            except OSError:
                pass


def _token_line(conn: socket.socket) -> bytes:
    """The first line, byte by byte: what follows it is pdb's, and must stay unread. All of
    it within TOKEN_TIMEOUT_S (a timeout per byte let a client trickling bytes hold the one
    connection a breakpoint accepts for as long as it liked)."""
    line, deadline = b"", time.monotonic() + TOKEN_TIMEOUT_S
    try:
        while not line.endswith(b"\n") and len(line) < 256:
            if (left := deadline - time.monotonic()) <= 0:
                return b""
            conn.settimeout(left)
            byte = conn.recv(1)
            if not byte:
                break
            line += byte
    except OSError:
        return b""
    return line.strip()  # bytes: compare_digest refuses str with non-ASCII characters


def _wait_for_debugger(folder: Path, where: str) -> _Conn:
    group = os.environ.get("ASYNCRL_GROUP", "group")
    rank = os.environ.get("RANK", "0")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # (its files: tokens and ports)
    st = folder.stat()
    # made before us by another user of a shared run directory, a session swapped there
    # would send our `asyncrl attach`, and what we type into pdb, to their listener
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{folder} is not this user's alone (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o777:o}): a breakpoint's session there could be read or "
            f"replaced by another user; remove it (or chmod 700 it)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    token = secrets.token_hex(16)
    _remove_stale(folder, group, int(rank))
    thread = threading.current_thread()
    # the pid too: a forked child (a DataLoader worker) keeps the thread's ident
    session = folder / f"{group}-{rank}-{os.getpid()}-{thread.ident}.json"
    # written aside and renamed: `asyncrl attach` (or a test) never reads half a file
    partial = session.with_suffix(".partial")
    partial.unlink(missing_ok=True)  # (never followed: a link planted there is replaced)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"group": group, "rank": int(rank), "pid": os.getpid(),
                   "start": birth(os.getpid()), **place(), "thread": thread.name,
                   "host": socket.gethostname(), "port": server.getsockname()[1],
                   "token": token, "where": where, "since": time.time()}, f)
    os.replace(partial, session)
    print(f"[asyncrl] {group}:{rank} waits for a debugger at {where}: run "
          f"`asyncrl attach {folder.parent}` on {socket.gethostname()}", file=sys.stderr,
          flush=True)
    try:
        while True:
            conn, _ = server.accept()
            sent = _token_line(conn)
            if secrets.compare_digest(sent, token.encode()):
                conn.settimeout(None)
                return _Conn(conn)
            conn.close()  # a wrong or missing token: not our user
    finally:
        server.close()
        session.unlink(missing_ok=True)


def _remove_stale(folder: Path, group: str, rank: int) -> None:
    """Remove sessions this group and rank left from an earlier process (one killed while it
    waited): nobody would answer there. Those of a process that runs (a forked child of this
    rank stopped in its own breakpoint) stay."""
    mine = place()
    for path in folder.glob("*.json"):
        old = read_session(path)
        try:
            if old is None or old["group"] != group or old["rank"] != rank or \
                    old["pid"] == os.getpid():
                continue
            # of another machine or pid namespace, its pid means nothing here: this group
            # and rank run here now, so that one was an earlier process
            if old.get("host") == socket.gethostname() and all(
                    old.get(k) is None or mine[k] is None or old[k] == mine[k]
                    for k in ("boot", "pid_ns")) and not gone(old):
                continue
            path.unlink()
        except (OSError, KeyError, TypeError, ValueError):
            continue  # another rank's, removed right now


def gone(session: dict[str, Any]) -> bool:
    """Whether the process of a session reachable from here no longer runs: its pid is
    gone, or belongs to a later process (another start time: the old port may be anyone's
    now)."""
    pid = int(session.get("pid", 0))
    if not pid_alive(pid):
        return True
    started, now = session.get("start"), birth(pid)
    return started is not None and now is not None and str(started) != now


def place() -> dict[str, str | None]:
    """Where this process runs, past its hostname: the machine's boot id, its pid and net
    namespaces (None where /proc does not tell). A netns host shares the hostname but not
    the loopback, a container maybe neither: `asyncrl attach` reaches a session only from
    its machine and net namespace, and prunes it only from its pid namespace too."""
    return {"boot": _read_proc("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _namespace("pid"), "net_ns": _namespace("net")}


def _namespace(kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")  # e.g. "pid:[4026531836]"
    except OSError:
        return None


def _read_proc(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def read_session(path: Path) -> dict[str, Any] | None:
    """A session file's contents; None for one gone, unreadable, or not a plain file of
    this user (never through a link; a FIFO planted there would block a plain read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        session = json.loads(os.read(fd, 1 << 16))
        return session if isinstance(session, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """sys.breakpointhook on a rank: wait for `asyncrl attach`, then pdb at the caller.
    PYTHONBREAKPOINT as Python reads it: "0" turns breakpoint() off, another hook is
    called instead."""
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    if chosen == "0":
        return None
    if chosen:
        return sys.__breakpointhook__(*args, **kwargs)
    _break(sys._getframe(1))
    return None


def breakpoint() -> None:
    """`asyncrl.breakpoint()`: the same as the builtin inside a worker."""
    _break(sys._getframe(1))


def _break(frame: Any) -> None:
    folder = os.environ.get(DEBUG_DIR_ENV)
    if not folder:
        print("[asyncrl] breakpoint() without a run directory: ignored", file=sys.stderr)
        return
    debugger = _RemotePdb(_wait_for_debugger(Path(folder), _where(frame)), Path(folder))
    debugger.prompt = f"(asyncrl-pdb {os.environ.get('ASYNCRL_GROUP')}:" \
                      f"{os.environ.get('RANK')}) "
    debugger.set_trace(frame)


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class _RemotePdb(pdb.Pdb):
    """pdb over the attach connection, which it closes when the user continues; a breakpoint
    reached after that waits for a new attach."""

    def __init__(self, conn: _Conn, folder: Path):
        super().__init__(stdin=conn, stdout=conn)  # type: ignore[arg-type]
        self.use_rawinput = False
        self._conn, self._folder = conn, folder

    def interaction(self, frame: Any, traceback: Any) -> None:
        if self._conn.closed:  # stopped at a breakpoint after `c`: nobody is connected
            self._conn = _wait_for_debugger(self._folder, _where(frame))
            self.stdin = self.stdout = self._conn  # type: ignore[assignment]
        super().interaction(frame, traceback)

    def set_continue(self) -> None:
        super().set_continue()
        left = sum(len(lines) for lines in self.get_all_breaks().values())
        note = (f"; {left} breakpoint(s) set: reaching one waits for `asyncrl attach` again "
                f"(`cl FILE:LINE` clears one)" if left else "")
        self._conn.write(f"[asyncrl] continuing{note}\n")
        self._conn.flush()
        self._conn.close()

    def do_quit(self, arg: str) -> bool:
        """q(uit): leave the debugger as `c` does: the call goes on (failing it would leave
        the group's other ranks waiting in their collectives)."""
        self._conn.write("[asyncrl] quit: the call goes on\n")
        self.do_continue(arg)
        return True

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:
        """The attach client went away: let the method go on, as `c` would."""
        self.do_continue(arg)
        return True

    def do_run(self, arg: str) -> bool:
        """run/restart: not on a rank (it would fail the call, and the group's other ranks
        would wait in their collectives)."""
        self.message("[asyncrl] restart is not available on a rank: `c` lets the call go on")
        return False

    do_restart = do_run

    def do_interact(self, arg: str) -> bool:
        """interact: not on a rank (it reads the rank's own stdin, not the attach client)."""
        self.message("[asyncrl] interact is not available on a rank: `p`/`!` run a statement")
        return False


def install() -> None:
    sys.breakpointhook = breakpointhook
