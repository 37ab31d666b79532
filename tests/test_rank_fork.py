"""Ranks forked from the agent server (asyncrl/actors/rank_fork.py): torchrun starts a
stand-in per rank (asyncrl/actors/rank_client.py) that mirrors a rank forked from the warm
server; ranks the server would not start as a new interpreter would start anew."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys

import psutil
import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl.actors.rank_client import STAND_IN
from asyncrl.actors.rank_fork import StartUp
from asyncrl.controller.agent_fork import shared_server, shared_server_pid


class Probe(asyncrl.Worker):
    @asyncrl.register
    def seen(self):
        with open("/proc/self/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode()
        return {"pid": os.getpid(), "ppid": os.getppid(), "stand_in": os.environ.get(STAND_IN),
                "marker": os.environ.get("PROBE_MARKER"), "cwd": os.getcwd(),
                "random": random.random(), "hash": hash("asyncrl"), "title": title,
                "torch_random": torch.rand(1).item()}

    @asyncrl.register
    def huge_pages_asked(self, mib: int) -> bool:
        """Whether a fresh tensor's memory was advised to take transparent huge pages."""
        import torch
        t = torch.empty(mib << 20, dtype=torch.uint8)
        at, flags = t.data_ptr(), {}
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start <= at < end
                elif head == "VmFlags:" and inside:
                    flags = set(line.split()[1:])
        return "hg" in flags

    @asyncrl.register
    def torch_threads(self) -> int:
        import torch
        return torch.get_num_threads()

    @asyncrl.register
    def blas_threads(self) -> int | None:
        """The threads numpy's OpenBLAS uses (None: a numpy without its own OpenBLAS)."""
        import ctypes
        import glob

        import numpy as np
        libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs",
                                      "libscipy_openblas*"))
        lib = ctypes.CDLL(libs[0]) if libs else None  # (numpy's own, already loaded)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_"):
            if lib is not None and hasattr(lib, name):
                return int(getattr(lib, name)())
        return None

    @asyncrl.register
    def start_child(self):
        """A process of the rank's own (as a compile worker or a sandbox would be)."""
        self.child = subprocess.Popen(["sleep", "600"])
        return self.child.pid


def _server_pid() -> int:
    server = shared_server()
    assert server is not None and server.ranks_address() is not None  # it forks ranks
    pid = shared_server_pid()
    assert pid is not None
    return pid


def test_ranks_are_forked_from_the_server_and_their_stand_ins_go_with_them(tmp_path,
                                                                           monkeypatch):
    """Each rank is a child of the agent server, with its stand-in's environment and
    directory, a random state of its own and a title naming it; its stand-in is torchrun's
    worker. A stand-in killed (as torchrun kills a worker) takes its rank along, and what the
    rank started."""
    server = _server_pid()
    monkeypatch.chdir(tmp_path)

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, nprocs=2, name="probe",
                                    env={"PROBE_MARKER": "given"})
            seen = await group.seen()
            stand_ins = [int(s["stand_in"]) for s in seen]
            parents = [psutil.Process(p).ppid() for p in stand_ins]
            titles = [" ".join(psutil.Process(p).cmdline()) for p in stand_ins]
            children = await group.start_child()
            os.kill(stand_ins[1], signal.SIGKILL)
            with pytest.raises(asyncrl.GroupDeadError):
                for _ in range(600):
                    await group.seen()
                    await asyncio.sleep(0.05)
            return seen, parents, titles, group.agent.pid, group_pids(group) + children

    seen, parents, titles, agent, pids = run(main())
    assert [s["ppid"] for s in seen] == [server, server]
    assert parents == [agent, agent] and all("rank_client.py" in t for t in titles)
    assert [s["marker"] for s in seen] == ["given", "given"]
    assert {s["cwd"] for s in seen} == {str(tmp_path)}
    assert seen[0]["random"] != seen[1]["random"]
    assert seen[0]["torch_random"] != seen[1]["torch_random"]  # (the server's state was
    # every forked rank's, every restart's too)
    assert [s["title"].split("rank_main ")[1].strip() for s in seen] == \
        ["[probe rank 0]", "[probe rank 1]"]
    assert_gone(pids + [s["pid"] for s in seen])


