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
        return asyncio.run(_until_interrupt(_until_sigterm(coro)))
    return uvloop.run(_until_interrupt(_until_sigterm(coro)))


async def _until_interrupt(coro: Coroutine[Any, Any, T]) -> T:
    """Ctrl-C as Python 3.11's asyncio.run takes it, on 3.10 too: the first cancels the
    driver (its flow and controller close what they opened), a second raises
    KeyboardInterrupt. (3.10's raised it at once, wherever the loop was, then cancelled every
    task, shielded ones and a closing controller's too.) 3.11 has set its own handler."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    interrupted = []

    def interrupt() -> None:
        interrupted.append(True)
        if len(interrupted) > 1:
            raise KeyboardInterrupt  # (asyncio and uvloop let it out of run)
        task.cancel()

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return await coro  # the caller's own, or 3.11's
    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        return await coro
    try:
        return await coro
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
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
