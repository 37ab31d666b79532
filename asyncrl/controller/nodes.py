"""Nodes: the controller-side functions a DataFlow is made of.

    @asyncrl.node                                    its parameters name its inputs
    def score(rollout): ...
    @asyncrl.node(inputs={"batch": "rollout"}, follows="train", name="...")

A node stays a plain function (callable as before); FlowError names a wrong graph, NodeError
a node that failed while the flow ran.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import AsyncRLError


class FlowError(AsyncRLError, ValueError):
    """The flow's graph is wrong: the message names the node and the fix."""


class NodeError(AsyncRLError):
    """A node failed while the flow ran; `.node` and `.step` say which, the cause is chained."""

    def __init__(self, node: str, step: int, cause: BaseException):
        self.node, self.step = node, step
        where = ""
        group = getattr(cause, "group", None)
        if group is not None:
            where = f" on group {group!r}"
        super().__init__(f"node {node!r} failed at step {step}{where}: "
                         f"{type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class Param:
    name: str  # the function's parameter
    source: str  # the flow input or node it reads
    optional: bool
    default: Any = None


@dataclass
class Node:
    fn: Callable[..., Any]
    name: str
    params: list[Param]
    follows: str | None

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:  # still a plain function
        return self.fn(*args, **kwargs)


def node(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         inputs: dict[str, str] | None = None, follows: str | Node | None = None) -> Any:
    """Mark a controller-side function as a node: ``@asyncrl.node`` or
    ``@asyncrl.node(inputs={"param": "source"}, follows="train", name="...")``
    (`follows`: a node's name, or the node)."""
    followed = follows.name if isinstance(follows, Node) else follows
    if followed is not None and not isinstance(followed, str):
        raise FlowError(f"follows= takes a node or its name (a str), got {follows!r}")

    def make(f: Callable[..., Any]) -> Node:
        if inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f):  # (called, its
            # body would never run: the nodes it feeds would get a generator object)
            raise FlowError(f"node {f.__name__!r} is a generator function (it yields); a "
                            f"node returns its step's value: return it, or collect the "
                            f"items into a list and return that")
        sig = inspect.signature(f)
        mapping = dict(inputs or {})
        unknown = sorted(set(mapping) - set(sig.parameters))
        if unknown:
            raise FlowError(f"node {f.__name__!r}: inputs= names {unknown}, which are not "
                            f"parameters of the function; its parameters are "
                            f"{list(sig.parameters)}")
        params = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise FlowError(f"node {f.__name__!r}: *args/**kwargs cannot name inputs; "
                                f"give every input its own parameter")
            if p.kind is p.POSITIONAL_ONLY:  # (a node's inputs are passed by name)
                raise FlowError(f"node {f.__name__!r}: parameter {p.name!r} is positional-"
                                f"only, but a node's inputs are passed by name; remove the "
                                f"'/' from its parameters")
            optional = p.default is not p.empty
            params.append(Param(p.name, mapping.get(p.name, p.name), optional,
                                 p.default if optional else None))
        return Node(f, name or f.__name__, params, followed)

    return make(fn) if fn is not None else make
