"""What a flow file declares at module level: groups and config. Declaring does nothing:
a flow file is imported on every rank too (to find its worker classes)."""

from __future__ import annotations

import contextlib
import dis
import inspect
import json
import math
import os
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import PurePath
from typing import Any

from asyncrl.actors.worker import Worker
from asyncrl.controller.group import GroupHandle
from asyncrl.controller.placement import check_nice
from asyncrl.errors import SettingError

OVERRIDES_ENV = "ASYNCRL_OVERRIDES"  # key=value pairs from `asyncrl launch`, as JSON
# "1": the launcher found each of them declared by one of the flow's config() calls (a rank
# importing the file takes, in each call, those it declares)
OVERRIDES_CHECKED_ENV = "ASYNCRL_OVERRIDES_CHECKED"


class GroupSpec:
    """A group declared with `asyncrl.group(...)`. While its flow runs, calling a method on it
    calls the spawned group; outside a run it says so."""

    def __init__(self, worker_cls: type, args: tuple, kwargs: dict[str, Any], nprocs: int,
                 mesh: dict[str, int] | None, place: Any, name: str | None,
                 env: dict[str, str] | None, module: str, max_restarts: int = 0,
                 restart_backoff: float = 1.0, nice: int = 0):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"asyncrl.group() needs a subclass of asyncrl.Worker (the class, "
                            f"not an instance), got {worker_cls!r}")
        check_runtime_keywords(worker_cls, "asyncrl.group()", max_restarts=max_restarts,
                               restart_backoff=restart_backoff, nice=nice,
                               relay=kwargs.get("relay"))  # (spawn() takes it from kwargs)
        self.worker_cls, self.args, self.kwargs = worker_cls, args, kwargs
        self.nprocs, self.mesh, self.place, self.env = nprocs, mesh, place, env
        self.name = name or worker_cls.__name__.lower()
        self.module = module
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"group {self.name!r}: max_restarts must be an int >= 0, got "
                             f"{max_restarts!r}")
        if not isinstance(restart_backoff, int | float) or restart_backoff < 0:
            raise ValueError(f"group {self.name!r}: restart_backoff must be a number of "
                             f"seconds >= 0, got {restart_backoff!r}")
        self.max_restarts, self.restart_backoff = max_restarts, float(restart_backoff)
        self.nice = check_nice(self.name, nice)
        self.handle: GroupHandle | None = None

    @property
    def stateful(self) -> bool:
        """Its workers keep state a checkpoint saves (they override `save_state`): after a
        death the flow goes back to a checkpoint rather than re-running one node."""
        from asyncrl.actors.worker import Worker

        return getattr(self.worker_cls, "save_state", None) is not Worker.save_state

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        handle = self.__dict__.get("handle")
        if handle is None:
            raise RuntimeError(f"group {self.name!r} is not running: call its methods inside a "
                               f"node while its DataFlow runs (asyncrl launch, or flow.run()); "
                               f"a DataFlow runs the groups declared in its nodes' modules or "
                               f"named by its nodes (others: DataFlow(groups=[...]))")
        return getattr(handle, method)

    def __repr__(self) -> str:
        state = "running" if self.handle is not None else "declared"
        return f"<group {self.name!r} {self.worker_cls.__name__} x{self.nprocs} {state}>"


_declared: list[GroupSpec] = []

# keywords group() and spawn() take for the runtime beyond the documented nprocs, name,
# mesh, place and env, with their defaults
RUNTIME_KEYWORDS: dict[str, Any] = {"relay": None, "nice": 0, "max_restarts": 0,
                                    "restart_backoff": 1.0}


