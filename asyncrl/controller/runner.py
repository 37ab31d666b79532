"""run(): the event loop a driver runs on: uvloop when it is installed.

SIGTERM (scancel, docker stop, a supervisor) cancels the driver as Ctrl-C does: its
controller shuts every group down and removes what it made, then run() raises Terminated,
a SystemExit: `python driver.py` exits 143 (as a shell reports SIGTERM), no traceback.
"""

from __future__ import annotations

import asyncio
import signal
import threading
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
        return asyncio.run(_until_interrupt(_until_sigterm(coro)))
    return uvloop.run(_until_interrupt(_until_sigterm(coro)))


async def _until_interrupt(coro: Coroutine[Any, Any, T]) -> T:
    """Ctrl-C as Python 3.11's asyncio.run takes it, on 3.10 too: the first cancels the
    driver (its flow and controller close what they opened), a second raises
    KeyboardInterrupt. (3.10's raised it at once, wherever the loop was, then cancelled every
    task, shielded ones and a closing controller's too.) A signal handler, as 3.11's: the
    loop's add_signal_handler also ran for a SIGINT a forked child (a DataLoader's worker)
    took, and over a driver's own handler. 3.11 has set its own, as may the driver."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or \
            threading.current_thread() is not threading.main_thread():
        return await coro
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    presses = []

    def interrupt(signum: int, frame: Any) -> None:
        presses.append(signum)
        if len(presses) > 1:
            raise KeyboardInterrupt
        loop.call_soon_threadsafe(task.cancel)

    signal.signal(signal.SIGINT, interrupt)
    try:
        return await coro
    except asyncio.CancelledError:
        if len(presses) == 1:  # (after a second, asyncio.run's own cancel at its end)
            raise KeyboardInterrupt from None
        raise
    finally:
        if signal.getsignal(signal.SIGINT) is interrupt:  # (not one the driver set since)
            signal.signal(signal.SIGINT, signal.default_int_handler)


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
