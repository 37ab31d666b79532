"""A group's close, rank side: `Worker.on_close` on every rank, after the calls under way
(within a bound), and a hung one ended at the collective timeout."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl


class Closing(asyncrl.Worker):
    def __init__(self, folder: str):
        self.folder = folder

    @asyncrl.register
    def ping(self) -> int:
        return self.rank

    def on_close(self) -> None:  # what a worker holds outside its process is released here
        with open(os.path.join(self.folder, f"closed{self.rank}"), "w") as f:
            f.write("bye")


def test_on_close_runs_on_every_rank_as_its_group_closes(tmp_path):
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Closing, str(tmp_path), nprocs=2)
            assert await group.ping() == [0, 1]
            assert not list(tmp_path.iterdir())  # not before the group closes
            pids = group_pids(group)
            await ctl.close_group(group)
            return pids
    assert_gone(run(main()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed0", "closed1"]


class ClosesAfterItsCalls(asyncrl.Worker):
    def __init__(self, folder: str):
        self.folder = folder

    @asyncrl.register
    def slow(self) -> None:
        import time

        open(os.path.join(self.folder, "started"), "w").close()
        time.sleep(1.5)  # the call's own work (a reward's scoring, say)
        open(os.path.join(self.folder, "done"), "w").close()

    def on_close(self) -> None:  # as a RewardFn closes the pool a running score() uses
        with open(os.path.join(self.folder, "closed"), "w") as f:
            f.write(str(os.path.exists(os.path.join(self.folder, "done"))))


def test_on_close_runs_after_the_call_under_way_ends(tmp_path):
    """The rank ran on_close as soon as its group closed, beside a call still running (a
    flow closed with steps in flight, Ctrl-C); now calls under way end first (within a
    bound) and no other starts."""
    folder = str(tmp_path)

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(ClosesAfterItsCalls, folder)
            running = group.slow()
            await poll_until(lambda: os.path.exists(os.path.join(folder, "started")), 60,
                             "the call to start")
            pids = group_pids(group)
            await ctl.close_group(group)
            with pytest.raises(asyncrl.ClosedError, match="group 'closesafteritscalls' was "
                                                          "shut down"):
                await running  # the group closed under it
            return pids
    assert_gone(run(main()))
    with open(os.path.join(folder, "closed")) as f:
        assert f.read() == "True"


class HungClose(asyncrl.Worker):
    @asyncrl.register
    def ping(self):
        return self.rank

    def on_close(self):
        threading.Event().wait()  # a collective whose peers are gone


def test_a_hung_on_close_ends_at_the_collective_timeout():
    """With the controller gone nobody kills a rank whose on_close never returns: it held
    its process (and its GPU) forever. Here the controller waits longer than the timeout
    before it would kill: the rank ends itself and says why."""
    async def main():
        async with asyncrl.Controller(collective_timeout=1.0, shutdown_grace=120) as ctl:
            group = await ctl.spawn(HungClose)
            assert await group.ping() == [0]
            pids = group_pids(group)
            await ctl.close_group(group)
            said = "on_close() did not return within 1 s; exiting"  # its last line, streamed
            await poll_until(lambda: said in ctl.logs.path("hungclose", 0).read_text(), 20,
                             "the rank's last line")
            return pids
    assert_gone(run(main(), timeout=100))


class SaysGoodbye(asyncrl.Worker):
    @asyncrl.register
    def ping(self):
        return self.rank

    def on_close(self):
        for i in range(80):  # (within the output's burst limit of 100 lines)
            print(f"closing {i} " + "x" * 8000, flush=True)
        print("goodbye", flush=True)


def test_a_ranks_last_lines_reach_the_controller_before_it_exits():
    """The output thread queued them on a socket whose context os._exit never ended: zmq's
    I/O thread died with what it still held (the last lines lost, often in bursts)."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(SaysGoodbye, nprocs=2)
            assert await group.ping() == [0, 1]
            pids = group_pids(group)
            await ctl.close_group(group)
            logs = [ctl.logs.path("saysgoodbye", r).read_text() for r in (0, 1)]
            return pids, logs
    pids, logs = run(main())
    assert_gone(pids)
    for log in logs:
        assert log.count("closing ") == 80 and "goodbye" in log, log[-300:]


class LeavesAThread(asyncrl.Worker):
    """Holds a thread that never ends and is no daemon (a user's loader, say): Python's own
    exit waits for it for ever; a rank's exit must not."""

    def __init__(self, exit_in_close: bool = False):
        self.exit_in_close = exit_in_close
        threading.Thread(target=threading.Event().wait, name="user-loader").start()

    @asyncrl.register
    def ping(self):
        return self.rank

    def on_close(self):
        if self.exit_in_close:
            print("leaving with code 3", flush=True)
            sys.exit(3)


def test_a_rank_interrupted_exits_with_130_past_a_thread_that_never_ends():
    """A SIGINT (torchrun passes one on at Ctrl-C) raised KeyboardInterrupt out of the
    rank's main: Python's exit then waited for the user's thread, and the rank hung on,
    silent, until the supervisor gave up on its heartbeats. Started from a background job
    of a shell (CI's), every process had SIGINT ignored, ranks too: it did nothing."""
    async def main():
        async with asyncrl.Controller(heartbeat_timeout=30.0) as ctl:
            group = await ctl.spawn(LeavesAThread)
            assert await group.ping() == [0]
            pids = group_pids(group)
            os.kill(group.pids[0], signal.SIGINT)
            await poll_until(lambda: group.dead is not None, 25, "the group's death")
            return pids, str(group.dead)
    pids, dead = run(main(), timeout=60)
    assert_gone(pids)
    assert "rank 0 is dead (exit code 130" in dead, dead


def test_sys_exit_in_on_close_ends_the_rank_with_its_code_past_a_thread_that_never_ends():
    """sys.exit() in on_close left the rank's main through Python's own exit, which waited
    for the user's thread: the group's close hung until the controller killed the rank
    (here after 120 s)."""
    async def main():
        async with asyncrl.Controller(shutdown_grace=120) as ctl:
            group = await ctl.spawn(LeavesAThread, True)
            assert await group.ping() == [0]
            pids = group_pids(group)
            await ctl.close_group(group)
            return pids, ctl.logs.path("leavesathread", 0).read_text()
    pids, log = run(main(), timeout=60)
    assert_gone(pids)
    assert "leaving with code 3" in log, log[-500:]
