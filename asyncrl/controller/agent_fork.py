"""torchrun agents forked from one warm process.

A group's agent is torchrun (`torch.distributed.run`), which imports torch before it starts a
rank: 2.6 s of the 5.5 s a 1-rank group takes to start on 2 cores, paid again by every group
of a flow and by every restart. A controller's `AgentServer` imports it once, then forks
each agent from it (the server is single-threaded: fork is safe there, as DataLoader workers
fork after importing torch). The agent runs torchrun's own `main` with the group's arguments,
environment and log, in a session of its own, as a new torchrun process would.

Lines of JSON on the server's stdin and stdout: {"argv", "env", "log", "die_with_parent"}
asks for an agent, answered {"pid"} in order; {"exit": pid, "code"} reports one that ended
(`code` as Popen gives it: negative for a signal). The server ends when its stdin closes (the
controller closed it, or died); agents started with die_with_parent then get SIGTERM.
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


def die_with_parent() -> None:
    """SIGTERM to this process when its parent (the thread that started it) exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


# -- the server ------------------------------------------------------------------------------
def _send(msg: dict[str, Any]) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())  # unbuffered: a fork copies no pending data


def _agent(torchrun: Any, ask: dict[str, Any]) -> NoReturn:
    """In the forked child: become the group's torchrun."""
    code = 1
    try:
        os.setsid()
        if ask["die_with_parent"]:
            die_with_parent()
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
    import torch.distributed.run as torchrun  # the import every agent used to pay

    _send({"ready": True})
    children: set[int] = set()
    pending = b""
    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the controller is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _agent(torchrun, json.loads(line))
                children.add(pid)
                _send({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


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
    while True:
        try:
            os.kill(agent.pid, 0)
        except ProcessLookupError:
            agent._exited(-signal.SIGKILL)
            return
        except PermissionError:
            pass
        threading.Event().wait(0.1)


class AgentServer:
    """One controller's server: started on its first group, closed with it."""

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
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="asyncrl-agent-server")
        self._reader.start()
        if not self._ready.wait(READY_TIMEOUT):
            self.close()
            raise RuntimeError(f"the torchrun agent server did not start in {READY_TIMEOUT:.0f} s")

    def _read(self) -> None:
        with self._stdout:
            self._read_lines()

    def _read_lines(self) -> None:
        for line in self._stdout:
            msg = json.loads(line)
            if "ready" in msg:
                self._ready.set()
            elif "pid" in msg:
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
        with self._answered:  # the server ended: its agents' ends are no longer reported
            self._answered.notify_all()
            left, self._agents = list(self._agents.values()), {}
        for agent in left:
            threading.Thread(target=_watch, args=(agent,), daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, argv: list[str], env: dict[str, str], log: str,
              die_with_parent: bool) -> ForkedAgent:
        with self._lock:
            self._stdin.write((json.dumps({"argv": argv, "env": env, "log": log,
                                           "die_with_parent": die_with_parent}) + "\n").encode())
            self._stdin.flush()
            with self._answered:
                if not self._answered.wait_for(lambda: self._answers or not self.alive, 60):
                    raise RuntimeError("the torchrun agent server did not answer in 60 s")
                if not self._answers:
                    raise RuntimeError("the torchrun agent server exited")
                agent = ForkedAgent(self._answers.popleft()["pid"])
                if agent.pid in self._ended:
                    agent._exited(self._ended.pop(agent.pid))
                else:
                    self._agents[agent.pid] = agent
        return agent

    def close(self) -> None:
        """Stop the server (agents still running go on, or get SIGTERM if they die with it)."""
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not threading.current_thread():
            self._reader.join(10)