def init_params(cls: type) -> list[str]:
    """The parameter names of ``cls(...)`` (none where it has no signature)."""
    try:
        return list(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return []


def check_runtime_keywords(cls: type, call: str, **given: Any) -> None:
    """Refuse a runtime keyword given a value when `cls.__init__` has a parameter of that
    name: the runtime takes it, and the worker would silently get its own default."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return
    for key, value in given.items():
        param = params.get(key)
        if param is None or value == RUNTIME_KEYWORDS[key]:
            continue
        fix = "rename that parameter" if param.kind is param.KEYWORD_ONLY else \
            f"pass the worker's {key} positionally, or rename that parameter"
        raise TypeError(f"{call}: {key}={value!r} is taken by the runtime, but "
                        f"{cls.__qualname__}.__init__ also has a parameter {key!r}, which "
                        f"would not get it; {fix}")


def check_spawn_keywords(cls: type, kwargs: dict[str, Any]) -> None:
    """Refuse `spawn(max_restarts=...)` (or restart_backoff=) to a worker that does not take
    it: restarts are a DataFlow's (recovery.py), not spawn()'s, and every rank would get it
    in ``cls(...)`` (a TypeError after the launch, or kept unused by a **kwargs worker)."""
    params = init_params(cls)
    for key in ("max_restarts", "restart_backoff"):
        if key in kwargs and key not in params:
            raise TypeError(f"spawn(): {key}={kwargs[key]!r}: {cls.__qualname__}.__init__ has "
                            f"no parameter {key!r}, and spawn() does not restart a group: "
                            f"restarts are a DataFlow's; declare the group with asyncrl.group("
                            f"{cls.__qualname__}, {key}=...) and run it in a DataFlow, or "
                            f"leave {key} out")


def group(worker_cls: type, *args: Any, nprocs: int = 1, mesh: dict[str, int] | None = None,
          place: Any = None, name: str | None = None, env: dict[str, str] | None = None,
          max_restarts: int = 0, restart_backoff: float = 1.0, nice: int = 0,
          **kwargs: Any) -> GroupSpec:
    """Declare a worker group in a flow file; the launcher spawns it when the flow runs.

    `max_restarts`: how often the group may be respawned after a rank dies or hangs over the
    run (see asyncrl/controller/recovery.py), waiting `restart_backoff` s, doubled each time.
    `nice` (0-19): a lower CPU priority for its ranks (see placement.check_nice)."""
    frame = inspect.currentframe()
    module = frame.f_back.f_globals.get("__name__", "") if frame and frame.f_back else ""
    spec = GroupSpec(worker_cls, args, kwargs, nprocs, mesh, place, name, env, module,
                     max_restarts, restart_backoff, nice)
    # a role's settings checked now, before any group starts (asyncrl.hybrid.roles); only a
    # classmethod of that name: a worker's own method called so is not this hook. Without
    # relay=, left in kwargs for spawn(): the runtime's, not a setting of the role
    if isinstance(inspect.getattr_static(worker_cls, "check_settings", None), classmethod):
        own = {k: v for k, v in kwargs.items() if k not in RUNTIME_KEYWORDS}
        getattr(worker_cls, "check_settings")(*args, **own)  # noqa: B009
    _declared.append(spec)
    return spec


def declared_for(fns: Iterable[Callable[..., Any]]) -> list[GroupSpec]:
    """The groups a flow of nodes `fns` runs: those declared in the nodes' modules, and
    those the nodes name from elsewhere (`from roles import actor`, `roles.actor`, a
    closure's), in the order they were declared."""
    modules: set[str] = set()
    named: set[int] = set()
    for fn in fns:
        fn = inspect.unwrap(fn)
        modules.add(fn.__module__)
        named.update(id(v) for v in _named_by(fn))
    return [g for g in _declared if g.module in modules or id(g) in named]


def _named_by(fn: Callable[..., Any]) -> Iterator[Any]:
    """The objects a function's code names: its globals, a global module's attributes it
    reads (`roles.actor`: a LOAD_ATTR right after loading the module, read from the
    module's dict: no lazy import), and its closure's cells; with the code of functions
    defined inside it."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    scope = getattr(fn, "__globals__", {})
    codes = [code]
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        module = None
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                value = scope.get(ins.argval)
                yield value
                module = value if isinstance(value, types.ModuleType) else None
                continue
            if module is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                yield vars(module).get(ins.argval)
            module = None
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # (an empty cell)
            yield cell.cell_contents


def declared_count() -> int:
    """How many groups were declared so far (`forget_declared_after` goes back to it)."""
    return len(_declared)


def forget_declared_after(count: int) -> None:
    """Forget the groups declared after the first `count`: a flow file whose import failed,
    imported again, declares its groups again."""
    del _declared[count:]


config_calls = 0  # how often a flow file asked for its settings (overrides need one)
settings: dict[str, Any] = {}  # what config() gave this process, for the run's trackers
# while the launcher imports a flow file: keys a config() call did not declare (another
# call of the file may; checked once the file is imported: flow_file.py)
pending: set[str] | None = None


def unknown_settings(unknown: list[str], declared: Iterable[str]) -> SettingError:
    return SettingError(f"unknown setting(s) {unknown} on the command line; this flow's "
                        f"settings are {sorted(declared)}", unknown)


def config(**defaults: Any) -> dict[str, Any]:
    """The flow's settings: `defaults`, with `key=value` overrides from `asyncrl launch`
    applied (the same on the controller and on every rank, which inherit the environment).
    Values are parsed as JSON when they parse (numbers, true/false, lists), else strings,
    then taken as their default's type: True/False and None as Python writes them too, and
    a value of another type is refused (the string "False" would have been true)."""
    global config_calls
    config_calls += 1
    overrides = json.loads(os.environ.get(OVERRIDES_ENV, "{}"))
    unknown = sorted(set(overrides) - set(defaults))
    if unknown and pending is not None:
        pending.update(unknown)
    elif unknown and os.environ.get(OVERRIDES_CHECKED_ENV) != "1":
        raise unknown_settings(unknown, defaults)
    given = {**defaults, **{k: _as_default(k, v, defaults[k]) for k, v in overrides.items()
                            if k in defaults}}
    settings.update(given)
    return given


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _as_default(key: str, value: Any, default: Any) -> Any:
    """Override `value` of setting `key` (its text from the command line; a parsed value in
    the overrides.json of runs before session 13) as the type of its default."""
    if value in ("None", "null", None):  # (None: a parsed null of an old overrides.json)
        return None
    if isinstance(default, str):  # the text as given: 1.10 stays "1.10"
        return value if isinstance(value, str) else json.dumps(value)
    if default is None and value in ("True", "False"):  # as Python writes them
        return value == "True"
    text = value
    if isinstance(value, str):
        try:
            value = json.loads(value)  # numbers, true/false, lists
        except json.JSONDecodeError:
            pass
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif isinstance(default, int | float):  # a number stays a number: 0 may stand for 0.5
        if isinstance(value, str):
            for number in (int, float):
                try:
                    value = number(value)  # .5, 5., +1, 1_000
                    break
                except ValueError:
                    pass
        if isinstance(value, int | float) and not isinstance(value, bool) and (
                isinstance(default, float) or math.isfinite(value)):
            if isinstance(default, float):
                return float(value)
            # an int's: 1e3 is 1000, not 1000.0 (a range() refuses that deep in a rank)
            return int(value) if isinstance(value, float) and value.is_integer() else value
    elif isinstance(default, list | tuple | dict):
        if isinstance(value, list | dict) and isinstance(default, dict) == isinstance(value, dict):
            return type(default)(value)
    elif isinstance(default, PurePath) and isinstance(text, str):  # a Path's: a Path
        return type(default)(text)
    else:  # another type's (a set, a torch dtype, an Enum): the value as given, as before
        return value
    hint = " (true/false)" if isinstance(default, bool) else ""
    if value == "":
        hint = " (nothing after '=': write key=value with no space around '=')"
    elif isinstance(default, list | tuple | dict) and isinstance(value, str) and \
            value[:1] in "[{":  # the shell took the JSON's quotes
        hint = (f" (a list or dict is JSON: quote it for the shell, e.g. "
                f"'{key}=[\"a\", \"b\"]')")
    raise SettingError(f"setting {key}={value!r} on the command line: expected a "
                       f"{type(default).__name__}, as its default {default!r} is{hint}")


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """key=value pairs as {key: text}: `config()` reads each as its default's type."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"override {pair!r} is not key=value; write overrides as "
                             f"key=value, with no space around '='")
        if key.startswith("-"):
            raise ValueError(f"{pair!r} is not an option of the command (see --help), nor a "
                             f"setting; arguments for a driver's main() go after '--'")
        if key in out:
            raise ValueError(f"setting {key} is given twice ({key}={out[key]} and {pair})")
        out[key] = raw
    return out
