"""Spawn and shutdown on every path: normal exit, exception, killed and hung ranks, failing
and slow construction (a controller stopped from outside: test_stopped_controller.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl.controller.agent_fork import forking_enabled
from asyncrl.controller.launcher import kill_pids, pid_alive


class Sleeper(asyncrl.Worker):
    def __init__(self):
        self.gate = threading.Event()

    @asyncrl.register
    def wait(self, seconds):
        return self.gate.wait(seconds)

    @asyncrl.register
    def pid(self):
        return os.getpid()

    @asyncrl.register(concurrent=True)
    def open(self):
        self.gate.set()
        return True

    @asyncrl.register(concurrent=True)
    def take(self, value):
        return value

    @asyncrl.register
    def start_child(self):  # a sandbox, a compile worker: a process the rank started
        return subprocess.Popen(["sleep", "300"]).pid

    @asyncrl.register
    def say(self, text):
        print(f"rank {self.rank}: {text}", flush=True)

    @asyncrl.register
    def lonely_all_reduce(self, rank):
        """Only `rank` enters the collective: it waits for peers that never come."""
        if self.rank == rank:
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.ones(1))


class BrokenInit(asyncrl.Worker):
    def __init__(self, rank_to_fail):
        if self.rank == rank_to_fail:
            raise RuntimeError(f"cannot build on rank {self.rank}")


class SlowInit(asyncrl.Worker):
    def __init__(self):
        print("building: loading a very large model", flush=True)
        threading.Event().wait()  # never returns: construction hangs


def test_spawn_and_clean_shutdown_leave_no_process_or_folder(tmp_path, monkeypatch):
    # torchrun makes a folder of its own in the temporary directory it sees (its children
    # read TMPDIR afresh): none may be left. (The process's agent server, started before:
    # torch's own cache folder, made when it imports torch._dynamo, is not ours to remove.)
    from asyncrl.controller.agent_fork import shared_server

    server = shared_server()
    assert server is not None and server.ranks_address() is not None
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2, name="s")
            pids = group_pids(group)
            assert all(pid_alive(p) for p in pids)
            assert sorted(await group.pid()) == sorted(group.pids.values())
        return pids
    assert_gone(run(main()))
    assert list(tmp_path.iterdir()) == []


def test_a_killed_controllers_private_folder_is_removed_by_the_next_one(tmp_path):
    """A controller killed before it closed left its folder (the run's secret, torchrun's
    files) behind: the next one removes it, but not a live controller's, another host's
    (a shared TMPDIR) or one without an owner."""
    import socket

    from asyncrl.actors.procs import birth, this_process
    from asyncrl.controller.controller import OWNER_FILE, _host_here, remove_orphans

    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = f"{gone.pid}:{birth(gone.pid)}"
    gone.kill()
    gone.wait()
    here = _host_here()  # the host name and the PID namespace: a container beside ours
    assert here.startswith(f"{socket.gethostname()}/")  # sees other processes
    owners = {"dead": f"{here} {dead}", "live": f"{here} {this_process()}",
              "far": f"node7/pid:[1] {dead}", "new": None,
              "boxed": f"{socket.gethostname()}/pid:[1] {dead}"}
    for name, owner in owners.items():
        (tmp_path / f"asyncrl-secret-{name}").mkdir()
        if owner is not None:
            (tmp_path / f"asyncrl-secret-{name}" / OWNER_FILE).write_text(owner)
    remove_orphans(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "asyncrl-secret-boxed", "asyncrl-secret-far", "asyncrl-secret-live",
        "asyncrl-secret-new"]

    async def main():
        async with asyncrl.Controller() as ctl:
            return (ctl._private / OWNER_FILE).read_text()
    assert run(main()) == f"{here} {this_process()}"


def test_exception_in_the_block_shuts_groups_down():
    pids = []

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Sleeper, nprocs=1)
            pids.extend(group_pids(group))
            raise KeyError("user bug")
    with pytest.raises(KeyError, match="user bug"):
        run(main())
    assert_gone(pids)


def test_closing_a_group_fails_its_concurrent_calls_still_waiting_for_inputs():
    """A concurrent call waits for its inputs on the controller; closing its group fails it
    at once, not when the inputs arrive (here: never, until the test opens the gate)."""
    async def main():
        async with asyncrl.Controller() as ctl:
            source = await ctl.spawn(Sleeper, name="source")
            taker = await ctl.spawn(Sleeper, name="taker")
            pids = group_pids(source) + group_pids(taker)
            gated = source.wait(60)
            waiting = taker.take(gated)
            assert taker.busy  # counted while it waits for `gated`
            await ctl.close_group(taker)
            with pytest.raises(asyncrl.ClosedError):
                await asyncio.wait_for(waiting, 10)
            assert not taker.busy
            await source.open()
            assert await gated == [True]
            return pids
    assert_gone(run(main()))


def test_processes_a_rank_started_go_with_its_group():
    """torchrun starts each rank in a session of its own, and ranks exit with os._exit: what
    a rank started outlived its group until the group's close killed the rank's process
    group too."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2, name="parent")
            children = await group.start_child()
            assert all(pid_alive(p) for p in children)
            await ctl.close_group(group)
            return children, group_pids(group)
    children, pids = run(main())
    try:
        assert_gone(children)  # (SIGKILL is delivered asynchronously)
        assert_gone(pids)
    finally:
        kill_pids([p for p in children if pid_alive(p)])


