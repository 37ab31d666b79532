"""The function pool's children (asyncrl/hybrid/fn_pool.py): what they fork, start and
inherit, and how they end with it."""

from __future__ import annotations

import errno
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import assert_gone, wait_until

from asyncrl.actors.procs import kill_pids, pid_alive, state
from asyncrl.hybrid import fn_pool
from asyncrl.hybrid.fn_pool import FunctionPool

SANDBOX = "ASYNCRL_TEST_SANDBOX"  # where a function writes the pid of what it started


def jobs(*answers: int) -> list[tuple[list[int], list[int], dict[str, int]]]:
    return [([1], [1] * answer, {"answer": answer}) for answer in answers]


def forks_a_helper(prompt, response, answer):
    """The response's length; first forking a helper that does not end with os._exit():
    on answer 1 it returns -1.0, on 3 it raises SystemExit (`if os.fork() == 0: try: run()
    finally: sys.exit(0)`)."""
    if answer in (1, 3) and os.fork() == 0:
        if answer == 1:
            return -1.0
        sys.exit(0)
    return float(len(response))


def test_a_helper_the_function_forked_answers_no_row():
    """The helper ran the rest of the child's loop: it sent a frame of its own (a wrong
    score in a later call, or an assertion error) and read the next jobs."""
    pool = FunctionPool(forks_a_helper, processes=1, timeout_s=None)
    seen = pool.pids()
    try:
        for helper in (1, 3):
            assert pool.call(jobs(helper)) == ([float(helper)], [False])
            assert pool.call(jobs(4, 2)) == ([4.0, 2.0], [False, False])
            assert pool.call(jobs(2)) == ([2.0], [False])
        assert pool.pids() == seen
    finally:
        pool.close()
    assert_gone(seen)


def orphans_a_sandbox(prompt, response, answer):
    """Starts a sandbox in a session of its own, its pid written where the test says: on
    answer 1 through a shell that exits at once (`sh -c 'sleep 60 &'`), then hangs; on 2
    directly, then SIGKILLs its own process. Either way the sandbox's parent is gone."""
    if answer == 1:
        sh = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
        assert sh.stdout is not None
        pid = sh.stdout.readline().strip()
        sh.stdout.close()
        sh.wait()
        Path(os.environ[SANDBOX]).write_text(pid)
        threading.Event().wait()  # forever
    sandbox = subprocess.Popen(["sleep", "60"], start_new_session=True)
    Path(os.environ[SANDBOX]).write_text(str(sandbox.pid))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("end", ["timeout", "close", "crash"])
def test_a_sandbox_whose_parent_exited_goes_with_the_function_process(tmp_path, monkeypatch,
                                                                      end):
    """Orphaned, it was re-parented out of the child's tree, where the kill looked: it ran
    on past a timeout, a close() and the child's own death."""
    sandbox = tmp_path / "sandbox.pid"
    monkeypatch.setenv(SANDBOX, str(sandbox))
    pool = FunctionPool(orphans_a_sandbox, processes=1,
                        timeout_s=1.0 if end == "timeout" else None)
    seen, failed = pool.pids(), []

    def hangs() -> None:
        try:
            pool.call(jobs(1))
        except Exception as e:  # noqa: BLE001 - the test reads it
            failed.append(e)
    try:
        if end == "close":
            caller = threading.Thread(target=hangs, daemon=True)
            caller.start()
            wait_until(sandbox.exists, 60, "the sandbox to start")
            pool.close()
            caller.join(30)
            assert not caller.is_alive() and isinstance(failed[0], RuntimeError), failed
        else:
            assert pool.call(jobs(1 if end == "timeout" else 2)) == ([None], [True])
            assert pool.crashed == [end == "crash"]
        assert_gone([int(sandbox.read_text())])
        seen += pool.pids()
    finally:
        pool.close()
        if sandbox.exists():  # (left by a failure: not for the next test)
            kill_pids([p for p in [int(sandbox.read_text())] if is_sleep(p)])
    assert_gone(seen)


def is_sleep(pid: int) -> bool:
    try:
        return pid_alive(pid) and Path(f"/proc/{pid}/cmdline").read_bytes()[:6] == b"sleep\0"
    except OSError:
        return False


def forks_fast(prompt, response, answer):
    """A sandbox in a session of its own that forks all the time, its session written
    where the test says; then hangs."""
    sh = subprocess.Popen(["sh", "-c", "while :; do sleep 30 & sleep 0.005; done"],
                          start_new_session=True)
    Path(os.environ[SANDBOX]).write_text(str(sh.pid))
    threading.Event().wait()  # forever


