"""A cluster's hosts: what an ssh host's command line carries, rendezvous ports of hosts
that share an address, the environment a group may be given, a netns host's interface, and
stopping the ranks of a group on srun hosts (more in test_cluster.py)."""

from __future__ import annotations

import os
import random
import shlex
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import assert_gone, kill_left, wait_until

from asyncrl.controller import launcher
from asyncrl.controller.cluster import Cluster, HostSpec, torchrun_command
from asyncrl.controller.launcher import check_env, cluster_agents, host_env


def test_ranks_on_an_ssh_host_get_unbuffered_output():
    """rank_env set PYTHONUNBUFFERED=1, but ssh's command line carried only the variables
    of a few prefixes: a rank's prints reached its log only when its buffer filled."""
    host = HostSpec("n1", "10.0.0.1", cpus=2, via="ssh")
    env = host_env(host, [0], {}, {"ASYNCRL_GROUP": "g"})
    assert env["PYTHONUNBUFFERED"] == "1"
    command = torchrun_command(host, env, 1, 0, 1, "10.0.0.1:25000", "g-run")
    assert command[0] == "ssh"
    remote = shlex.split(command[-1])
    exports = remote[remote.index("env") + 1:remote.index("-m") - 1]  # before python -m
    assert "PYTHONUNBUFFERED=1" in exports


def test_rendezvous_ports_are_held_per_address_not_per_host_name(tmp_path, monkeypatch):
    """Two hosts at one address (one machine listed under two names): each host's ports were
    held apart, and two groups could draw one port there."""
    draws = iter([25000, 25000, 26000])
    monkeypatch.setattr(random.SystemRandom, "randint", lambda self, lo, hi: next(draws))
    cluster = Cluster([HostSpec("n1", "10.0.0.1", cpus=1, via="ssh"),
                       HostSpec("n1b", "10.0.0.1", cpus=1, via="ssh")])

    def endpoint(group: str) -> tuple[str, str]:  # (commands only: nothing starts)
        agents = cluster_agents(cluster, group, 1, {}, tmp_path, "run", die_with_parent=False)
        agent = agents.agents[0]
        return agent.host, agent.command()[-1].split("--rdzv-endpoint ")[1].split()[0]
    assert endpoint("a") == ("n1", "10.0.0.1:25000")
    assert endpoint("b") == ("n1b", "10.0.0.1:26000")  # 25000 is a's, at the same address


def test_an_env_no_environment_can_hold_is_refused_naming_the_group_and_name():
    """{"A=B": "1"}, {"": "1"} and a NUL passed check_env: a forked agent failed inside
    torchrun with an unrelated traceback, a Popen one with a bare ValueError."""
    for env, says in (({"A=B": "1"}, "rename 'A=B'"), ({"": "1"}, "rename ''"),
                      ({"A\0B": "1"}, "rename 'A\\x00B'"),
                      ({"A": "x\0y"}, "remove it from the value of 'A'")):
        with pytest.raises(ValueError) as e:
            check_env("g", env)
        assert str(e.value).startswith(f"group 'g': env={env!r}: an environment ")
        assert str(e.value).endswith(says)
    check_env("g", {"A": "B=C", "PATH_2": ""})  # '=' in a value, an empty value: fine


