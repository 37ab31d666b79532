from __future__ import annotations

import os
import sys

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BackgroundController, assert_gone, group_pids, wait_until  # noqa: E402


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
    """Every test must leave no child process (torchrun agents, ranks, drivers) behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield

    def leftovers() -> list[int]:
        return [p.pid for p in me.children(recursive=True)
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]

    wait_until(lambda: not leftovers(), 20, "child processes of the test to exit")