def in_session(sid: int) -> list[int]:
    """The live processes of session `sid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def test_a_timeout_leaves_nothing_of_a_sandbox_that_keeps_forking(tmp_path, monkeypatch):
    """Killed without being stopped first, a process forked during the scan for them ran
    on (one timeout in three)."""
    sandbox = tmp_path / "sandbox.pid"
    monkeypatch.setenv(SANDBOX, str(sandbox))
    pool = FunctionPool(forks_fast, processes=1, timeout_s=1.0)  # (time to write its pid)
    seen, sessions = pool.pids() + [pool.spare_pid], []
    try:
        for _ in range(6):
            sandbox.unlink(missing_ok=True)
            assert pool.call(jobs(1)) == ([None], [True])
            sessions.append(int(sandbox.read_text()))
            # (those that escaped would live 30 s)
            wait_until(lambda: not in_session(sessions[-1]), 3, "the sandbox to end")
            seen += pool.pids() + [pool.spare_pid]
    finally:  # (left by a failure: the loop forks for ever, each sleep lives 30 s)
        if sandbox.exists() and sandbox.read_text().isdigit():  # (the call's own, unrecorded)
            sessions.append(int(sandbox.read_text()))
        for sid in {s for s in sessions if in_session(s)}:  # (its pid in use: not reused)
            try:  # the whole group at once (sh's: no job control), none forking meanwhile
                os.killpg(sid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pool.close()
    assert_gone(seen)


def segfaults(prompt, response, answer):
    """The answer; a segfault on answer 2."""
    if answer == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    return float(answer)


def test_a_row_whose_process_a_signal_killed_counts_as_timed_out(caplog):
    """A segfault or the OOM killer mid-row failed the whole call (the step); a Python
    exception in the function still does (tests/test_rl_reward.py)."""
    pool = FunctionPool(segfaults, processes=1, timeout_s=None)
    seen = pool.pids()
    try:
        assert pool.call(jobs(1, 2, 3)) == ([1.0, None, 3.0], [False, True, False])
        assert pool.crashed == [False, True, False]
        assert caplog.text.count("died by a signal") == 1
        assert "'segfaults': a process died by a signal on row 1 (SIGSEGV); scored as " \
            "timed out (crashed)" in caplog.text
        assert not pid_alive(seen[0]) and seen[0] not in pool.pids()  # replaced
        assert pool.call(jobs(4)) == ([4.0], [False]) and pool.crashed == [False]
        seen += pool.pids()
    finally:
        pool.close()
    assert_gone(seen)


def test_a_pool_made_on_a_thread_that_ended_keeps_its_processes():
    """Their death signals fired when the thread that made them ended (a call on it had
    let them set those): the child was stopped, then killed by its watcher."""
    made: list[FunctionPool] = []

    def make() -> None:
        made.append(FunctionPool(segfaults, processes=1, timeout_s=30.0))
        assert made[0].call(jobs(1)) == ([1.0], [False])
    maker = threading.Thread(target=make)
    maker.start()
    maker.join()
    pool = made[0]
    seen = pool.pids()
    try:
        # the thread gone from the kernel too (the death signals tied to it, sent)
        wait_until(lambda: not os.path.exists(f"/proc/self/task/{maker.native_id}"), 30,
                   "the thread to end")
        assert pool.call(jobs(1, 3)) == ([1.0, 3.0], [False, False])
        assert pool.pids() == seen and state(seen[0]) not in ("T", "t", "Z", None)
        seen.append(pool.spare_pid)
    finally:
        seen += pool.pids() + [pool.spare_pid]
        pool.close()
    assert_gone(seen)


class Scorer:
    def __call__(self, prompt, response, answer):
        return 1.0

    def score(self, prompt, response, answer):
        return 1.0


@pytest.mark.parametrize("fn", [functools.partial(segfaults, answer=1), Scorer(),
                                Scorer().score], ids=["partial", "instance", "bound method"])
def test_a_function_that_does_not_import_as_itself_is_refused_at_once(fn):
    """It failed at the first call ("exited with 1 before importing functools:"), or ran
    the plain function of a bound method with the prompt as `self`."""
    try:
        pool = FunctionPool(fn, processes=1, timeout_s=None)
    except TypeError as e:
        assert "cannot run in child processes: they import it by its module and name" in \
            str(e) and "pass a module-level function (def)" in str(e), e
    else:
        pool.close()
        pytest.fail(f"{fn!r} was taken")


def environment_names(prompt, response, answer):
    return sorted(k for k in os.environ if k.startswith("ASYNCRL_"))


def test_the_function_processes_lack_the_runs_secret(monkeypatch):
    monkeypatch.setenv("ASYNCRL_SECRET_FILE", "/tmp/asyncrl-secret/secret")
    monkeypatch.setenv("ASYNCRL_GROUP", "reward")
    pool = FunctionPool(environment_names, processes=1, timeout_s=None)
    seen = pool.pids()
    try:
        names = pool.call(jobs(1))[0][0]
        assert "ASYNCRL_GROUP" in names and "ASYNCRL_SECRET_FILE" not in names
    finally:
        pool.close()
    assert_gone(seen)


def fails_or_hangs(prompt, response, answer):
    """The answer; a ValueError on answer 1, a hang on 2 (until its process is killed)."""
    if answer == 1:
        raise ValueError("bad row")
    if answer == 2:
        time.sleep(60)
    return float(answer)


def flaky_starts(monkeypatch) -> tuple[dict[str, int], list[int]]:
    """The pool's process starts fail with EAGAIN (a pids limit) while fails["n"] > 0; the
    pids of those that started (children and watchers), to check that they are gone."""
    fails, started = {"n": 0}, []

    class Flaky(fn_pool._Child):
        def __init__(self, ref):
            if fails["n"] > 0:
                fails["n"] -= 1
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable (a test)")
            super().__init__(ref)
            started.extend((self.pid, self.watcher.pid))
    monkeypatch.setattr(fn_pool, "_Child", Flaky)
    return fails, started


def test_a_process_that_fails_to_start_hides_no_error_and_the_next_call_starts_it(
        monkeypatch):
    """The replacement of a process busy as its call failed did not start: its OSError was
    raised in place of the row's error, and the process reaped stayed in the pool: every
    later call failed on its closed pipe ("Invalid file object")."""
    fails, started = flaky_starts(monkeypatch)
    pool = FunctionPool(fails_or_hangs, processes=2, timeout_s=None)
    try:
        fails["n"] = 1  # the hanging row's process's replacement
        with pytest.raises(ValueError, match="failed on row 1:(?s:.*)ValueError: bad row") as e:
            pool.call(jobs(2, 1))
        assert "replacing this call's processes failed too (BlockingIOError(11, 'Resource " \
            "temporarily unavailable" in "".join(e.value.__notes__)
        assert pool.call(jobs(3, 4)) == ([3.0, 4.0], [False, False])
    finally:
        pool.close()
    assert_gone(started)


def test_a_spare_or_replacement_that_fails_to_start_costs_one_call_at_most(monkeypatch,
                                                                          caplog):
    """A timed-out row's process replaced by the spare, whose own replacement did not start,
    failed the call; a call whose replacement and retry did not start, every later one."""
    fails, started = flaky_starts(monkeypatch)
    pool = FunctionPool(fails_or_hangs, processes=1, timeout_s=0.5)
    try:
        fails["n"] = 3
        assert pool.call(jobs(2, 3)) == ([None, 3.0], [True, False])  # the spare taken
        assert pool.spare_pid is None and "its spare process did not start" in caplog.text
        with pytest.raises(OSError, match="Resource temporarily unavailable") as e:
            pool.call(jobs(2))  # no spare: the row's replacement fails, and again as it ends
        assert "replacing this call's processes failed too" in "".join(e.value.__notes__)
        assert pool.call(jobs(2, 3)) == ([None, 3.0], [True, False])  # and a spare again
        assert pool.spare_pid is not None
    finally:
        pool.close()
    assert_gone(started)


def test_more_processes_than_the_ranks_cores_are_warned_of(caplog):
    """A rank on a CPU-only host is pinned to its cores, and its pool's processes with it:
    two on one core ran a row of 1 s of CPU in ~2 s, past its timeout_s, unsaid."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(was)})
    seen: list[int] = []
    try:
        pool = FunctionPool(segfaults, processes=2, timeout_s=5.0)
        seen = pool.pids() + [pool.spare_pid]
        pool.close()
    finally:
        os.sched_setaffinity(0, was)
    assert_gone(seen)
    assert f"'segfaults': its 2 processes share the 1 core(s) this rank may use [{min(was)}]; " \
        "timeout_s=5.0 counts wall time, so a row waiting for a core can time out; use " \
        "processes <= 1, a larger timeout_s, or give the group more cores: more ranks" \
        in caplog.text


def stops_at_breakpoints(prompt, response, answer):
    breakpoint()
    breakpoint()
    return float(answer)


def test_a_breakpoint_in_a_pools_process_is_said_once_and_the_call_goes_on(capfd,
                                                                            monkeypatch):
    """pdb read the process's empty stdin: bdb.BdbQuit failed the call, a stray "(Pdb)" in
    the log, where breakpoint() in the rank (processes=0) waits for `asyncrl attach`."""
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    pool = FunctionPool(stops_at_breakpoints, processes=1, timeout_s=None)
    seen = pool.pids()
    try:
        assert pool.call(jobs(1, 2)) == ([1.0, 2.0], [False, False])
    finally:
        pool.close()
    assert_gone(seen)
    said = capfd.readouterr()
    assert said.err.count("cannot attach a debugger; debug with processes=0") == 1, said
    assert f"breakpoint() at {__file__}:" in said.err and "Pdb" not in said.out + said.err
