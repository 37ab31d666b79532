"""Python 3.10 support (issue 2: Python >= 3.10): asyncrl.compat's 3.10 paths, run here on
3.11 with the version it sees set back, and no 3.11-only API used outside it (CI runs 3.11
alone: this is what keeps 3.10 working between the full runs on 3.10 the README records)."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import io
import os
import signal
import sys
import types
from pathlib import Path

import pytest
import uvloop

from asyncrl import compat
from asyncrl.controller import runner

PACKAGE = Path(compat.__file__).parent


@pytest.fixture
def on_310(monkeypatch):
    """compat sees 3.10, and 3.10's traceback module, which prints no notes."""
    monkeypatch.setattr(compat, "sys", types.SimpleNamespace(
        version_info=(3, 10, 13), excepthook=sys.__excepthook__,
        __excepthook__=sys.__excepthook__, stderr=io.StringIO()))
    monkeypatch.setattr(compat, "traceback", types.SimpleNamespace(
        format_exception=lambda kind, e, tb, chain: [f"{kind.__name__}: {e}\n"]))
    return compat.sys


def test_notes_are_kept_and_printed_as_311_keeps_and_prints_them(on_310):
    error = ValueError("boom")
    compat.add_note(error, "first")
    compat.add_note(error, "second")
    assert error.__notes__ == ["first", "second"]
    assert compat.format_exception(error) == "ValueError: boom\nfirst\nsecond\n"


def test_each_error_of_a_chain_is_printed_with_its_own_notes(on_310):
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            compat.add_note(inner, "the inner's note")
            raise ValueError("outer") from inner
    except ValueError as outer:
        compat.add_note(outer, "the outer's note")
        error = outer
    assert compat.format_exception(error) == (
        "KeyError: 'inner'\nthe inner's note\n\nThe above exception was the direct cause of "
        "the following exception:\n\nValueError: outer\nthe outer's note\n")


def test_an_uncaught_error_is_printed_with_its_notes(on_310):
    compat.print_notes_on_310()
    error = RuntimeError("rank 0 raised")
    compat.add_note(error, "then group 'rollout': rank 3 is dead")
    on_310.excepthook(RuntimeError, error, None)
    assert on_310.stderr.getvalue() == (
        "RuntimeError: rank 0 raised\nthen group 'rollout': rank 3 is dead\n")


def test_a_task_made_in_a_context_sees_its_values(on_310):
    var = contextvars.ContextVar("var", default="unset")

    async def main():
        var.set("the caller's")
        context = contextvars.copy_context()
        var.set("later")
        seen = await compat.create_task(asyncio.get_running_loop(), _read(var), context)
        fresh = await compat.create_task(asyncio.get_running_loop(), _read(var),
                                         contextvars.Context())
        return seen, fresh
    assert asyncio.run(main()) == ("the caller's", "unset")


async def _read(var: contextvars.ContextVar) -> str:
    return var.get()


def test_a_task_cancelled_is_told_from_one_handed_a_cancel_by_what_it_awaited(on_310):
    """flow.py's test: a node's own cancel (a step's) is raised on; a CancelledError from a
    task the node awaited is the node's failure."""
    async def main():
        async def sleeper():
            await asyncio.sleep(60)
        async def awaits(inner):
            try:
                await inner
            except asyncio.CancelledError:
                return compat.cancelling(asyncio.current_task())
        loop = asyncio.get_running_loop()
        inner = loop.create_task(sleeper())
        outer = loop.create_task(awaits(inner))
        await asyncio.sleep(0)
        inner.cancel()  # the awaited task's cancel, not the node's
        handed = await outer
        own = loop.create_task(sleeper())
        await asyncio.sleep(0)
        compat.cancel(own)
        with pytest.raises(asyncio.CancelledError):
            await own
        return handed, compat.cancelling(own)
    assert asyncio.run(main()) == (False, True)


