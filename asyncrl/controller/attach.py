"""`asyncrl attach [RUN_DIR] [--group G --rank R]`: reach a rank waiting in `breakpoint()`.

Lists the waiting ranks (RUN_DIR/debug/*.json, written by the ranks: one per waiting
breakpoint, so a rank may have several), connects to the chosen one (several: picked from a
numbered list on a terminal) with its one-time token, and joins the terminal to its pdb until
it continues. Leaving (Ctrl-C) lets the rank go on."""

from __future__ import annotations

import codecs
import os
import select
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.actors.debugger import gone, place, read_session


def waiting(run_dir: Path) -> list[dict[str, Any]]:
    """The breakpoints ranks wait at. Those reachable from here (this machine, and this
    process's net namespace: its debugger listens on its loopback) have `here` True; the
    others (a shared run directory's other hosts, a netns host's ranks) say in `elsewhere`
    where to run `asyncrl attach`. A rank of this pid namespace too (a `docker --network
    host` container's pids mean nothing here) that died or was stopped there (it exits
    with os._exit: its file stays), or whose pid another process now has, is left out and
    its file removed."""
    folder = Path(run_dir) / "debug"
    sessions = []
    mine = place()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        session = read_session(path)
        if session is None:
            continue  # removed right now, unreadable, or not this user's
        session["elsewhere"] = _elsewhere(session, mine)
        session["here"] = session["elsewhere"] is None
        if session["here"] and not _differs(session, mine, "pid_ns") and gone(session):
            path.unlink(missing_ok=True)
            continue
        sessions.append(session)
    return sessions


def _elsewhere(session: dict[str, Any], mine: dict[str, str | None]) -> str | None:
    """Where the session's rank waits and where to attach from, when not from here (its
    debugger listens on its own loopback: another machine's, or another net namespace's;
    another pid namespace alone does not matter); None when here."""
    host = session.get("host")
    if host not in ("127.0.0.1", socket.gethostname()):
        return f"on host {host}: run `asyncrl attach` there"
    if _differs(session, mine, "boot"):
        return f"on another machine also named {host}: run `asyncrl attach` there"
    if _differs(session, mine, "net_ns"):
        return (f"on this host in another network namespace ({session['net_ns']}): a "
                f"container's or a netns host's; run `asyncrl attach` inside it (`docker "
                f"exec -it CONTAINER asyncrl attach RUN_DIR`, `ip netns exec NAME asyncrl "
                f"attach RUN_DIR`)")
    return None


def _differs(session: dict[str, Any], mine: dict[str, str | None], field: str) -> bool:
    """Whether the session's `field` (boot id, a namespace) is not this process's; a field
    either side lacks (a session written before the field was, no /proc) does not count."""
    return session.get(field) is not None and mine.get(field) is not None \
        and session[field] != mine[field]


def newest_waiting(root: Path) -> Path | None:
    """The run folder under `root` (where launches without --run-dir go) whose debug/ folder
    changed last and where a rank waits; None if none."""
    def changed(debug: Path) -> float:
        try:
            return debug.stat().st_mtime
        except OSError:  # (removed meanwhile)
            return 0.0
    for debug in sorted(root.glob("*/debug"), key=changed, reverse=True):
        if waiting(debug.parent):
            return debug.parent
    return None


def describe(session: dict[str, Any]) -> str:
    """One line on a waiting breakpoint: who, where, and where to attach from if not here."""
    s = session
    return (f"{s['group']}:{s['rank']}  host {s['host']}  pid {s.get('pid')}  thread "
            f"{s.get('thread')}  at {s['where']}" + (
                f"  ({s['elsewhere']})" if s.get("elsewhere") else ""))


