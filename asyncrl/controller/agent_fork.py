"""torchrun agents forked from one warm process.

A group's agent is torchrun (`torch.distributed.run`), which imports torch before it starts a
rank: 2.6 s of the 5.5 s a 1-rank group takes to start on 2 cores, paid again by every group
of a flow and by every restart. One `AgentServer` per process (`shared_server()`, started with
the first controller) imports it once, then forks each agent from it (the server is
single-threaded: fork is safe there, as DataLoader workers fork after importing torch). The
agent runs torchrun's own `main` with the group's arguments, environment, working directory
and log, in a session of its own, as a new torchrun process would.

Lines of JSON on the server's stdin and on a private copy of its stdout (fd 1 itself goes to
stderr, so a stray print cannot break the protocol): {"argv", "env", "cwd", "umask", "log",
"die_with_parent"} asks for an agent, answered {"pid"} or {"error"} in order; {"exit": pid,
"code"} reports one that ended (`code` as Popen gives it: negative for a signal). The server
ends when its stdin closes; agents started with die_with_parent then get SIGTERM (so a dead
server takes its groups down, as a dead controller does).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from asyncrl.actors.procs import birth, pid_alive, runs
from asyncrl.actors.rank_client import current_umask
from asyncrl.actors.rank_fork import (
    RANK_ENV_DEFAULTS,
    StartUp,
    preload,
    rank_threads,
    run_forked,
    serve_ranks,
    set_title,
    take_place,
)

log = logging.getLogger("asyncrl")
_PR_SET_PDEATHSIG = 1
READY_TIMEOUT = 120.0  # the server's torch import, on a loaded machine
ANSWER_TIMEOUT = 60.0
RANK_EXITS_KEPT = 4096  # forked ranks' exit codes kept for the supervisor


_PRCTL: Any = None
try:  # resolved once, here: a child forked from a process with threads must not dlopen
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # (another thread may have held the
except (OSError, AttributeError):  # loader's lock at the fork: the child would hang)
    pass


def die_with_parent(parent: int | None = None) -> None:
    """SIGTERM to this process when its parent (the thread that started it) exits. With
    `parent`, the pid it was forked from: gone already (it exited before the death signal
    was set, which a later exit alone would send), SIGTERM now."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def forking_enabled(what: str = "AGENTS") -> bool:
    """ASYNCRL_FORK_AGENTS=0: torchrun agents start anew (and so do ranks);
    ASYNCRL_FORK_RANKS=0: ranks do."""
    return os.environ.get(f"ASYNCRL_FORK_{what}", "1").lower() not in ("0", "false", "no")