# what 3.11 added that an asyncrl module could reach for; compat.py holds the 3.10 paths
_METHODS = {"add_note", "cancelling", "uncancel"}
_MODULE_NAMES = {
    "asyncio": {"TaskGroup", "Runner", "timeout", "timeout_at", "Barrier"},
    "typing": {"Self", "Never", "LiteralString", "assert_never", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform"},
    "sys": {"exception"}, "datetime": {"UTC"}, "enum": {"StrEnum"}, "contextlib": {"chdir"},
    "hashlib": {"file_digest"}}
_NAMES = {"ExceptionGroup", "BaseExceptionGroup"}
_MODULES = {"tomllib", "wsgiref.types"}


def _uses_of_311(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in _METHODS or isinstance(
                node.value, ast.Name) and node.attr in _MODULE_NAMES.get(node.value.id, ())):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in _NAMES:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name in _MODULES]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"import {node.module}")] if node.module in _MODULES else []
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if a.name in _MODULE_NAMES.get(node.module or "", ())]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "create_task" and any(k.arg == "context" for k in
                                                        node.keywords):
            found.append((node.lineno, "create_task(context=)"))
        elif type(node).__name__ == "TryStar":
            found.append((node.lineno, "except*"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_module_but_compat_uses_what_python_311_added():
    used = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
            if path.name != "compat.py" and (found := _uses_of_311(ast.parse(
                path.read_text(), str(path))))}
    assert not used, f"3.11-only APIs (use asyncrl.compat's, for Python 3.10): {used}"


def test_the_check_finds_what_it_looks_for():
    source = ("import tomllib\nfrom typing import Self, Any\ne.add_note('x')\nt.cancelling()\n"
              "loop.create_task(c, context=ctx)\nasync def f():\n async with asyncio.timeout(1):"
              "\n  pass\nsys.exception()\nresult.exception()\nraise ExceptionGroup('', [])\n")
    assert [f.split(": ")[1] for f in _uses_of_311(ast.parse(source))] == [
        "import tomllib", "typing.Self", ".add_note", ".cancelling", "create_task(context=)",
        ".timeout", ".exception", "ExceptionGroup"]


@pytest.fixture
def ctrl_c():
    """SIGINT as a terminal's Ctrl-C gives it (a run in the background, CI's, ignores it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _press_ctrl_c(after: float = 0.01) -> None:
    """A Ctrl-C from outside, as the loop waits (not from the driver's own frame)."""
    asyncio.get_running_loop().call_later(after, os.kill, os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_ctrl_c_cancels_the_driver_and_a_second_one_raises_as_on_311(new_loop, ctrl_c):
    """3.10's asyncio.run raised KeyboardInterrupt wherever the loop was and then cancelled
    every task, nodes (misreported as failed) and a closing controller's work included;
    runner._until_interrupt does what 3.11's does (which sets its own handler: here a loop
    run without asyncio.run, as on 3.10)."""
    async def driver(log: list, presses: int):
        try:
            _press_ctrl_c()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            log.append("cancelled")
            if presses == 2:
                _press_ctrl_c()
            # its cleanup (a flow closing its groups); a second Ctrl-C lands within it
            await asyncio.sleep(0.2 if presses == 1 else 30)
            log.append("cleaned up")
            raise

    for presses, logged in ((1, ["cancelled", "cleaned up"]), (2, ["cancelled"])):
        loop, log = new_loop(), []
        try:
            with pytest.raises(KeyboardInterrupt):
                loop.run_until_complete(runner._until_interrupt(driver(log, presses)))
            assert log == logged
            left = asyncio.all_tasks(loop)  # the driver a second Ctrl-C left in its cleanup
            assert len(left) == presses - 1
            for task in left:  # cancelled by asyncio.run next: no KeyboardInterrupt again
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    loop.run_until_complete(task)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        finally:
            loop.close()


def test_a_driver_s_own_ctrl_c_handler_is_left_to_it(ctrl_c):
    """The loop's signal handler (3.10's add_signal_handler) ran over a driver's own
    SIGINT handler, and reset it after."""
    async def driver(said: list):
        stop = asyncio.Event()

        def own(signum, frame):
            said.append("stop gracefully")
            asyncio.get_running_loop().call_soon_threadsafe(stop.set)
        signal.signal(signal.SIGINT, own)
        _press_ctrl_c()
        await stop.wait()
        return "stopped"

    loop, said = asyncio.new_event_loop(), []
    try:
        assert loop.run_until_complete(runner._until_interrupt(driver(said))) == "stopped"
        assert said == ["stop gracefully"]
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # its own
    finally:
        loop.close()
