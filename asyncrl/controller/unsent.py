"""A group call not sent yet (it waits for its inputs, or for the calls ahead of it), the
check that its inputs' data still exist, and its failure.

A failed call's future keeps its error, and an error's traceback keeps the frames it passed
through with all their locals: for a call that failed before it was sent, its arguments and
its inputs' futures and objects, which would live as long as the future: its error is kept
without them (what went wrong is in its message and notes).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from asyncrl.controller.objects import ObjectRef
from asyncrl.errors import InputLostError
from asyncrl.futures.future import DistFuture


@dataclass
class Queued:
    """A call of `method` that waits to be sent."""

    method: str
    args: tuple
    kwargs: dict[str, Any]
    future: DistFuture
    inputs: list[ObjectRef] = field(default_factory=list)
    context: contextvars.Context | None = None  # its caller's, when it waits in the backlog

    def fail(self, e: Exception) -> None:
        """It was not sent: its arguments go now, and so do its error's frames' locals (which
        name them; the future keeps the error)."""
        self.args, self.kwargs, self.inputs, self.context = (), {}, [], None
        self.future._set_exception(bare(e))


def lost(ref: ObjectRef) -> bool:
    """Whether the group holding `ref`'s parts is gone, and they with it."""
    return ref.group.dead is not None or ref.group.closing


def check_held(ref: ObjectRef, what: str) -> None:
    if lost(ref):
        dead = ref.group.dead
        why = f"is dead: {dead.reason}" if dead is not None else "was shut down"
        raise InputLostError(f"{what} is lost: it was held by group {ref.group.name!r}, "
                             f"which {why}; call its method again on the group brought "
                             f"back (a DataFlow with max_restarts does that)")


def bare(exc: Exception) -> Exception:
    """`exc` without the frames it passed through (their locals name the call's arguments
    and inputs) and without a context never shown (`raise ... from None`: its frames keep
    their functions, and a closure the arguments it captured)."""
    if exc.__suppress_context__:
        exc.__context__ = None
    return exc.with_traceback(None)