def choose(sessions: list[dict[str, Any]], group: str | None, rank: int | None,
           thread: str | None = None,
           ask: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The session to attach to. Several ranks match: `ask` (a terminal's input(): None
    where there is none) reads the user's pick from a numbered list, else refused."""
    picked = [s for s in sessions if (group is None or s["group"] == group) and
              (rank is None or s["rank"] == rank) and
              (thread is None or s.get("thread") == thread)]
    if not picked:
        listed = ", ".join(f"{s['group']}:{s['rank']} (thread {s.get('thread')})"
                           for s in sessions) or "none"
        raise LookupError(f"no rank waits for a debugger there matching group={group} "
                          f"rank={rank} thread={thread}; waiting: {listed}")
    if len({(s["group"], s["rank"]) for s in picked}) > 1:
        if ask is not None:  # (a breakpoint() in SPMD code stops every rank of the group)
            one = _pick(picked, ask)
            return choose(sessions, one["group"], one["rank"], one.get("thread"))
        listed = ", ".join(f"{s['group']}:{s['rank']} ({s['where']})" for s in picked)
        raise LookupError(f"several ranks wait for a debugger: {listed}; pick one with "
                          f"--group and --rank")
    # one rank stopped in several threads (a concurrent=True call beside the in-order one):
    # the longest waiting first (or the --thread asked for), the others named
    picked.sort(key=lambda s: s.get("since", 0.0))
    if not picked[0].get("here", True):  # its debugger listens on its own loopback
        where = picked[0].get("elsewhere") or \
            f"on host {picked[0]['host']}: run `asyncrl attach` there"
        raise LookupError(f"{picked[0]['group']}:{picked[0]['rank']} waits for a debugger "
                          f"{where}")
    return {**picked[0], "also": [s["where"] for s in picked[1:]]}


def _pick(picked: list[dict[str, Any]], ask: Callable[[str], str]) -> dict[str, Any]:
    """The session whose number the user gives, asked again until it is one of the list."""
    picked = sorted(picked, key=lambda s: (s["group"], s["rank"], s.get("since", 0.0)))
    listed = "".join(f"{i}) {describe(s)}\n" for i, s in enumerate(picked, 1))
    prompt = f"several ranks wait for a debugger:\n{listed}attach to which (1-{len(picked)})? "
    while True:
        try:
            answer = ask(prompt).strip()
        except (EOFError, KeyboardInterrupt):
            raise LookupError("no rank chosen; pick one with --group and --rank") from None
        if answer.isascii() and answer.isdigit() and 1 <= int(answer) <= len(picked):
            return picked[int(answer) - 1]
        prompt = f"{answer!r} is none of them; give a number from 1 to {len(picked)}: "


def connect(session: dict[str, Any]) -> socket.socket:
    """A connection to the rank's debugger, its token sent. OSError: the rank no longer
    waits there (it continued, or died, since it was listed)."""
    sock = socket.create_connection(("127.0.0.1", session["port"]), timeout=10)
    try:
        sock.settimeout(None)
        sock.sendall((session["token"] + "\n").encode())
    except BaseException:
        sock.close()
        raise
    return sock


def attach(session: dict[str, Any], stdin: Any = sys.stdin, stdout: Any = sys.stdout,
           sock: socket.socket | None = None) -> None:
    """Bridge the terminal and the rank's pdb until the rank closes the connection (`sock`:
    made by `connect`, so that its errors are told apart; else made here)."""
    sock = connect(session) if sock is None else sock
    thread = f" (thread {session['thread']})" if session.get("thread") else ""
    stdout.write(f"attached to {session['group']}:{session['rank']} at {session['where']}"
                 f"{thread}\n")
    if session.get("also"):
        stdout.write(f"this rank also waits at {'; '.join(session['also'])}: run `asyncrl "
                     f"attach` again once this one continues\n")
    stdout.flush()
    keys = stdin.fileno()  # raw reads: a buffered reader would hide lines from select
    inputs = [sock, keys]
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span
    # two reads
    try:
        while True:
            ready, _, _ = select.select(inputs, [], [])
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    return  # the rank continued
                stdout.write(text.decode(data))
                stdout.flush()
            if keys in ready:
                typed = os.read(keys, 65536)
                if not typed:  # end of input (Ctrl-D): the rank's pdb reads its end and
                    inputs.remove(keys)  # continues, as pdb does; what it says still comes
                    sock.shutdown(socket.SHUT_WR)
                    continue
                sock.sendall(typed)
    except (ConnectionResetError, BrokenPipeError):  # the rank continued with input unread
        return  # (its close resets the connection): the session's end, as a plain close
    except KeyboardInterrupt:  # the rank reads the closed connection as `c`
        stdout.write("\n[asyncrl] detached: the rank continues\n")
        stdout.flush()
    finally:
        sock.close()
