"""Settings dataclasses built from the dicts users write (`train=`, `rl=`, `sampling=`,
`model=`): a key the dataclass lacks is named with the nearest known one and the whole
list, where Python's own TypeError names the key alone."""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import fields
from difflib import get_close_matches
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], given: dict[str, Any] | None, what: str) -> T:
    if given is not None and not isinstance(given, dict):  # (a config object, say)
        raise TypeError(f"{what} takes a dict of {cls.__name__}'s settings (they go to the "
                        f"ranks as data), got a {type(given).__name__}; pass the dict, or "
                        f"dataclasses.asdict() of it")
    given = dict(given or {})
    known = sorted(f.name for f in fields(cls) if f.init)  # type: ignore[arg-type]
    unknown = [k for k in given if k not in known]
    if unknown:
        near = [f"{k!r} (did you mean {close[0]!r}?)" if (close := get_close_matches(
            str(k), known, 1)) else repr(k) for k in unknown]
        verb = "is not a setting" if len(near) == 1 else "are not settings"
        raise TypeError(f"{what}: {', '.join(near)} {verb}; the settings are {known}")
    return cls(**given)


def own_arguments(cls: type, init: Any, args: tuple, kwargs: dict[str, Any]
                  ) -> dict[str, Any] | None:
    """A role's constructor arguments by name, as `init` (the role's own __init__) takes
    them, its defaults filled in; None for a subclass with an __init__ of its own (its
    arguments are its own)."""
    if cls.__init__ is not init:  # type: ignore[misc]
        return None
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def whole_number(x: Any) -> bool:
    """An int of Python's or numpy's (a tokenizer's ids may be numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# a declared kind: what a value must be (said), and the test (numpy's numbers pass too)
KINDS = {"bool": ("True or False", lambda v: isinstance(v, bool)),
         "str": ("a string", lambda v: isinstance(v, str)),
         "int": ("a whole number", whole_number),
         "float": ("a finite number", _finite)}


def check_kinds(settings: Any, what: str) -> None:
    """Each field of a settings dataclass declared bool, str, int or float (or `X | None`)
    holds one: a NaN coefficient or learning rate would spoil every step, "no" is a true
    flag, 2.5 micro-batches fail deep in torch. Other kinds are the class's own to check."""
    for f in fields(settings):
        kind, value = str(f.type), getattr(settings, f.name)
        optional = kind.endswith("| None")
        said, ok = KINDS.get(kind.split(" |")[0], ("", None))
        if ok is None or (value is None and optional) or ok(value):
            continue
        raise ValueError(f"{what}.{f.name} must be {said}{' (or None)' if optional else ''}, "
                         f"got {value!r}")