# -- the server ------------------------------------------------------------------------------
def _agent(torchrun: Any, ask: dict[str, Any], proto: int, ranks: Any, server: int) -> None:
    """In the forked child of the server (`server`, its pid): become the group's torchrun
    (run by run_forked)."""
    os.close(proto)
    if ranks is not None:
        ranks.forget()
    os.setsid()
    if ask["die_with_parent"]:
        die_with_parent(server)
    out = os.open(ask["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    take_place(ask)
    sys.argv = [torchrun.__file__, *ask["argv"]]
    set_title(" ".join([sys.executable, "-m", "torch.distributed.run", *ask["argv"]]))
    torchrun.main(ask["argv"])


def serve() -> None:
    started_with = dict(os.environ)  # before imports set some
    server = os.getpid()
    proto = os.dup(1)  # the protocol's own fd: fd 1 becomes stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid must see the agents
    # (first while the environment is as the process began: setproctitle takes its space)
    set_title(f"{sys.executable} -m asyncrl.controller.agent_fork [the agent server of "
              f"{os.getppid()}]")

    def send(msg: dict[str, Any]) -> None:
        os.write(proto, (json.dumps(msg) + "\n").encode())  # unbuffered: nothing to copy

    import torch.distributed.run as torchrun  # the import every agent used to pay

    forks_ranks = forking_enabled("RANKS")
    if forks_ranks:
        preload()  # what every rank imports
    start_up = StartUp(started_with)
    ranks = serve_ranks(started_with, start_up) if forks_ranks else None
    send({"ready": True, "ranks": ranks.address if ranks is not None else None})
    children: set[int] = set()  # agents
    pending = b""
    while True:
        poller = select.poll()  # (select cannot watch fds past 1024: one per forked rank)
        for fd in (0, *(ranks.watched() if ranks else ())):
            poller.register(fd, select.POLLIN)
        readable = [fd for fd, _ in poller.poll(50)]
        for fd in readable:
            if fd != 0 and ranks is not None:
                try:
                    forked = ranks.readable(fd, close_in_child=[proto])
                except Exception:  # noqa: BLE001 - one rank's trouble ends no other group
                    traceback.print_exc()
                    continue
                if forked is not None:  # (its pid may be an earlier rank's: not its exit)
                    send({"rank_start": forked})
        if 0 in readable:
            data = os.read(0, 1 << 16)
            if not data:
                os._exit(0)  # the controller closed (or died): no teardown of torch
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                ask = json.loads(line)
                why = start_up.differs(ask["env"])  # (LOGLEVEL: torchrun read it here)
                if why:
                    send({"error": why})
                    continue
                try:
                    pid = os.fork()
                except OSError as e:  # this group's start fails, not the others
                    send({"error": f"fork: {e}"})
                    continue
                if pid == 0:
                    run_forked(functools.partial(_agent, torchrun, ask, proto, ranks,
                                                 server))
                children.add(pid)
                # its start time: read before this loop can reap it, so that the controller
                # tells it from a later process given the pid again
                send({"pid": pid, "born": birth(pid)})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            if pid in children:
                children.discard(pid)
                send({"exit": pid, "code": code})
            elif ranks is not None and ranks.exited(pid, code):
                send({"rank_exit": pid, "code": code})  # (before torchrun can tell it)


# -- the controller's side ---------------------------------------------------------------------
class ForkedAgent:
    """A Popen-like handle on an agent the server forked (pid, poll, wait)."""

    def __init__(self, pid: int, born: str | None = None):
        self.pid, self.born = pid, born  # (born: its start time, as the server read it)
        self.returncode: int | None = None
        self._done = threading.Event()

    def is_itself(self) -> bool:
        """Whether its pid still names it: the server reaps it as it exits, and the pid may
        be another process's before the controller hears of the exit."""
        return pid_alive(self.pid) if self.born is None else runs(f"{self.pid}:{self.born}")

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"torchrun agent {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


def _stop_orphan(pid: int, born: str | None) -> None:
    """An agent forked for a request nobody waits for any more: torchrun stops its ranks on
    SIGTERM (its stand-ins, and with them the ranks the server forked). Only while its pid
    still names it (the answer came late: it may have exited, and the pid been reused)."""
    if not ForkedAgent(pid, born).is_itself():
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(agent: ForkedAgent) -> None:
    """An agent the server can no longer report on: ended when its pid is gone."""
    while agent.is_itself():
        threading.Event().wait(0.1)
    agent._exited(-signal.SIGKILL)


class AgentServer:
    """A server process and the controller's side of its protocol. It dies with the thread
    that started it (see `shared_server`)."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # asyncrl importable, as the ranks
        # the ranks' defaults too: read at start-up, they must be the server's to fork ranks
        env = {**RANK_ENV_DEFAULTS, **os.environ, "OMP_NUM_THREADS": rank_threads(os.environ),
               "PYTHONPATH": os.pathsep.join(
                   p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from asyncrl.controller.agent_fork import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._lock = threading.Lock()  # one request at a time: answers come in order
        self._answers: deque[dict[str, Any]] = deque()
        self._answered = threading.Condition()
        self._agents: dict[int, ForkedAgent] = {}
        self._ended: dict[int, int] = {}  # exits reported before their handle was made
        self._rank_exits: dict[int, int] = {}  # a forked rank's pid -> its exit code
        self._ready = threading.Event()
        self._ranks: str | None = None  # where it forks ranks (asyncrl.actors.rank_fork)
        self._eof = False  # the server's output ended: it reports nothing more
        self.broken = False  # an answer never came: not used again
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="asyncrl-agent-server")
        self._reader.start()

    def _read(self) -> None:
        try:
            with self._stdout:
                for line in self._stdout:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    self._take(msg)
        finally:
            with self._answered:  # its agents' ends are no longer reported
                self._eof = True
                self._answered.notify_all()
                left, self._agents = list(self._agents.values()), {}
            self._ready.set()
            for agent in left:
                threading.Thread(target=_watch, args=(agent,), daemon=True).start()

    def _take(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self._ranks = msg.get("ranks")
            self._ready.set()
        elif "pid" in msg or "error" in msg:
            with self._answered:
                if self.broken and "pid" in msg:  # its asker gave up and started torchrun
                    _stop_orphan(msg["pid"], msg.get("born"))  # anew: two jobs would serve
                    # one group
                    return
                self._answers.append(msg)
                self._answered.notify_all()
        elif "rank_start" in msg:
            with self._answered:
                self._rank_exits.pop(msg["rank_start"], None)
        elif "rank_exit" in msg:
            with self._answered:
                self._rank_exits[msg["rank_exit"]] = msg["code"]
                if len(self._rank_exits) > RANK_EXITS_KEPT:
                    del self._rank_exits[next(iter(self._rank_exits))]  # the oldest
        else:
            with self._answered:
                agent = self._agents.pop(msg["exit"], None)
                if agent is None:
                    self._ended[msg["exit"]] = msg["code"]
            if agent is not None:
                agent._exited(msg["code"])

    @property
    def alive(self) -> bool:
        return not self.broken and not self._eof and self.proc.poll() is None

    def rank_exit(self, pid: int) -> int | None:
        """The exit code of a rank this server forked (negative: the signal), None while it
        runs or if it was not one of its own."""
        with self._answered:
            return self._rank_exits.get(pid)

    def ranks_address(self) -> str | None:
        """Where this server forks ranks (once it is ready), or None: it does not."""
        if not self._ready.wait(READY_TIMEOUT):
            self.broken = True  # (start() refuses at once, not after as long again)
        return self._ranks

    def start(self, argv: list[str], env: dict[str, str], log: str,
              die_with_parent: bool) -> ForkedAgent:
        """An agent forked with these torchrun arguments; RuntimeError when the server cannot
        (the caller starts torchrun anew)."""
        if self.broken:  # (it did not get ready in time: a late answer would be an orphan's)
            raise RuntimeError("the torchrun agent server failed earlier (it did not start or "
                               "answer in time): it is not asked again")
        if not self._ready.wait(READY_TIMEOUT) or self._eof:
            self.broken = True
            raise RuntimeError("the torchrun agent server did not start")
        ask = {"argv": argv, "env": env, "cwd": os.getcwd(), "umask": current_umask(),
               "log": log, "die_with_parent": die_with_parent}
        with self._lock:
            try:
                self._stdin.write((json.dumps(ask) + "\n").encode())
                self._stdin.flush()
            except OSError as e:
                self.broken = True
                raise RuntimeError(f"the torchrun agent server is gone ({e})") from e
            except BaseException:  # (an interrupt) half a request may have gone
                self.broken = True
                raise
            with self._answered:
                try:
                    answered = self._answered.wait_for(lambda: self._answers or self._eof,
                                                       ANSWER_TIMEOUT) and self._answers
                except BaseException:  # an interrupt: the answer would go to the next
                    self.broken = True  # request
                    raise
                if not answered:
                    self.broken = True  # a late answer would go to the next request
                    raise RuntimeError("the torchrun agent server did not answer")
                answer = self._answers.popleft()
                if "error" in answer:
                    raise RuntimeError(f"the torchrun agent server: {answer['error']}")
                agent = ForkedAgent(answer["pid"], answer.get("born"))
                if agent.pid in self._ended:
                    agent._exited(self._ended.pop(agent.pid))
                elif self._eof:  # it ended after answering: watched by pid
                    threading.Thread(target=_watch, args=(agent,), daemon=True).start()
                else:
                    self._agents[agent.pid] = agent
        return agent

    def close(self) -> None:
        """Stop the server (agents still running get SIGTERM if they die with it). Its stdin
        closing ends it, unless a fork of the controller holds the pipe too: then a signal.
        One still importing torch has forked nothing (nothing is asked before it is ready)
        and reads no stdin until it is done: signalled at once."""
        try:
            self._stdin.close()
        except OSError:
            pass
        steps = ((None, 2.0), (self.proc.terminate, 5.0), (self.proc.kill, None))
        for stop, wait in steps if self._ready.is_set() else steps[1:]:
            if stop is not None:
                stop()
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._reader is not threading.current_thread():
            self._reader.join(10)


# -- one per process ---------------------------------------------------------------------------
class _Starter:
    """Starts servers from one thread that lives as long as the process: a parent-death
    signal follows the thread that forked, and a controller's thread may end before its
    process (a controller on a background thread)."""

    def __init__(self) -> None:
        self._asks: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True,
                         name="asyncrl-agent-server-starter").start()

    def _run(self) -> None:
        while True:
            make, done = self._asks.get()
            try:
                done.set_result(make())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

    def start(self) -> AgentServer:
        done: Future = Future()
        self._asks.put((AgentServer, done))
        return done.result()


_lock = threading.Lock()
_starter: _Starter | None = None
_server: AgentServer | None = None
_retired: list[AgentServer] = []  # servers no longer asked (broken) that still run


def shared_server() -> AgentServer | None:
    """This process's agent server, shared by its controllers: started on first use (its
    torch import runs while the caller goes on), again if it died; None if it cannot start
    (torchrun is then started anew). It ends with the process, or at `close_shared_server`;
    agents started to die with their controller die with it."""
    global _starter, _server
    gone = None  # closed after the lock (it may take seconds): other callers go on
    with _lock:
        if _server is not None and _server.alive:
            return _server
        old, _server = _server, None
        if old is not None and old.proc.poll() is None and old._agents:  # broken, yet its
            _retired.append(old)  # agents run: left to serve them (closing it would stop
            # them), closed at exit; one that never forked an agent (never ready: a loaded
            # host) is closed, not kept with its torch import for the life of the process
        elif old is not None:
            gone = old
        try:
            if _starter is None:
                _starter = _Starter()
            _server = _starter.start()
        except OSError as e:
            log.warning("asyncrl: torchrun agents start anew (%s)", e)
        server = _server
    if gone is not None:
        gone.close()
    return server


def shared_server_pid() -> int | None:
    """The running server's pid (a process that outlives controllers, by design)."""
    server = _server
    return server.proc.pid if server is not None and server.alive else None


def close_shared_server() -> None:
    global _server
    with _lock:
        servers = [s for s in (_server, *_retired) if s is not None]
        _server = None
        _retired.clear()
    for server in servers:
        server.close()


def _forget_after_fork() -> None:
    """A forked child shares the parent's pipes to the server, not its starter thread."""
    global _lock, _starter, _server, _retired
    _lock, _starter, _server, _retired = threading.Lock(), None, None, []


atexit.register(close_shared_server)
os.register_at_fork(after_in_child=_forget_after_fork)
