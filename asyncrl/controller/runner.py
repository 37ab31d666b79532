"""run(): the event loop a driver runs on: uvloop when it is installed.

SIGTERM (scancel, docker stop, a supervisor) cancels the driver as Ctrl-C does: its
controller shuts every group down and removes what it made, then run() raises Terminated,
a SystemExit: `python driver.py` exits 143 (as a shell reports SIGTERM), no traceback.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Terminated(SystemExit):
    """The process got SIGTERM while a driver ran: it was cancelled, its groups shut down."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.code = 128 + signal.SIGTERM  # (its text stays "SIGTERM")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on uvloop (or asyncio's loop without uvloop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_until_sigterm(coro))
    return uvloop.run(_until_sigterm(coro))


async def _until_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    terminated = []

    def terminate() -> None:
        terminated.append(True)
        task.cancel()

    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:  # the caller's own (a scheduler's requeue): kept
        return await coro
    try:
        loop.add_signal_handler(signal.SIGTERM, terminate)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        return await coro
    try:
        return await coro
    except asyncio.CancelledError:
        if terminated:
            raise Terminated("SIGTERM") from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, before)