def test_a_netns_hosts_gloo_interface_is_the_one_holding_its_address_there(
        tmp_path, monkeypatch):
    """GLOO_SOCKET_IFNAME was eth0 for every netns host: a namespace whose interface has
    another name failed with "Unable to find address for: eth0"."""
    asked = tmp_path / "asked"
    _shim(tmp_path, "ip", f"""
        import sys
        open({str(asked)!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
        if sys.argv[-1] == "10.9.0.2":
            print("7: veth7    inet 10.9.0.2/24 scope global veth7")
        """, monkeypatch)
    cluster = Cluster([HostSpec("ns1", "10.9.0.2", cpus=1, via="netns"),
                       HostSpec("ns2", "10.9.0.3", cpus=1, via="netns")])

    def interface(nprocs: int, env: dict[str, str]) -> str:
        agents = cluster_agents(cluster, "g", nprocs, env, tmp_path, "run", die_with_parent=False)
        cluster.forget("g")
        return agents.agents[0]._env["GLOO_SOCKET_IFNAME"]
    assert interface(1, {}) == "veth7"
    assert asked.read_text() == "-n ns1 -o addr show to 10.9.0.2\n"
    assert interface(1, {"GLOO_SOCKET_IFNAME": "mine"}) == "mine"  # the group's: not asked
    assert asked.read_text().count("\n") == 1
    with pytest.raises(ValueError, match=r"host 'ns2' \(via netns\): no interface of network "
                                         r"namespace 'ns2' found holding its address 10\.9\.0\.3 "
                                         r"\(ip lists none\); give .* GLOO_SOCKET_IFNAME"):
        interface(2, {})  # ns2 too: nothing there holds 10.9.0.3


