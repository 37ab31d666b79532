"""A user's flow or driver file, loaded for the `asyncrl` command: its key=value
overrides, a resumed run's own settings (those the file no longer declares dropped, said),
and what goes wrong on import said in a line, with where it happened in the file."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import sysconfig
import traceback
from typing import Any, NoReturn

from asyncrl.compat import format_exception
from asyncrl.errors import SettingError


def key_values(command: str, args: list[str]) -> dict[str, str]:
    """The key=value arguments among `args`, as {key: text}."""
    from asyncrl.controller.declare import parse_overrides

    try:
        return parse_overrides([a for a in args if "=" in a])
    except ValueError as e:
        raise SystemExit(f"asyncrl {command}: {e}") from None


def load_flow(path: str, overrides: dict[str, Any] | None = None,
              saved: dict[str, Any] | None = None) -> Any:
    """Import the flow or driver file with `overrides` ({key: text}; parsed values of runs
    before session 13 too) for its asyncrl.config(...); `saved`: those of them a resumed
    run's checkpoint alone gave. Of those, what the file no longer declares (a setting
    renamed or removed since) is dropped, said; what was given now must be declared."""
    try:
        return _import_with(path, overrides or {}, saved or {})
    except SettingError as e:
        raise SystemExit(f"asyncrl: {e}; fix the key=value arguments" + (
            f" (on --resume, the run's own, kept in its checkpoint, count too: "
            f"{json.dumps(saved)})" if saved else "")) from None


def _import_with(path: str, overrides: dict[str, Any], saved: dict[str, Any]) -> Any:
    from asyncrl.comm.refs import _load_file
    from asyncrl.controller import declare
    from asyncrl.controller.declare import OVERRIDES_CHECKED_ENV, OVERRIDES_ENV

    if not os.path.isfile(path):
        raise SystemExit(f"asyncrl: no such file: {path}")
    if importlib.util.spec_from_file_location("flow", path) is None:  # (by its suffix)
        raise SystemExit(f"asyncrl: {path} is not a Python file (.py); give the file that "
                         f"defines the flow or main()")
    # before the import: the flow file reads them with asyncrl.config(...); none given,
    # none left from an earlier load in this process
    os.environ[OVERRIDES_ENV] = json.dumps(overrides)
    os.environ.pop(OVERRIDES_CHECKED_ENV, None)
    declare.settings.clear()  # this file's, for the run's trackers
    calls, loaded, declared = declare.config_calls, set(sys.modules), declare.declared_count()
    declare.pending = set()  # (its config() calls may be several: each declares some)
    try:
        module = _load_file(os.path.abspath(path))
        unknown = sorted(declare.pending - set(declare.settings))
        if any(k not in saved for k in unknown):  # loaded again when given other settings:
            # not kept (the run's own alone: the import stands, see _drop_stale)
            sys.modules.pop(module.__name__, None)
            raise declare.unknown_settings(unknown, declare.settings)
    except SettingError:  # the command line's mistake, not the file's: load_flow says so
        declare.forget_declared_after(declared)  # (a later load imports it anew: its groups)
        raise
    except SyntaxError as e:
        where = f"{e.filename}:{e.lineno}" + (f":{e.offset}" if e.offset else "")
        code = f"\n    {e.text.rstrip()}" if e.text else ""
        broken = path if e.filename is None or os.path.abspath(e.filename) == \
            os.path.abspath(path) else f"{e.filename} (imported by {path})"
        raise SystemExit(f"asyncrl: {broken} is not valid Python: {e.msg} at {where}{code}\n"
                         f"fix the file and launch again") from None
    except Exception as e:  # noqa: BLE001 - user code: say where it failed and what
        given = " ".join(f"{k}={v}" for k, v in overrides.items())
        # SystemExit prints its message alone, never its cause: the traceback goes in it
        whole = format_exception(e) if os.environ.get(
            "ASYNCRL_TRACEBACK") else ""
        raise SystemExit(f"{whole}asyncrl: importing {path} failed at {_user_line(e, path)}: "
                         f"{type(e).__name__}: {e}\n"
                         + ("install the missing module or fix the import"
                            if isinstance(e, ImportError) else "fix the flow file" +
                            (f" or its settings ({given})" if overrides else "")) +
                         " and launch again" + ("" if whole else
                                                " (set ASYNCRL_TRACEBACK=1 for the whole "
                                                "traceback)")) from None
    finally:
        declare.pending = None
    os.environ[OVERRIDES_CHECKED_ENV] = "1"  # (the ranks' imports take them as checked)
    if overrides and module.__name__ not in loaded and declare.config_calls == calls:
        now = [k for k in overrides if k not in saved]
        if now:
            _refuse_settings(path, module, {k: overrides[k] for k in now})
        unknown = sorted(overrides)  # the run's own alone: the file declares none any more
    if unknown:
        _drop_stale(path, unknown, overrides)
    return module


def _drop_stale(path: str, stale: list[str], overrides: dict[str, Any]) -> None:
    """Say that the run's settings `stale`, kept in its checkpoint, are no settings of the
    file any more, and leave them out of what the ranks and the next checkpoint take. The
    import stands: importing it again would leave out the groups and settings of modules
    it imports (cached, not run again), and its config() calls already skipped them."""
    from asyncrl.controller.declare import OVERRIDES_ENV

    print(f"asyncrl: the run's setting(s) {stale}, kept in its checkpoint, are not settings "
          f"of {path} any more: dropped", file=sys.stderr)
    os.environ[OVERRIDES_ENV] = json.dumps(
        {k: v for k, v in overrides.items() if k not in stale})


def _refuse_settings(path: str, module: Any, now: dict[str, Any]) -> NoReturn:
    """Settings given now to a file that never calls asyncrl.config(...): they would be
    ignored, so refused, saying where they belong."""
    given = " ".join(f"{k}={v}" for k, v in now.items())
    driver = callable(getattr(module, "main", None))  # its own arguments: after --
    raise SystemExit(f"asyncrl: {path} takes no settings (it never calls "
                     f"asyncrl.config(...)), so {given} would be ignored; " +
                     (f"arguments for its main() go after --: asyncrl launch {path} -- "
                      f"{given}" if driver else
                      "declare them there, e.g. cfg = asyncrl.config(lr=1e-3), or drop "
                      "them"))


def _user_line(error: BaseException, path: str) -> str:
    """file:line of the deepest frame of the user's code in a traceback: the flow file's, or
    of a module of theirs it imported or called (with the flow file's line that did); not
    asyncrl's, the stdlib's or site-packages'. None of theirs: the deepest of any file."""
    frames = traceback.extract_tb(error.__traceback__)
    flow = os.path.abspath(path)
    mine = [i for i, f in enumerate(frames) if os.path.abspath(f.filename) == flow]
    user = [i for i, f in enumerate(frames)
            if os.path.abspath(f.filename) == flow or not _library(f.filename)]
    if not frames:
        return path
    deepest = (user or [len(frames) - 1])[-1]
    where = f"{frames[deepest].filename}:{frames[deepest].lineno}"
    if mine and deepest > mine[-1]:  # in a module of theirs: the flow file's line too
        by = frames[mine[-1]]
        how = "imported by" if frames[mine[-1] + 1].name == "<module>" else "called from"
        where += f" ({how} {by.filename}:{by.lineno})"
    return where


def _library(filename: str) -> bool:
    """Whether a traceback's file is asyncrl's, the stdlib's or an installed package's
    (frozen importlib's too): not where a user looks for their mistake."""
    if filename.startswith("<"):
        return True
    file = os.path.abspath(filename)
    paths = sysconfig.get_paths()
    roots = {os.path.dirname(os.path.abspath(__file__))} | {  # (asyncrl's own folder)
        os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(file.startswith(root + os.sep) for root in roots) or bool(
        {"site-packages", "dist-packages"} & set(file.split(os.sep)))


def flow_of(module: Any, path: str) -> Any:
    from asyncrl.controller.flow import DataFlow

    flow = getattr(module, "flow", None)
    if flow is not None and not isinstance(flow, DataFlow):
        raise SystemExit(f"asyncrl: {path} defines `flow`, but it is a "
                         f"{type(flow).__name__}, not an asyncrl.DataFlow")
    return flow