def test_variables_read_as_libraries_load_are_start_up_ones():
    """libgomp reads OMP_* as torch loads it, huggingface_hub its cache folders at import:
    a group's env= setting one was lost in its forked ranks."""
    for key in ("OMP_PROC_BIND", "OMP_WAIT_POLICY", "XDG_CACHE_HOME", "GLIBC_TUNABLES",
                "HUGGINGFACE_HUB_CACHE", "TZ"):
        assert StartUp({}).differs({key: "x"}) == f"{key} differs from the server's (read " \
            f"at start-up)"
    assert StartUp({}).differs({"PYTHONPATH": "x"}) is None  # read when used


def test_a_rank_whose_start_up_environment_differs_starts_anew(monkeypatch):
    """PYTHONHASHSEED takes effect when Python starts: a group given one the server did not
    start with gets torchrun and ranks started anew, and its ranks hash as that seed says;
    ASYNCRL_FORK_RANKS=0 starts ranks anew (through a forked agent)."""
    _server_pid()
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    expected = int(subprocess.run([sys.executable, "-c", "print(hash('asyncrl'))"], env=env,
                                  capture_output=True, text=True, check=True).stdout)

    async def main(env):
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, name="anew", env=env)
            agent = group.agent.pid
            return (await group.seen())[0], agent, psutil.Process(agent).ppid()

    seen, agent, its_parent = run(main({"PYTHONHASHSEED": "7"}))
    assert its_parent == os.getpid()  # torchrun started anew, by the controller
    assert seen["ppid"] == agent and seen["stand_in"] is None  # torchrun's own worker
    assert seen["hash"] == expected
    monkeypatch.setenv("ASYNCRL_FORK_RANKS", "0")
    seen, agent, its_parent = run(main({}))
    assert its_parent == shared_server_pid()  # the agent forked, its ranks not
    assert seen["ppid"] == agent and seen["stand_in"] is None


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="this kernel has no transparent huge pages")
def test_ranks_ask_for_huge_pages_unless_their_environment_says_not():
    """Ranks' torch allocates its large blocks on transparent huge pages (a fresh tensor is
    written ~5x faster where the kernel gives them on request), forked; a group given
    THP_MEM_ALLOC_ENABLE=0 gets ranks started anew, without them."""
    server = _server_pid()

    async def main(env):
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, name="pages", env=env)
            return (await group.seen())[0]["ppid"], (await group.huge_pages_asked(8))[0], \
                group.agent.pid
    parent, asked, _ = run(main({}))
    assert parent == server and asked
    parent, asked, agent = run(main({"THP_MEM_ALLOC_ENABLE": "0"}))
    assert parent == agent and not asked


def test_variables_imports_set_in_the_controller_keep_groups_forked(monkeypatch):
    """`import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK, torch._dynamo's import
    TORCHINDUCTOR_CACHE_DIR: in the controller after its server started, they are read when
    used, and its groups are still forked."""
    server = _server_pid()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/inductor")

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, name="later")
            return (await group.seen())[0], psutil.Process(group.agent.pid).ppid()
    seen, agent_parent = run(main())
    assert agent_parent == server and seen["ppid"] == server


def _ask(address: str, payload: bytes, fds: list[int]) -> dict:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    conn.connect("\0" + address)
    with conn:
        if fds:
            socket.send_fds(conn, [payload], fds)
        else:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        return json.loads(conn.makefile("rb").readline() or b"{}")