def _shim(tmp_path: Path, name: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program `name` first on PATH, running `code` (Python)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / name
    shim.write_text(f"#!{sys.executable}\n{textwrap.dedent(code)}")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


# srun and slurmstepd as far as stopping goes: slurmstepd (a session of its own, no child of
# srun's) runs the task with stdin from a pipe it closes on srun's end-of-input message only
# (srun's connection dropping leaves it open), and on srun's SIGTERM SIGKILLs the whole step,
# ranks in sessions of their own too (its cgroup)
SRUN = """
import contextlib, os, signal, socket, struct, subprocess, sys, threading
from asyncrl.actors.procs import child_pids


def note(kind, pid):
    with open(os.path.join(PIDS, f"{kind}-{pid}"), "w") as f:
        f.write(str(pid))


def stepd(srun, command):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    read_end, write_end = os.pipe()
    task = subprocess.Popen(command, stdin=read_end)
    os.close(read_end)
    note("stepd", os.getpid())
    note("task", task.pid)

    def step():
        found, todo = [task.pid], [task.pid]
        while todo:
            found += (kids := child_pids(todo.pop()))
            todo += kids
        return found

    def relay():
        while len(head := srun.recv(5, socket.MSG_WAITALL)) == 5:  # (else srun is gone)
            kind, size = head[:1], struct.unpack("!I", head[1:])[0]
            data = srun.recv(size, socket.MSG_WAITALL) if size else b""
            if kind == b"K":
                for pid in step():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            elif data:
                os.write(write_end, data)
            else:
                os.close(write_end)
    threading.Thread(target=relay, daemon=True).start()
    code = task.wait()
    srun.sendall(struct.pack("!i", code))
    os._exit(0)


args = sys.argv[1:]
while args[0].startswith("--"):
    args.pop(0)
mine, theirs = socket.socketpair()
if os.fork() == 0:
    mine.close()
    os.setsid()
    if os.fork() == 0:
        stepd(theirs, args)
    os._exit(0)
os.wait()
theirs.close()
lock = threading.Lock()


def send(kind, data=b""):
    with lock:
        mine.sendall(kind + struct.pack("!I", len(data)) + data)


def forward_stdin():
    while data := os.read(0, 1 << 16):
        send(b"I", data)
    send(b"I")  # its end: a message of its own


threading.Thread(target=forward_stdin, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: send(b"K"))
code = mine.recv(4, socket.MSG_WAITALL)
sys.exit(struct.unpack("!i", code)[0] % 256 if len(code) == 4 else 1)
"""


def test_stopping_a_group_on_srun_hosts_stops_its_ranks_there(tmp_path, monkeypatch):
    """signal_all SIGKILLed the local srun and no more: slurmstepd closes the agent's stdin
    on srun's end-of-input message only, so the lifeline held and the ranks kept their GPUs
    until a collective timed out. srun is told first now: its stdin closed, then SIGTERM."""
    pids, scratch = tmp_path / "pids", tmp_path / "scratch"  # (scratch: TMPDIR, our mark)
    pids.mkdir()
    scratch.mkdir()
    _shim(tmp_path, "srun", SRUN.replace("PIDS", repr(str(pids))), monkeypatch)
    worker = tmp_path / "worker.py"  # the ranks (rank_main would need a controller)
    worker.write_text("import os, sys, time\nd, me = sys.argv[1], os.getpid()\n"
                      "open(f'{d}/part-{me}', 'w').write(str(me))\n"
                      "os.rename(f'{d}/part-{me}', f'{d}/rank-{me}')\ntime.sleep(3600)\n")
    real = launcher.torchrun_command
    monkeypatch.setattr(launcher, "torchrun_command", lambda *a, **k: [
        *real(*a, **k)[:-2], str(worker), str(pids)])  # (in place of -m ...rank_main)
    cluster = Cluster([HostSpec(n, "127.0.0.1", cpus=1, via="srun") for n in ("n1", "n2")])
    group = cluster_agents(cluster, "g", 2, {"TMPDIR": str(scratch)}, tmp_path, "run",
                           die_with_parent=False)
    assert [a.command()[0] for a in group.agents] == ["srun", "srun"]
    try:
        group.start(lambda code: None)
        wait_until(lambda: len(list(pids.glob("rank-*"))) == 2, 120, "both ranks to start")
        ranks = [int(p.read_text()) for p in pids.glob("rank-*")]
        group.signal_all(signal.SIGKILL)
        assert_gone(ranks)
        assert_gone([int(p.read_text()) for p in pids.glob("stepd-*")])  # the step ended
    finally:
        group.signal_all(signal.SIGKILL)
        for pid_file in pids.iterdir():  # what a failure left: the steps, agents and ranks
            kill_left(pid_file, f"TMPDIR={scratch}")


def test_stopping_remote_agents_leaves_the_callers_thread_at_once(tmp_path):
    """The hang-up (lifeline closed, SIGTERM, then the kill) waited on the caller, the
    controller's loop, up to 2 s a group: no call or heartbeat went meanwhile. The caller
    now goes on at once, and the agents are killed on a thread of their own."""
    import subprocess

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    agents = []
    for host in ("n1", "n2"):  # an ssh or srun slow to pass the hang-up on
        agent = launcher.Agent("g", 1, {}, tmp_path / f"{host}.log", die_with_parent=False,
                               host=host, local=False)
        agent.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        agents.append(agent)
    pids = [a.proc.pid for a in agents]
    try:
        launcher.HostAgents(agents).signal_all(signal.SIGKILL)
        assert [a.proc.poll() for a in agents] == [None, None]  # (before: killed by now)
        assert all(a.proc.stdin.closed for a in agents)  # told first
        wait_until(lambda: all(a.proc.poll() == -signal.SIGKILL for a in agents), 15,
                   "the hang-up thread to kill them")
    finally:
        for a in agents:
            a.proc.kill()
            a.proc.wait()
    assert_gone(pids)


def test_a_second_stop_leaves_a_remote_agents_hang_up_to_run_its_course(tmp_path):
    """A second signal_all (a close right after the supervisor's kill) killed the ssh or
    srun the first was hanging up: a SIGKILLed srun passes nothing on."""
    import subprocess

    code = "import sys, time; sys.stdin.buffer.read(); time.sleep(0.3); sys.exit(0)"
    agents = []
    for host in ("n1", "n2"):  # each exits cleanly 0.3 s after its lifeline closes
        agent = launcher.Agent("g", 1, {}, tmp_path / f"{host}.log", die_with_parent=False,
                               host=host, local=False)
        agent.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        agents.append(agent)
    try:
        group = launcher.HostAgents(agents)
        group.signal_all(signal.SIGKILL)
        group.signal_all(signal.SIGKILL)
        assert [a.proc.wait(15) for a in agents] == [0, 0]  # (before: [-9, -9])
    finally:
        for a in agents:
            a.proc.kill()
            a.proc.wait()
    assert_gone([a.proc.pid for a in agents])
