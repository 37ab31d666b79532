"""Classes and functions travel as references: ``module:qualname`` plus the defining file.

The file lets a class defined in a driver script or a test file import on the ranks, where
that module is not on ``sys.path`` (or where ``__main__`` is a different program). Only the
controller's commands may have a file run (`load=True`); a value from a peer (a rank's
result, a pulled batch, a saved inputs file) finds its file among the modules loaded here:
one holder of the run's secret could else have any .py on the receiver's disk run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from typing import Any

_SCRIPT_PREFIX = "__asyncrl_file_"


def is_referable(obj: Any) -> bool:
    return isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))


def make_ref(obj: Any) -> tuple[str, str, str]:
    """(module, qualname, file) for an importable class or function, else TypeError."""
    if isinstance(obj, types.BuiltinFunctionType):
        return _builtin_ref(obj)
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if "<lambda>" in qualname:
        raise TypeError("a lambda cannot be sent; define a module-level function instead")
    if "<locals>" in qualname or module is None:
        raise TypeError(f"{qualname!r} is defined inside a function and cannot be imported on "
                        f"the ranks; define it at module level")
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None) or ""
    if module == "__main__" and not file:  # (a rank's __main__ is another program: on it,
        # "__main__:main" was asyncrl's own main, and anything else an AttributeError)
        raise TypeError(f"{qualname!r} is defined in an interactive session (a notebook, "
                        f"python -c, stdin), which the ranks cannot import; define it in a "
                        f".py file and import it from there")
    return module, qualname, os.path.abspath(file) if file else ""


def _builtin_ref(fn: types.BuiltinFunctionType) -> tuple[str, str, str]:
    """A builtin by its module and name: its qualname may name a class it is not reached
    through (torch.mean's is "_VariableFunctionsClass.mean"). Refused unless that leads back
    to it (a bound method: random.random is a method of a hidden Random instance)."""
    module = fn.__module__ or ""
    if getattr(sys.modules.get(module), fn.__name__, None) is not fn:
        raise TypeError(f"{fn!r} cannot be sent: a builtin travels by its module and name, "
                        f"which do not lead back to it (a bound method's never do); send a "
                        f"module-level function (def) that calls it")
    file = getattr(sys.modules[module], "__file__", None) or ""
    return module, fn.__name__, os.path.abspath(file) if file else ""


def function_ref(fn: Any, what: str) -> tuple[str, str, str]:
    """`make_ref` for a function another process imports and calls: refused unless the
    reference leads back to `fn` here (a functools.partial or a callable instance has
    none: it failed at its first call; a bound method's is its plain function: `self`
    went unbound)."""
    ref = make_ref(fn)
    try:
        found = resolve_ref(*ref, load=False)
    except (ImportError, AttributeError, TypeError):
        found = None
    if found is not fn:
        raise TypeError(f"{what} {fn!r} cannot run in child processes: they import it by its "
                        f"module and name, and a functools.partial, a callable instance or "
                        f"a bound method does not import as itself; pass a module-level "
                        f"function (def) that makes the call")
    return ref


def resolve_ref(module: str, qualname: str, file: str, load: bool = True) -> Any:
    """Import what `make_ref` described, loading it from `file` if the module name alone
    does not lead to that file here (load=False, a peer's value: only a module imported
    here already, and only a class or function in it)."""
    mod = _module_for(module, file, load)
    obj: Any = mod
    for part in qualname.split("."):
        # a peer's value: what is there, read plainly (a module's __getattr__ imports a
        # submodule, a descriptor runs code)
        obj = getattr(obj, part) if load else _attribute(obj, part, module, qualname)
    if not load and not is_referable(obj):  # (os.environ, a module's live state)
        raise TypeError(f"a value from a peer names {module}:{qualname}, a "
                        f"{type(obj).__name__}: only classes and functions travel by name")
    return obj


def _attribute(obj: Any, name: str, module: str, qualname: str) -> Any:
    try:
        found = inspect.getattr_static(obj, name)
        return found.__func__ if isinstance(found, staticmethod) else found
    except AttributeError:
        raise ImportError(f"a value from a peer names {module}:{qualname}, which is not "
                          f"there without importing more (values from peers never run a "
                          f"file or an import): import it before the value comes") from None


def _same_file(mod: types.ModuleType, file: str) -> bool:
    mine = getattr(mod, "__file__", None)
    return not file or (mine is not None and os.path.realpath(mine) == os.path.realpath(file))


def _module_for(module: str, file: str, load: bool = True) -> types.ModuleType:
    mod = sys.modules.get(module)
    if mod is not None and _same_file(mod, file):
        return mod
    loaded = _loaded(file) if file and not load else None
    if loaded is not None:  # (before an import by name: its folder may be on sys.path now)
        return loaded
    if module != "__main__" and mod is None and not load:  # (an import runs its code)
        raise ImportError(f"a value from a peer names module {module!r}, which is not "
                          f"imported here, and values from peers never run a file or an "
                          f"import: import that module before the value comes")
    if module != "__main__" and mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if not file:
                raise
        if mod is not None and _same_file(mod, file):
            return mod
    if not file:
        raise ImportError(f"cannot import module {module!r} and no file was given for it")
    if not load:
        raise ImportError(f"a value from a peer names {module!r} of {file}, which is not "
                          f"loaded here, and values from peers never run a file: import "
                          f"that module before the value comes")
    return _load_file(file)


def _loaded(file: str) -> types.ModuleType | None:
    """The module loaded from `file` here, if one is."""
    path = os.path.realpath(file)
    mod = sys.modules.get(_script_name(path))
    if mod is None:  # (under another name: a flow file the launcher ran, a test module)
        mod = next((m for m in list(sys.modules.values())
                    if os.path.realpath(getattr(m, "__file__", None) or "/") == path), None)
    return mod


def _script_name(path: str) -> str:
    """The private module name a script loaded by path gets (one per real path)."""
    return _SCRIPT_PREFIX + hashlib.sha1(path.encode()).hexdigest()[:12]


def _load_file(file: str) -> types.ModuleType:
    """Load a script by path once, under a private name (so its `__main__` guard stays off)."""
    path = os.path.realpath(file)
    name = _script_name(path)
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:  # as when the file runs as a script: its siblings import
        sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file} as a Python module")
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException:  # (a file that did not load leaves no module and the path as it was)
        sys.modules.pop(name, None)
        if added and folder in sys.path:
            sys.path.remove(folder)
        raise
    return mod