def test_killed_rank_fails_pending_calls_with_group_dead_error():
    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=2.0) as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2)
            pids = group_pids(group)
            pending = group.wait(60)
            os.kill(group.pids[1], signal.SIGKILL)
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio_wait_for(pending, 2.0 + 10)
            if forking_enabled("AGENTS") and forking_enabled("RANKS"):
                # the server that forked it saw how it ended (the supervisor's source when
                # torchrun is slow to report it)
                await poll_until(lambda: group.agent.exit_seen(1) == -signal.SIGKILL, 10,
                                 "the agent server to report the rank's exit")
            from asyncrl.controller.timeline import called_groups

            seen: set = set()
            token = called_groups.set(seen)
            with pytest.raises(asyncrl.GroupDeadError):
                group.pid()  # a dead group refuses new calls at once...
            called_groups.reset(token)
            assert seen == {"sleeper"}  # ...counted as called: its node may be re-run
            first = asyncio.ensure_future(ctl.close_group(group))  # a restart's close
            await asyncio.sleep(0)  # one turn of the loop: the close has begun
            assert group.closing
            with pytest.raises(asyncrl.GroupDeadError):
                group.pid()  # still its death while it closes (recovery re-runs on it)
            first.cancel()  # the close goes on; a second one waits for it to end
            await ctl.close_group(group)
            alive = [p for p in pids if pid_alive(p)]
            return pids, info.value, alive
    pids, err, alive = run(main())
    assert alive == []
    assert (err.group, err.rank, err.exit_code) == ("sleeper", 1, -signal.SIGKILL)
    assert "killed by signal 9" in str(err)
    assert_gone(pids)


def test_the_rank_that_died_is_named_not_the_ones_torchrun_stopped_after_it():
    """Rank 2 dies; torchrun stops ranks 0 and 1, and rank 0 (stopped, so it cannot exit)
    holds the agent up for its 30 s grace. With a slow supervisor round, ranks 1 and 2 are
    seen gone in one round, rank 1 first: the error must still name rank 2, which died."""
    async def main():
        async with asyncrl.Controller(heartbeat_interval=1.0, heartbeat_timeout=3.0) as ctl:
            group = await ctl.spawn(Sleeper, nprocs=3)
            pids = group_pids(group)
            pending = group.wait(60)
            os.kill(group.pids[0], signal.SIGSTOP)  # silent for 3 s: named only after that
            os.kill(group.pids[2], signal.SIGKILL)
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio_wait_for(pending, 20)
            return pids, info.value
    pids, err = run(main())
    assert (err.group, err.rank) == ("sleeper", 2), str(err)
    assert_gone(pids)


