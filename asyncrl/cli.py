"""The `asyncrl` command: parse, build, run, close.

    asyncrl launch script.py [args...]   run the script's `main()` (async or not)
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Any

from asyncrl.controller.runner import run


def _load_script(path: str) -> Any:
    from asyncrl.comm.refs import _load_file

    if not os.path.isfile(path):
        raise SystemExit(f"asyncrl launch: no such file: {path}")
    return _load_file(os.path.abspath(path))


def launch(args: argparse.Namespace) -> int:
    sys.argv = [args.script, *args.args]
    module = _load_script(args.script)
    main = getattr(module, "main", None)
    if main is None:
        raise SystemExit(f"asyncrl launch: {args.script} defines no main(); write "
                         f"`async def main():` that opens `async with asyncrl.Controller()`")
    result = run(main()) if inspect.iscoroutinefunction(main) else main()
    return int(result) if isinstance(result, int) else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description=(
        "asyncrl: RL post-training on an asyncio single controller with torchrun worker "
        "groups, no Ray."))
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("launch", help="run a driver script's main()",
                        description="Run SCRIPT's `main()` (an `async def` runs on uvloop).")
    lp.add_argument("script", help="a Python file defining main()")
    lp.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    lp.set_defaults(func=launch)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("asyncrl: interrupted; every group was shut down", file=sys.stderr)
        return 130