def test_the_rank_server_refuses_what_no_stand_in_sends():
    """Requests without the four fds, with a length past the limit, of bad JSON (nested
    past the recursion limit too) or of the wrong shape get an error and fork nothing; the
    same server forks ranks after."""
    server = _server_pid()
    address = shared_server().ranks_address()
    good = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "umask": 0o22}).encode()
    bad_path = json.dumps({"env": {"PYTHONPATH": 1}, "cwd": ".", "umask": 18}).encode()
    deep = b"[" * 100_000 + b"]" * 100_000
    null = os.open(os.devnull, os.O_RDWR)

    def framed(body: bytes) -> bytes:
        return struct.pack("!I", len(body)) + body
    try:
        answers = [
            _ask(address, framed(good), []),  # no fds
            _ask(address, framed(good), [null] * 3),  # no lifeline
            _ask(address, struct.pack("!I", 1 << 30) + good, [null] * 4),  # too long
            _ask(address, framed(b"not json!"), [null] * 4),
            _ask(address, framed(b'{"env": [1]}'), [null] * 4),
            _ask(address, framed(bad_path), [null] * 4),
            _ask(address, framed(deep), [null] * 4),
            _ask(address, struct.pack("!I", 100) + b"{}", [null] * 4),  # cut short
        ]
    finally:
        os.close(null)
    assert all(set(a) == {"error"} for a in answers), answers
    assert psutil.Process(server).children() == []  # nothing forked

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, name="after")
            return (await group.seen())[0]
    assert run(main())["ppid"] == server


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: one BLAS thread anyway")
def test_a_forked_ranks_numpy_uses_the_ranks_threads(monkeypatch):
    """numpy's OpenBLAS reads OMP_NUM_THREADS as numpy is imported: in the server, started
    with the controller's environment (none set), so forked ranks ran a BLAS thread per core
    beside their one torch thread; a rank started anew had one. A group that asks for more
    gets ranks started anew with them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = _server_pid()

    async def main(env):
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Probe, name="blas", env=env)
            return ((await group.seen())[0]["ppid"], (await group.blas_threads())[0],
                    (await group.torch_threads())[0])
    parent, threads, torch_threads = run(main({}))
    assert torch_threads == 1
    if threads is None:
        pytest.skip("this numpy has no OpenBLAS of its own to ask")
    assert parent == server and threads == 1
    # torch's threads too (it set 1 over them: only numpy got what the group asked for)
    parent, threads, torch_threads = run(main({"OMP_NUM_THREADS": "2"}))
    assert parent != server and threads == 2 and torch_threads == 2


def test_a_groups_omp_threads_set_torchs_and_the_shells_do_not():
    """A group's env= OMP_NUM_THREADS reaches torch (as ASYNCRL_THREADS); the launching
    shell's does not: a rank pinned to one core would run that many torch threads on it."""
    from asyncrl.controller.launcher import rank_env
    assert rank_env({}, {"OMP_NUM_THREADS": "2"})["ASYNCRL_THREADS"] == "2"
    shell = rank_env({"OMP_NUM_THREADS": "8"}, {})
    assert "ASYNCRL_THREADS" not in shell and shell["OMP_NUM_THREADS"] == "8"
    assert rank_env({}, {"OMP_NUM_THREADS": "2", "ASYNCRL_THREADS": "3"})["ASYNCRL_THREADS"] == "3"


def test_asking_the_rank_server_reads_the_umask_without_setting_it(monkeypatch):
    """The umask was read by setting it to 0 and back, on threads beside others writing
    files: a checkpoint written in that moment was group- and world-writable."""
    from asyncrl.actors import rank_client

    def no_setting(mask):
        raise AssertionError("os.umask set the process's mask")
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_setting)
        assert rank_client.current_umask() == 0o027
        assert rank_client.ask("asyncrl-no-such-server") is None  # (unreachable: refused)
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_a_ranks_fork_hook_closes_its_lifeline_only_where_it_still_is_the_lifeline():
    """A forked rank closes its lifeline in its children (else a child would keep the rank's
    stand-in from seeing it end); the hook, inherited, closed the same number in their
    children too, where it had become a file the child opened since."""
    from asyncrl.actors.rank_fork import _close_if_same, _identity

    fd, other_end = os.pipe()
    other = os.open(os.devnull, os.O_RDONLY)
    identity = _identity(fd)
    _close_if_same(fd, identity)  # a child: its copy of the lifeline goes
    with pytest.raises(OSError):
        os.fstat(fd)
    try:
        os.dup2(other, fd)  # a grandchild: the number is a file of the child's now
        _close_if_same(fd, identity)
        os.fstat(fd)  # still open
    finally:
        for f in (fd, other, other_end):
            os.close(f)


