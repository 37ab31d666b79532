"""@register: marks a Worker method as callable from the controller, with its protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asyncrl.actors.protocols import Dispatch, protocol_name
from asyncrl.comm.messages import MethodSpec

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__asyncrl_method__"


def register(fn: F | None = None, *, dispatch: Dispatch | str = Dispatch.ONE_TO_ALL,
             concurrent: bool = False) -> Any:
    """``@register`` (ONE_TO_ALL) or ``@register(dispatch=Dispatch.DP, concurrent=False)``.

    `concurrent=True` lets the method run beside the group's in-order calls (for work without
    collectives, such as loading weights while generating)."""
    spec = MethodSpec(dispatch=protocol_name(dispatch), concurrent=concurrent)

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@register decorates methods, got {f!r}")
        setattr(f, _ATTR, spec)
        return f

    return mark(fn) if fn is not None else mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every method of `cls` (and its bases) marked with @register."""
    out: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, _ATTR, None)
            if isinstance(spec, MethodSpec):
                out[name] = spec
            elif name in out:  # overridden without @register: no longer callable remotely
                del out[name]
    return out
