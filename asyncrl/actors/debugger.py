"""`breakpoint()` inside a worker: a pdb session the user reaches with `asyncrl attach`.

    rank: breakpoint() ──▶ listen on 127.0.0.1:<free port> ──▶ RUN_DIR/debug/<group>-<rank>.json
          (host, port, pid, where, a one-time token; the file is 0600)
          prints "<group>:<rank> waits for a debugger: asyncrl attach RUN_DIR"
    user: asyncrl attach RUN_DIR ──▶ lists waiting ranks ──▶ connects, sends the token ──▶ pdb

The call stays in the debugger until the user continues (`c`); the group's later calls wait
behind it, other groups go on, heartbeats keep flowing (they run on another thread).
"""

from __future__ import annotations

import json
import os
import pdb
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

DEBUG_DIR_ENV = "ASYNCRL_DEBUG_DIR"
TOKEN_TIMEOUT_S = 10.0


class _Conn:
    """The socket as the text stream pdb reads and writes."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        # two streams: one text stream for both would drop what it read ahead on a write
        self._in = sock.makefile("r", encoding="utf-8", newline="\n")
        self._out = sock.makefile("w", buffering=1, encoding="utf-8", newline="\n")

    def readline(self) -> str:
        return self._in.readline()

    def write(self, text: str) -> int:
        self._out.write(text)
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        for closing in (self._in.close, self._out.close, self._sock.close):
            try:
                closing()
            except OSError:
                pass


def _token_line(conn: socket.socket) -> str:
    """The first line, byte by byte: what follows it is pdb's, and must stay unread."""
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < 256:
            byte = conn.recv(1)
            if not byte:
                break
            line += byte
    except OSError:
        return ""
    return line.decode(errors="replace").strip()


def _wait_for_debugger(folder: Path, where: str) -> _Conn:
    group = os.environ.get("ASYNCRL_GROUP", "group")
    rank = os.environ.get("RANK", "0")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    token = secrets.token_hex(16)
    folder.mkdir(parents=True, exist_ok=True)
    session = folder / f"{group}-{rank}.json"
    fd = os.open(session, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"group": group, "rank": int(rank), "pid": os.getpid(),
                   "host": "127.0.0.1", "port": server.getsockname()[1], "token": token,
                   "where": where, "since": time.time()}, f)
    print(f"[asyncrl] {group}:{rank} waits for a debugger at {where}: run "
          f"`asyncrl attach {folder.parent}`", file=sys.stderr, flush=True)
    try:
        while True:
            conn, _ = server.accept()
            conn.settimeout(TOKEN_TIMEOUT_S)
            sent = _token_line(conn)
            if secrets.compare_digest(sent, token):
                conn.settimeout(None)
                return _Conn(conn)
            conn.close()  # a wrong or missing token: not our user
    finally:
        server.close()
        session.unlink(missing_ok=True)


def breakpointhook(*args: Any, **kwargs: Any) -> None:
    """sys.breakpointhook on a rank: wait for `asyncrl attach`, then pdb at the caller."""
    _break(sys._getframe(1))


def breakpoint() -> None:
    """`asyncrl.breakpoint()`: the same as the builtin inside a worker."""
    _break(sys._getframe(1))


def _break(frame: Any) -> None:
    folder = os.environ.get(DEBUG_DIR_ENV)
    if not folder:
        print("[asyncrl] breakpoint() without a run directory: ignored", file=sys.stderr)
        return
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    conn = _wait_for_debugger(Path(folder), where)
    debugger = pdb.Pdb(stdin=conn, stdout=conn)  # type: ignore[arg-type]
    debugger.use_rawinput = False
    debugger.prompt = f"(asyncrl-pdb {os.environ.get('ASYNCRL_GROUP')}:" \
                      f"{os.environ.get('RANK')}) "
    _close_on_exit(debugger, conn)
    debugger.set_trace(frame)


def _close_on_exit(debugger: pdb.Pdb, conn: _Conn) -> None:
    """Close the connection when the user continues (pdb stops tracing)."""
    original = debugger.set_continue

    def set_continue() -> None:
        original()
        conn.write("[asyncrl] continuing\n")
        conn.flush()
        conn.close()

    debugger.set_continue = set_continue  # type: ignore[method-assign]


def install() -> None:
    sys.breakpointhook = breakpointhook