def test_a_rank_server_out_of_fds_refuses_a_stand_in_instead_of_spinning(tmp_path):
    """Out of fds, the server's accept failed and left the connection queued: the listener
    stayed readable (the server spun at 100 % CPU) and the stand-in waited for an answer for
    ever instead of starting its rank anew."""
    import resource
    import threading

    from helpers import ROOT

    from asyncrl.actors import rank_client

    script = tmp_path / "server.py"
    script.write_text(
        "import os, select, sys\n"
        "from asyncrl.actors.rank_fork import RankForker, StartUp\n"
        "forker = RankForker(dict(os.environ), StartUp(dict(os.environ)))\n"
        "poller = select.poll()\n"
        "poller.register(forker.listener.fileno(), select.POLLIN)\n"
        "poller.register(0, select.POLLIN)\n"
        "held = []\n"
        "try:\n"
        "    while True:\n"
        "        held.append(os.open(os.devnull, os.O_RDONLY))\n"
        "except OSError:\n"
        "    pass\n"
        "print(forker.address, flush=True)\n"
        "served = 0\n"
        "while True:\n"
        "    for fd, _ in poller.poll():\n"
        "        if fd == 0:\n"
        "            print(served, flush=True)\n"
        "            sys.exit(0)\n"
        "        served += 1\n"
        "        forker.readable(fd, [])\n")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    server = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": ROOT},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)))
    answers = []
    try:
        address = server.stdout.readline().strip()
        asking = threading.Thread(target=lambda: answers.append(rank_client.ask(address)),
                                  daemon=True)
        asking.start()
        asking.join(30)
        refused = not asking.is_alive()
    finally:
        server.stdin.close()  # (its end: the stand-in's connection goes too)
        served = server.stdout.readline().strip()
        server.stdout.close()
        server.wait(30)
    assert refused and answers == [None]  # answered nothing: its rank starts anew
    assert served.isdigit() and int(served) < 10, served  # not a spin


def test_a_server_that_was_not_ready_in_time_is_not_asked_again(monkeypatch):
    """ranks_address() gave up waiting for the server (broken), then start() waited as long
    again; ready by then, it was asked, and its answer, taken for an orphan's, was stopped:
    the group's torchrun forked for nothing, and started anew after the answer's timeout."""
    import io
    import threading
    from collections import deque

    import asyncrl.controller.agent_fork as agent_fork

    monkeypatch.setattr(agent_fork, "READY_TIMEOUT", 0.0)
    monkeypatch.setattr(agent_fork, "ANSWER_TIMEOUT", 0.0)  # (without the fix: no wait)
    server = object.__new__(agent_fork.AgentServer)  # its protocol's side only: no process
    server._stdin, server._lock, server._answered = io.BytesIO(), threading.Lock(), \
        threading.Condition()
    server._answers, server._agents, server._ended = deque(), {}, {}
    server._ready, server._ranks, server._eof, server.broken = threading.Event(), None, \
        False, False
    assert server.ranks_address() is None and server.broken  # not ready within the timeout
    server._ready.set()  # ready now
    with pytest.raises(RuntimeError, match="failed earlier .* it is not asked again"):
        server.start(["--standalone"], {}, "unused.log", die_with_parent=False)
    assert server._stdin.getvalue() == b""  # nothing asked: no agent forked to be stopped
