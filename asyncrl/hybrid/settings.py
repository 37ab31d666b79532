"""Settings dataclasses built from the dicts users write (`train=`, `rl=`, `sampling=`,
`model=`): a key the dataclass lacks is named with the nearest known one and the whole
list, where Python's own TypeError names the key alone."""

from __future__ import annotations

import inspect
from dataclasses import fields
from difflib import get_close_matches
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], given: dict[str, Any] | None, what: str) -> T:
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
    them; None for a subclass with an __init__ of its own (its arguments are its own)."""
    if cls.__init__ is not init:  # type: ignore[misc]
        return None
    return dict(inspect.signature(init).bind(None, *args, **kwargs).arguments)
