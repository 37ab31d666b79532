"""Processes told apart by their start time, and the agent server's answers: what the
controller signals is its own, whatever pids the system hands out again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from helpers import ROOT, assert_gone, wait_until

import asyncrl


def test_an_agent_never_signals_a_pid_that_is_no_longer_its_own(tmp_path):
    """Over a long run pids come round again: torchrun reaped, or a rank gone, their pids
    may be another process's by the time the group closes (or a closed controller is
    collected), which was sent SIGKILL."""
    from asyncrl.actors.procs import birth
    from asyncrl.controller.launcher import Agent

    agent = Agent("g", 1, {}, tmp_path / "g.log")
    agent.proc = subprocess.Popen(["true"])
    agent.proc.wait()  # torchrun, reaped
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        agent.rank_pids[0], agent._rank_birth[0] = stranger.pid, "1"  # the rank's, long gone
        assert agent.all_pids() == []
        agent.signal_all(signal.SIGKILL)
        assert stranger.poll() is None
        agent._rank_birth[0] = birth(stranger.pid)  # were it the rank itself
        assert agent.all_pids() == [stranger.pid]
        # a forked torchrun, reaped by its server before the controller heard of its exit:
        # its pid another process's by then (the server says when the agent started)
        from asyncrl.controller.agent_fork import ForkedAgent

        agent.rank_pids.clear()
        agent.proc = ForkedAgent(stranger.pid, born="1")
        assert agent.all_pids() == [] and not agent.proc.is_itself()
        agent.proc = ForkedAgent(stranger.pid, born=birth(stranger.pid))
        assert agent.all_pids() == [stranger.pid]
    finally:
        stranger.kill()
        stranger.wait()


def test_a_process_runs_while_it_is_itself_and_not_a_zombie():
    import time

    from asyncrl.actors.procs import birth, runs, this_process

    assert runs(this_process())
    alive = subprocess.Popen(["sleep", "60"])
    done = subprocess.Popen(["true"])
    try:
        assert runs(f"{alive.pid}:{birth(alive.pid)}")
        assert not runs(f"{alive.pid}:1")  # the pid, another process's by then
        born = birth(done.pid)

        def state() -> str:
            with open(f"/proc/{done.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0]
        deadline = time.monotonic() + 30
        while state() != "Z":  # exited, not reaped: a zombie (a killed controller, until
            assert time.monotonic() < deadline  # its parent reaps it)
            os.sched_yield()
        assert not runs(f"{done.pid}:{born}")
    finally:
        alive.kill()
        alive.wait()
        done.wait()


def test_run_keeps_a_sigterm_handler_the_caller_set():
    """run() turns SIGTERM into a shutdown only where nobody handles it: a scheduler's own
    handler (a requeue) stays, during and after."""
    def mine(signum, frame):
        pass

    async def handler():
        return signal.getsignal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert asyncrl.run(handler()) is mine and signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert asyncrl.run(handler()) is not signal.SIG_DFL  # ours, while it runs
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_answer_nobody_waits_for_stops_its_agent_and_a_broken_server_is_not_closed(
        monkeypatch):
    """The agent server answered after its asker gave up (it started torchrun anew): that
    torchrun would serve the same group twice. And a server set aside as broken still runs
    the agents it forked: closing it (the next spawn did) stopped every one of them."""
    import collections

    from asyncrl.actors.procs import birth
    from asyncrl.controller import agent_fork

    server = object.__new__(agent_fork.AgentServer)
    server.broken, server._answers = True, collections.deque()
    server._answered = threading.Condition()
    orphan = subprocess.Popen(["sleep", "60"])
    try:  # a late answer whose pid names another process by now (its start time differs):
        with monkeypatch.context() as m:  # left alone
            kills: list = []
            m.setattr(agent_fork.os, "kill", lambda *a: kills.append(a))
            server._take({"pid": orphan.pid, "born": "1"})
        assert kills == [] and not server._answers
        server._take({"pid": orphan.pid, "born": birth(orphan.pid)})
        assert orphan.wait(10) == -signal.SIGTERM and not server._answers
    finally:
        orphan.kill()
        orphan.wait()

    class Running:
        broken, alive, closed = True, False, False
        proc = subprocess.Popen(["sleep", "60"])

        def close(self):
            self.closed = True

    class Starter:
        def start(self):
            return "a new server"

    running = Running()
    running._agents = {1: "an agent it forked"}
    monkeypatch.setattr(agent_fork, "_server", running)
    monkeypatch.setattr(agent_fork, "_starter", Starter())
    monkeypatch.setattr(agent_fork, "_retired", [])
    try:
        assert agent_fork.shared_server() == "a new server"
        assert not running.closed and agent_fork._retired == [running]
        # one that never forked an agent (never ready, on a loaded host) is not kept, with
        # its torch import, for the life of the process: each spawn could add one more
        never = Running()
        never._agents = {}
        monkeypatch.setattr(agent_fork, "_server", never)
        monkeypatch.setattr(agent_fork, "_retired", [])
        assert agent_fork.shared_server() == "a new server"
        assert never.closed and agent_fork._retired == []
    finally:
        Running.proc.kill()
        Running.proc.wait()


def test_a_child_whose_parent_exited_before_its_death_signal_was_set_ends(tmp_path):
    """The death signal a child sets takes effect at its parent's exit from then on: a
    parent gone already (the agent server ending as a spawn began) left the child, a
    torchrun agent, running on. die_with_parent(parent) ends it then."""
    script, mark = tmp_path / "orphan.py", tmp_path / "child.pid"
    script.write_text(
        "import os, sys\n"
        "from asyncrl.controller.agent_fork import die_with_parent\n"
        "parent = os.getpid()\n"
        "if os.fork() == 0:\n"
        f"    open({str(mark)!r}, 'w').write(str(os.getpid()))\n"
        "    os.setsid()\n"
        "    while os.getppid() == parent:  # until the parent has exited\n"
        "        os.sched_yield()\n"
        "    try:\n"
        "        die_with_parent(parent)\n"
        "    except BaseException as e:\n"
        "        print('failed:', repr(e), flush=True)\n"
        "    print('alive', os.getpid(), flush=True)\n"
        "    os.read(0, 1)  # (held until the test's end)\n"
        "    os._exit(0)\n"
        "os._exit(0)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:  # a line from the child, or the end: the child (holding the pipe) gone
        said = proc.stdout.readline()
    finally:
        proc.stdin.close()  # (a child that lived ends now)
        proc.stdout.close()
        proc.wait()
    assert proc.returncode == 0 and mark.exists()  # (a script failing early says nothing)
    assert said == "", said  # ended by its SIGTERM, before a word
    assert_gone([int(mark.read_text())])


def test_a_process_another_user_runs_is_alive(monkeypatch):
    """Where /proc hides other users' processes (hidepid), kill(pid, 0) says EPERM: that
    raised out of pid_alive (a sweep of a host's leftovers stopped at the first such pid)."""
    from asyncrl.actors import procs

    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(procs, "_stat", lambda pid: [])
    monkeypatch.setattr(procs.os, "kill", refused)
    assert procs.pid_alive(123) is True


LATE = """
import os, signal, subprocess, sys
def start(*_):  # a torchrun starting a rank, in a session of its own, when told to
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    with open(sys.argv[1], "a") as out:
        out.write(f"{child.pid}\\n")
signal.signal(signal.SIGUSR1, start)
start()
print("ready", flush=True)
while True:
    signal.pause()
"""


def test_an_agent_killed_while_it_starts_children_leaves_none(tmp_path, monkeypatch):
    """Its children were listed, then signalled: one it started meanwhile (torchrun
    starting its ranks while a spawn was undone) was never signalled, and, in a session of
    its own, outlived the agent. The agent is stopped before its children are listed (here
    a child is started right after the listing, unless the agent is stopped)."""
    from asyncrl.actors.procs import pid_alive, state
    from asyncrl.controller import launcher

    listed = tmp_path / "children"
    agent = launcher.Agent("g", 1, {}, tmp_path / "g.log")
    agent.proc = subprocess.Popen([sys.executable, "-c", LATE, str(listed)],
                                  stdout=subprocess.PIPE, text=True)
    real = launcher.child_pids

    def then_one_more(pid: int) -> list[int]:
        found = real(pid)
        if pid == agent.proc.pid and state(pid) not in ("T", "t"):
            os.kill(pid, signal.SIGUSR1)
            wait_until(lambda: len(listed.read_text().split()) == 2, 30, "its next child")
        return found
    monkeypatch.setattr(launcher, "child_pids", then_one_more)
    try:
        assert agent.proc.stdout.readline() == "ready\n"
        agent.signal_all(signal.SIGKILL)
        agent.proc.wait(10)
        assert_gone([int(p) for p in listed.read_text().split()], timeout=10)
    finally:
        if agent.proc.poll() is None:  # (failed before it was killed: it pauses for ever)
            agent.proc.kill()
            agent.proc.wait()
        agent.proc.stdout.close()
        for pid in map(int, listed.read_text().split() if listed.exists() else ()):
            if pid_alive(pid):  # (ours: started by the test's agent)
                os.kill(pid, signal.SIGKILL)


STUCK = """
import datetime, sys
import torch.distributed as dist
from asyncrl.actors.sigterm import stop_on_sigterm
stop_on_sigterm()
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=120))
print("waiting", flush=True)
store.wait(["never"])  # as a rank in a rendezvous, or in a collective of its on_close
"""


def test_a_rank_stuck_in_a_call_into_torch_ends_on_sigterm_at_once():
    """The rank's SIGTERM handler ran only once the main thread came back from torch (a
    rendezvous, a collective in on_close): torchrun's stop waited out its grace. A thread
    woken by the signal now unlinks the rank's memory and ends it."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM  # (the store's own wait: 120 s)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


DRIVER = """
import asyncio, asyncrl

async def main():
    print("ready", flush=True)
    try:
        await asyncio.sleep(600)
    finally:
        print("cleanup ran", flush=True)

asyncrl.run(main())
"""


def test_a_driver_run_as_a_script_exits_143_on_sigterm_after_its_cleanup():
    """`python driver.py` (asyncrl.run(main())) cleaned up on SIGTERM, then Terminated
    escaped as any failure: a traceback and exit 1, where only `asyncrl launch` said 143."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out) == (128 + signal.SIGTERM, "cleanup ran\n")
        assert "Traceback" not in err
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
