"""What Python 3.11 added that asyncrl uses, also on 3.10. A leaf module: every layer may
import it."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import traceback
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def add_note(exc: BaseException, note: str) -> None:
    """`exc.add_note(note)`: on 3.10 the note is kept in `__notes__` as 3.11 keeps it (the
    CLI prints notes itself; 3.10's tracebacks do not)."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def create_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
                context: contextvars.Context | None) -> asyncio.Task[T]:
    """`loop.create_task(coro, context=context)`: on 3.10 the task runs in a copy of
    `context` (what it sets there is not seen in `context` afterwards)."""
    if sys.version_info >= (3, 11):
        return loop.create_task(coro, context=context)
    return loop.create_task(coro) if context is None else context.run(loop.create_task, coro)


_cancelled: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


def cancel(task: asyncio.Task[Any]) -> None:
    """`task.cancel()`, remembered on 3.10 for `cancelling`."""
    if sys.version_info < (3, 11):
        _cancelled.add(task)
    task.cancel()


def cancelling(task: asyncio.Task[Any]) -> bool:
    """Whether `task` itself was asked to cancel (`task.cancelling()` on 3.11; on 3.10, by
    `cancel` above), not merely handed a CancelledError by a task it awaited."""
    if sys.version_info >= (3, 11):
        return task.cancelling() > 0
    return task in _cancelled


def format_exception(exc: BaseException) -> str:
    """`exc`'s traceback as Python prints it, each exception of its chain with its notes
    (3.10 leaves them out)."""
    if sys.version_info >= (3, 11):
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _chain(exc, set())


def _chain(exc: BaseException, seen: set[int]) -> str:
    seen.add(id(exc))
    text, cause, context = "", exc.__cause__, exc.__context__
    if cause is not None and id(cause) not in seen:
        text = _chain(cause, seen) + ("\nThe above exception was the direct cause of the "
                                      "following exception:\n\n")
    elif context is not None and not exc.__suppress_context__ and id(context) not in seen:
        text = _chain(context, seen) + ("\nDuring handling of the above exception, another "
                                        "exception occurred:\n\n")
    text += "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, chain=False))
    return text + "".join(f"{note}\n" for note in getattr(exc, "__notes__", ()))


def print_notes_on_310() -> None:
    """An uncaught exception printed with its notes on 3.10 too (a driver's, `asyncrl run`'s):
    they say which other ranks raised, which group died after, why nothing was recovered."""
    if sys.version_info < (3, 11) and sys.excepthook is sys.__excepthook__:
        sys.excepthook = _print_with_notes


def _print_with_notes(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    sys.stderr.write(format_exception(exc.with_traceback(tb)))
