"""A DataFlow's graph, checked before anything launches: each node's parameters resolved to
what provides them, and the order its nodes are dispatched in within a step.

    parameter ──▶ ('node', name)    a node, or `<node>_out` (its output by another name)
              ──▶ ('input', name)   a flow input (one item a step, or a constant)
              ──▶ ('step', 'step')  `step`, when no node or input has that name
              ──▶ None              an optional parameter nothing provides (its default)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from asyncrl.controller.nodes import FlowError, Node, Param

STEP = "step"  # a parameter nothing else provides: the step index (validate every N steps)
Source = tuple[str, str] | None


def named_nodes(nodes: Iterable[Any], inputs: dict[str, Any]) -> dict[str, Node]:
    """The nodes by name: each one a node, no two alike, and no input named as one."""
    out: dict[str, Node] = {}
    for n in nodes:
        if not isinstance(n, Node):
            raise FlowError(f"{n!r} is not a node: decorate it with @asyncrl.node")
        if n.name in out:
            raise FlowError(f"two nodes are named {n.name!r}; rename one with "
                            f"@asyncrl.node(name=...)")
        out[n.name] = n
    if not out:  # (a step would have nothing to run, and failed on an empty wait)
        raise FlowError("this flow has no nodes: DataFlow(nodes=[...]) needs at least one "
                        "@asyncrl.node function to run each step")
    clash = sorted(k for k in inputs if k in out or k.endswith("_out") and k[:-4] in out)
    if clash:  # (a parameter `<node>_out` reads the node's output: the input was unseen)
        raise FlowError(f"{clash} name both a flow input and a node (or its output, "
                        f"`<node>_out`); rename one (the input, say)")
    return out


def count(value: Any, least: int) -> bool:
    """An int (not a bool: True would pass as 1) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def source_of(p: Param, nodes: dict[str, Node], inputs: dict[str, Any]) -> Source:
    s = p.source
    if s in nodes:
        return ("node", s)
    if s.endswith("_out") and s[:-4] in nodes:
        return ("node", s[:-4])
    if s in inputs:
        return ("input", s)
    if s == STEP:
        return ("step", s)
    return None


def resolve(n: Node, nodes: dict[str, Node], inputs: dict[str, Any]) -> dict[str, Source]:
    """Node `n`'s parameters, each by what provides it."""
    out = {}
    for p in n.params:
        src = source_of(p, nodes, inputs)
        if src is None and not p.optional:
            raise FlowError(
                f"node {n.name!r} needs input {p.source!r}, which no node or input "
                f"provides; add a node named {p.source!r}, give the flow an input "
                f"{p.source!r} (DataFlow(inputs=...)), or give the parameter a default")
        out[p.name] = src
    if n.follows is not None and n.follows not in nodes:
        raise FlowError(f"node {n.name!r} follows {n.follows!r}, which is not a node of "
                        f"this flow; nodes: {sorted(nodes)}: name one of them in "
                        f"follows=, or add a node named {n.follows!r}")
    return out


def topological(deps: dict[str, dict[str, Source]]) -> list[str]:
    """The nodes in an order where each comes after the nodes it reads."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise FlowError(f"nodes form a cycle: {' -> '.join(cycle)}; a node cannot "
                            f"depend on itself within a step (use follows= for an edge "
                            f"to the previous step)")
        state[name] = 1
        for src in deps[name].values():
            if src is not None and src[0] == "node":
                visit(src[1], path + [name])
        state[name] = 2
        order.append(name)

    for name in deps:
        visit(name, [])
    return order
