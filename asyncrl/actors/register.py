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
    if isinstance(fn, str):  # @register(Dispatch.DP) or @register("dp") (a Dispatch is a str)
        said = f"Dispatch.{fn.name}" if isinstance(fn, Dispatch) else repr(fn)
        raise TypeError(f"@register takes the protocol by keyword: write "
                        f"@register(dispatch={said}), not @register({said})")
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


# GroupHandle's public attributes (asyncrl/controller/group.py; not imported: ranks load this
# module): a registered method of one of these names would be shadowed, group.ready the
# handle's future rather than the method (tests/test_dispatch.py checks the list)
GROUP_HANDLE_NAMES = frozenset({
    "agent", "announce_gone", "busy", "call", "closing", "construct_frames", "construct_msg",
    "dead", "dropped_frames", "exited", "fan", "fetches", "layout", "mesh", "methods", "name",
    "nprocs", "pids", "post_all", "ranks", "ready", "started", "stopping", "store_stats",
    "worker_class"})


def check_method_names(cls: type) -> None:
    """Refuse a Worker whose registered method the controller's group handle would shadow."""
    shadowed = sorted(set(registered_methods(cls)) & GROUP_HANDLE_NAMES)
    if shadowed:
        raise TypeError(
            f"{cls.__qualname__} registers {', '.join(map(repr, shadowed))}, also the name of "
            f"a GroupHandle attribute: group.{shadowed[0]} would be the handle's, not a call "
            f"of the method; give the method another name")
