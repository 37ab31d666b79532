"""Which node a step's failure began in.

A node's failed result fails the nodes it feeds too (their calls on it fail), and which of
them the flow hears of first is chance; the error names the node whose own work failed."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.controller.nodes import NodeError
from asyncrl.futures.future import futures_in


def upstream(deps: dict[str, dict[str, tuple[str, str] | None]], order: list[str],
             name: str) -> list[str]:
    """The nodes of the same step whose results reach `name`, in topological order."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for src in deps[todo.pop()].values():
            if src is not None and src[0] == "node" and src[1] not in seen:
                seen.add(src[1])
                todo.append(src[1])
    return [n for n in order if n in seen]


def blame(returned: dict[str, asyncio.Task[Any]], ups: list[str], name: str, step: int,
          e: Exception) -> NodeError:
    """The error for node `name`'s failure `e` at `step`, or for the first of its upstream
    nodes `ups` (their tasks in `returned`) that failed or returned a failed future."""
    if isinstance(e, NodeError):
        return e
    node = name
    cause: BaseException = e
    for up in ups:
        task = returned.get(up)
        if task is None or not task.done() or task.cancelled():
            continue
        failed = task.exception()
        if isinstance(failed, NodeError):
            return failed
        for fut in futures_in(task.result()) if failed is None else ():
            done = fut._fut
            failed = done.exception() if done.done() and not done.cancelled() else None
            if failed is not None:
                break
        if failed is not None:
            node, cause = up, failed
            break
    err = NodeError(node, step, cause)
    err.__cause__ = cause  # raised from it: a rewind looks through it for a group's death
    return err
