"""Shared by the tests (importable on ranks too: test files are loaded there by path)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine, Iterable
from typing import Any

import asyncrl
from asyncrl.controller.launcher import pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
    """Run a test coroutine with a bound: a hang fails the test instead of the suite."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll a condition with a bound (for process exits, which have no event to await)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def assert_gone(pids: Iterable[int], timeout: float = 15) -> None:
    pids = list(pids)
    assert pids, "no pids to check"
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout,
               f"processes {[p for p in pids if pid_alive(p)]} to exit")


def group_pids(group: asyncrl.GroupHandle) -> list[int]:
    """The torchrun agent and every rank of a group."""
    assert group.agent.pid is not None
    return [group.agent.pid, *group.pids.values()]


class BackgroundController:
    """A Controller running on its own thread's loop, driven from sync test code: the way
    sync programs use asyncrl (calls from another thread, ``fut.result(timeout)``)."""

    def __init__(self, **kwargs: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ctl = asyncrl.Controller(**kwargs)
        self.run(self.ctl.start())

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, *args: Any, **kwargs: Any) -> asyncrl.GroupHandle:
        return self.run(self.ctl.spawn(*args, **kwargs))

    def close(self) -> None:
        try:
            self.run(self.ctl.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
