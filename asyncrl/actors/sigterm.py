"""A rank's way out on SIGTERM (torchrun's, when its controller is gone or a peer failed):
its shared memory unlinked first (RAM until a reboot otherwise), then the process ends."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from asyncrl.comm.dataplane import unlink_own_segments


def stop_on_sigterm() -> None:
    """torchrun stops its ranks with SIGTERM (its controller gone, a peer failed): the rank's
    shared memory goes first (RAM until a reboot), then the rank, at once: from a thread
    Python's signal handler wakes whatever the main thread does (in a rendezvous, or in a
    collective of on_close, a Python handler would run only once it returned). Code that
    later sets a wakeup fd of its own on the main thread (an asyncio loop's signal
    handlers) takes this one over: SIGTERM then waits for the main thread, as before."""
    signal.signal(signal.SIGTERM, _terminated)  # (a process forked from the rank: no watcher)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))  # its signals its own

    def watch() -> None:
        while signal.SIGTERM not in os.read(read, 64):  # (the numbers of signals caught)
            pass
        _terminated(signal.SIGTERM, None)
    threading.Thread(target=watch, daemon=True, name="asyncrl-sigterm").start()


def _terminated(signum: int, _frame: Any) -> None:
    unlink_own_segments()
    os._exit(128 + signum)  # (signal.signal is the main thread's alone: no SIG_DFL again)
