from __future__ import annotations

import os
import shutil
import sys
import tempfile

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BackgroundController, assert_gone, group_pids, wait_until  # noqa: E402

from asyncrl.controller.agent_fork import shared_server_pid  # noqa: E402


@pytest.fixture(scope="module")
def bg():
    """A Controller on a background thread, shared by a module's tests; every process its
    groups started must be gone once it closes."""
    bg = BackgroundController()
    yield bg
    pids = [p for g in bg.ctl.groups.values() for p in group_pids(g)]
    bg.close()
    if pids:
        assert_gone(pids)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every test must leave no child process (torchrun agents, ranks, drivers) behind; the
    process-wide agent server (asyncrl/controller/agent_fork.py) outlives controllers."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield

    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone between the listing and the look
            return False

    def leftovers() -> list[int]:
        return [p.pid for p in me.children(recursive=True)
                if p.pid not in before and p.pid != shared_server_pid() and alive(p)]

    wait_until(lambda: not leftovers(), 20, "child processes of the test to exit")


@pytest.fixture
def killed_driver_env():
    """The environment for a driver the test kills: a killed Controller cannot remove its
    temporary folders (the run dir, the secret's folder), so they go under one the test
    removes. Short (not tmp_path): relay sockets' ipc:// paths live in it."""
    scratch = tempfile.mkdtemp(prefix="asyncrl-t-")
    yield {**os.environ, "TMPDIR": scratch}
    shutil.rmtree(scratch, ignore_errors=True)
