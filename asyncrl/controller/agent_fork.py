"""torchrun agents forked from one warm process.

A group's agent is torchrun (`torch.distributed.run`), which imports torch before it starts a
rank: 2.6 s of the 5.5 s a 1-rank group takes to start on 2 cores, paid again by every group
of a flow and by every restart. A controller's `AgentServer` (started with the controller)
imports it once, then forks each agent from it (the server is single-threaded: fork is safe
there, as DataLoader workers fork after importing torch). The agent runs torchrun's own
`main` with the group's arguments, environment, working directory and log, in a session of
its own, as a new torchrun process would.

Lines of JSON on the server's stdin and on a private copy of its stdout (fd 1 itself goes to
stderr, so a stray print cannot break the protocol): {"argv", "env", "cwd", "umask", "log",
"die_with_parent"} asks for an agent, answered {"pid"} or {"error"} in order; {"exit": pid,
"code"} reports one that ended (`code` as Popen gives it: negative for a signal). The server
ends when its stdin closes; agents started with die_with_parent then get SIGTERM (so a dead
server takes its groups down, as a dead controller does).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections import deque
from pathlib import Path
from typing import Any, NoReturn

_PR_SET_PDEATHSIG = 1
READY_TIMEOUT = 120.0  # the server's torch import, on a loaded machine
ANSWER_TIMEOUT = 60.0


def die_with_parent() -> None:
    """SIGTERM to this process when its parent (the thread that started it) exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def forking_enabled() -> bool:
    return os.environ.get("ASYNCRL_FORK_AGENTS", "1").lower() not in ("0", "false", "no")


# -- the server ------------------------------------------------------------------------------
def _agent(torchrun: Any, ask: dict[str, Any], proto: int) -> NoReturn:
    """In the forked child: become the group's torchrun."""
    code = 1
    try:
        os.close(proto)
        os.setsid()
        if ask["die_with_parent"]:
            die_with_parent()
        os.chdir(ask["cwd"])
        os.umask(ask["umask"])
        log = os.open(ask["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(ask["env"])
        sys.argv = [torchrun.__file__, *ask["argv"]]
        torchrun.main(ask["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as `python -m torch.distributed.run` reports it, exit code 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    proto = os.dup(1)  # the protocol's own fd: fd 1 becomes stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid must see the agents

    def send(msg: dict[str, Any]) -> None:
        os.write(proto, (json.dumps(msg) + "\n").encode())  # unbuffered: nothing to copy

    import torch.distributed.run as torchrun  # the import every agent used to pay

    send({"ready": True})
    children: set[int] = set()
    pending = b""
    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                os._exit(0)  # the controller closed (or died): no teardown of torch
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                ask = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:  # this group's start fails, not the others
                    send({"error": f"fork: {e}"})
                    continue
                if pid == 0:
                    _agent(torchrun, ask, proto)
                children.add(pid)
                send({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# -- the controller's side ---------------------------------------------------------------------
class ForkedAgent:
    """A Popen-like handle on an agent the server forked (pid, poll, wait)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

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


def _watch(agent: ForkedAgent) -> None:
    """An agent the server can no longer report on: ended when its pid is gone."""
    while pid_alive(agent.pid):
        threading.Event().wait(0.1)
    agent._exited(-signal.SIGKILL)


class AgentServer:
    """One controller's server: started with it (its torch import runs meanwhile), used by
    its first group on, closed with it."""

    def __init__(self, dies_with_controller: bool):
        root = str(Path(__file__).resolve().parents[2])  # asyncrl importable, as the ranks
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from asyncrl.controller.agent_fork import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
            preexec_fn=die_with_parent if dies_with_controller else None)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._lock = threading.Lock()  # one request at a time: answers come in order
        self._answers: deque[dict[str, Any]] = deque()
        self._answered = threading.Condition()
        self._agents: dict[int, ForkedAgent] = {}
        self._ended: dict[int, int] = {}  # exits reported before their handle was made
        self._ready = threading.Event()
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
            self._ready.set()
        elif "pid" in msg or "error" in msg:
            with self._answered:
                self._answers.append(msg)
                self._answered.notify_all()
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

    def start(self, argv: list[str], env: dict[str, str], log: str,
              die_with_parent: bool) -> ForkedAgent:
        """An agent forked with these torchrun arguments; RuntimeError when the server cannot
        (the caller starts torchrun anew)."""
        if not self._ready.wait(READY_TIMEOUT) or self._eof:
            self.broken = True
            raise RuntimeError("the torchrun agent server did not start")
        umask = os.umask(0)
        os.umask(umask)
        ask = {"argv": argv, "env": env, "cwd": os.getcwd(), "umask": umask, "log": log,
               "die_with_parent": die_with_parent}
        with self._lock:
            try:
                self._stdin.write((json.dumps(ask) + "\n").encode())
                self._stdin.flush()
            except OSError as e:
                self.broken = True
                raise RuntimeError(f"the torchrun agent server is gone ({e})") from e
            with self._answered:
                if not self._answered.wait_for(lambda: self._answers or self._eof,
                                               ANSWER_TIMEOUT) or not self._answers:
                    self.broken = True  # a late answer would go to the next request
                    raise RuntimeError("the torchrun agent server did not answer")
                answer = self._answers.popleft()
                if "error" in answer:
                    raise RuntimeError(f"the torchrun agent server: {answer['error']}")
                agent = ForkedAgent(answer["pid"])
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