def test_hung_rank_is_found_by_missing_heartbeats():
    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=1.5) as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2)
            pids = group_pids(group)
            await group.say("about to stall")
            await poll_until(lambda: "rank 0: about to stall" in group.agent.tail(), 20,
                             "the rank's output thread to log its line")
            pending = group.wait(60)
            os.kill(group.pids[0], signal.SIGSTOP)  # alive but silent
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await asyncio_wait_for(pending, 1.5 + 10)
            return pids, info.value
    pids, err = run(main())
    assert err.rank == 0 and "no heartbeat" in str(err)
    assert "rank 0: about to stall" in str(err)  # the last lines of its output
    assert_gone(pids)


def test_collective_past_its_timeout_fails_the_call_naming_it():
    async def main():
        async with asyncrl.Controller(collective_timeout=2) as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2)
            with pytest.raises(asyncrl.RemoteError) as info:
                await asyncio_wait_for(group.lonely_all_reduce(1), 2 + 30)
            return info.value
    err = run(main())
    assert (err.rank, err.method) == (1, "lonely_all_reduce")
    assert "Timed out waiting 2000ms" in err.remote_message  # the collective_timeout


def test_failing_construction_raises_remote_error_and_cleans_up():
    made = []

    class Recording(asyncrl.Controller):
        def _make_agent(self, *args):
            made.append(super()._make_agent(*args))
            return made[-1]

    async def main():
        async with Recording() as ctl:
            await asyncio_create_task(ctl.spawn(BrokenInit, 1, nprocs=2, name="broken"))
    with pytest.raises(asyncrl.RemoteError) as info:
        run(main())
    assert info.value.method == "__init__" and info.value.rank == 1
    assert "cannot build on rank 1" in str(info.value)
    assert len(made[0].rank_pids) == 2  # both said hello
    assert_gone([made[0].pid, *made[0].rank_pids.values()])


def test_construction_timeout_names_the_group_and_shows_its_output():
    async def main():
        async with asyncrl.Controller(construct_timeout=3) as ctl:
            await ctl.spawn(SlowInit, nprocs=1, name="slow")
    with pytest.raises(asyncrl.SpawnTimeout) as info:
        run(main())
    msg = str(info.value)
    assert "group 'slow'" in msg and "within 3 s" in msg
    assert "building: loading a very large model" in msg


def test_rank_that_fails_at_start_up_is_reported_with_its_output():
    async def main():
        async with asyncrl.Controller() as ctl:
            await ctl.spawn(Sleeper, nprocs=1, name="bad-env", env={"ASYNCRL_THREADS": "many"})
    with pytest.raises(asyncrl.SpawnError) as info:
        run(main())
    assert "bad-env" in str(info.value) and "invalid literal for int()" in str(info.value)


def test_spawn_argument_errors_before_launch():
    async def main():
        async with asyncrl.Controller() as ctl:
            with pytest.raises(ValueError, match="mesh .* has 4 ranks but nprocs=2"):
                await ctl.spawn(Sleeper, nprocs=2, mesh={"dp": 2, "tp": 2})
            with pytest.raises(TypeError, match="subclass of asyncrl.Worker"):
                await ctl.spawn(dict, nprocs=1)
            with pytest.raises(asyncrl.EncodeError, match="argument 'rank_to_fail'"):
                await ctl.spawn(BrokenInit, lambda: 0, nprocs=1)

            class Local(asyncrl.Worker):
                pass
            with pytest.raises(asyncrl.EncodeError, match="inside a function"):
                await ctl.spawn(Local, nprocs=1)
            assert ctl.groups == {}
    run(main())


def test_a_controller_busy_past_the_heartbeat_timeout_loses_no_group():
    """Work on the controller's loop (a node's own tokenising, a large encode) for longer
    than heartbeat_timeout: the ranks left (no heartbeat) and the controller, back, took
    their heartbeats still unread for silence. A rank on this host waits for a controller
    whose process runs; the controller judges no silence right after being busy."""
    import time

    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=1.5) as ctl:
            group = await ctl.spawn(Sleeper, nprocs=2)
            pids = group_pids(group)
            time.sleep(4.0)  # noqa: ASYNC251 - the loop, busy: the point of the test
            said = "no heartbeat from the controller for"  # each rank, once
            logs = [ctl.logs.path("sleeper", r) for r in (0, 1)]
            await poll_until(lambda: all(p.exists() and said in p.read_text() for p in logs),
                             20, "the ranks to say they wait")
            assert "but its process runs: waiting for it" in \
                ctl.logs.path("sleeper", 0).read_text()
            return await group.take(5), group.dead, pids
    taken, dead, pids = run(main())
    assert_gone(pids)
    assert taken == [5, 5] and dead is None


def asyncio_wait_for(fut, timeout):
    import asyncio
    return asyncio.wait_for(asyncio.shield(_awaitable(fut)), timeout)


async def _awaitable(fut):
    return await fut


def asyncio_create_task(coro):
    import asyncio
    return asyncio.get_running_loop().create_task(coro)


def test_agents_are_forked_from_one_warm_server_shared_by_the_process(monkeypatch):
    """torchrun agents come from one process that imported torch once (asyncrl/controller/
    agent_fork.py), each in a session of its own; the server serves every controller of the
    process, outlives the thread that started one, and ends at close_shared_server (or with
    the process). ASYNCRL_FORK_AGENTS=0: torchrun started anew, a child of the controller."""
    import psutil

    from asyncrl.controller.agent_fork import close_shared_server, shared_server_pid

    async def main():
        async with asyncrl.Controller() as ctl:
            a, b = await asyncio.gather(ctl.spawn(Sleeper, name="a"),
                                        ctl.spawn(Sleeper, name="b", nprocs=2))
            assert len(set(await a.pid() + await b.pid())) == 3  # every rank is up
            agents = [g.agent.pid for g in (a, b)]
            parents = [psutil.Process(p).ppid() for p in agents]
            sessions = {os.getsid(p) for p in agents}
            return shared_server_pid(), agents, parents, sessions, \
                group_pids(a) + group_pids(b)

    close_shared_server()  # the first controller below starts it, on a thread that ends
    first: list = []
    thread = threading.Thread(target=lambda: first.append(run(main())))
    thread.start()
    thread.join()
    server, agents, parents, sessions, pids = first[0]
    assert server is not None and parents == [server, server]
    assert sessions == set(agents)  # each agent leads a session of its own
    assert_gone(pids + agents)
    assert pid_alive(server)
    again, agents, parents, _, pids = run(main())
    assert again == server and parents == [server, server]
    assert_gone(pids + agents)
    close_shared_server()
    assert_gone([server])
    monkeypatch.setenv("ASYNCRL_FORK_AGENTS", "0")
    server, agents, parents, _, pids = run(main())
    assert server is None and parents == [os.getpid()] * 2
    assert_gone(pids + agents)


def test_a_slow_agent_server_does_not_stall_the_other_groups_heartbeats(monkeypatch):
    """A group is started while the agent server takes seconds to answer (busy, or importing
    torch after a restart): asked on the loop, it stopped the heartbeats and every other
    group's ranks exited as if the controller were gone."""
    import time

    from asyncrl.controller.launcher import Agent

    fork, on_loop = Agent.fork, []

    def slow_fork(self):
        if self.group == "late":  # (a loop stall alone no longer ends the others: asked
            on_loop.append(asyncio._get_running_loop() is not None)  # where it waits)
            time.sleep(3.0)  # the server's slow answer (longer than the heartbeat timeout)
        return fork(self)

    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=1.5) as ctl:
            first = await ctl.spawn(Sleeper, name="first")
            monkeypatch.setattr(Agent, "fork", slow_fork)
            late = await ctl.spawn(Sleeper, name="late")
            log = ctl.logs.path("first", 0)
            return (await first.take(7), await late.take(8),
                    group_pids(first) + group_pids(late), log.is_file() and log.read_text())
    first, late, pids, log = run(main())
    assert (first, late) == ([7], [8]) and on_loop == [False]
    assert "no heartbeat from the controller" not in (log or "")
    assert_gone(pids)


class HalfBroken(asyncrl.Worker):
    @asyncrl.register
    def collective(self):  # rank 0 fails first, as on a peer's death in a gloo collective
        if self.rank == 0:
            raise RuntimeError("Connection closed by peer")
        threading.Event().wait(120)


def test_a_call_failed_by_a_peers_broken_collective_says_the_death_behind_it():
    """In a driver (no DataFlow to wait for the death), a rank whose peer died failed the
    call first ("Connection closed by peer"); the death, declared after, could not fail it
    again, and its rank, exit code and output never reached the user."""
    async def main():
        async with asyncrl.Controller(heartbeat_interval=0.2) as ctl:
            group = await ctl.spawn(HalfBroken, nprocs=2)
            pids = group_pids(group)
            call = group.collective()
            with pytest.raises(asyncrl.RemoteError) as first:
                await call
            os.kill(group.pids[1], signal.SIGKILL)
            await poll_until(lambda: group.dead is not None, 20, "the death to be declared")
            return pids, first.value
    pids, err = run(main())
    assert_gone(pids)
    assert "Connection closed by peer" in str(err)
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "then group 'halfbroken': rank 1 is dead (killed by signal 9)" in notes, notes


def test_a_controller_that_fails_to_start_leaves_nothing_behind_and_is_not_current(
        tmp_path, monkeypatch):
    """Its bind failing (a host not of this machine's) left its run and secret folders, was
    still Controller.current() (a DataFlow opened next took it), and close() raised
    AttributeError."""
    import tempfile

    import zmq

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its folders are made here

    async def main():
        ctl = asyncrl.Controller(host="192.0.2.1")  # TEST-NET-1: no machine's address
        with pytest.raises(zmq.ZMQError) as e:
            async with ctl:
                pass
        assert e.value.errno == zmq.EADDRNOTAVAIL
        assert asyncrl.Controller.current() is None
        await ctl.close()  # nothing to do
    run(main())
    assert list(tmp_path.iterdir()) == []


def test_a_worker_class_given_as_an_instance_or_a_name_is_refused_clearly():
    class W(asyncrl.Worker):
        pass

    for bad in (W(), "W"):
        with pytest.raises(TypeError, match="asyncrl.group\\(\\) needs a subclass of "
                                            "asyncrl.Worker \\(the class, not an instance"):
            asyncrl.group(bad)

    async def main():
        async with asyncrl.Controller() as ctl:
            for bad in (W(), "W"):  # (AttributeError: no __name__)
                with pytest.raises(TypeError, match="spawn\\(\\) needs a subclass of "
                                                    "asyncrl.Worker, got"):
                    await ctl.spawn(bad)
            for name in ("..", ".", "a/b"):  # ".." wrote its ranks' logs above RUN_DIR/logs
                with pytest.raises(ValueError, match=f"group name {re.escape(repr(name))}: "
                                                     f"use letters"):
                    await ctl.spawn(Sleeper, name=name)
    run(main())


class DrawsInItsState(asyncrl.Worker):
    """A worker whose save_state and load_state draw random numbers (a data loader's seed,
    a head made anew)."""

    def save_state(self, folder) -> None:
        torch.rand(3)

    def load_state(self, folder) -> None:
        torch.rand(5)


def test_a_checkpoint_leaves_the_random_numbers_where_the_saved_run_had_them(tmp_path):
    """The RNG was saved before save_state and restored before load_state: the draws either
    made shifted every number of the resumed run (it did not resume exactly)."""
    worker = DrawsInItsState.__new__(DrawsInItsState)
    worker.group_name, worker.rank, worker.world_size = "g", 0, 1
    torch.manual_seed(0)
    worker.save_checkpoint(str(tmp_path))
    went_on = torch.rand(4)  # the run that saved goes on
    worker.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.rand(4), went_on)  # the resumed one draws the same
