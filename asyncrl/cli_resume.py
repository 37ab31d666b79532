"""`asyncrl launch FLOW --resume` without --run-dir: the run to continue, found under runs/
(where launches without --run-dir go, see launch.default_run_dir)."""

from __future__ import annotations

import ast
import math
import os
import sys
from pathlib import Path

RUNS = Path("runs")


def run_to_resume(script: str, root: Path = RUNS) -> Path:
    """The run folder under `root` whose newest complete checkpoint is of `script` and the
    newest such, said (and any newer run not looked into); none: SystemExit asking for
    --run-dir."""
    if not os.path.isfile(script):
        raise SystemExit(f"asyncrl: no such file: {script}")
    name = os.path.basename(script)
    if _driver(script):  # (asked for a --run-dir it would then refuse)
        raise SystemExit(f"asyncrl launch: --resume continues the run of a flow file's `flow`; "
                         f"{name} defines main() (a driver), which makes its own Controller: "
                         f"resume in main(), from the checkpoints it saves")
    found, refused, elsewhere = newest_run_of(script, root)
    if found is None:
        raise SystemExit(f"asyncrl launch: --resume needs --run-dir DIR, the run to continue "
                         f"(its checkpoints are in DIR/checkpoints): no run under {root}/ "
                         f"holds a complete checkpoint of {name}"
                         f"{_passed_over(refused, elsewhere)}")
    run, step = found
    newest = "the newest run"
    if refused:  # newer than it: one may be this flow's newest run
        print(f"asyncrl launch: --resume: warning: newer runs under {root}/ were "
              f"{_refused(refused)}", file=sys.stderr)
        newest = "the newest run looked into"
    print(f"asyncrl launch: --resume: continuing {run} (its {step.name}), {newest} "
          f"under {root}/ with a checkpoint of {name}; give --run-dir DIR for another",
          file=sys.stderr)
    return run


def _driver(script: str) -> bool:
    """Whether `script` defines main() and binds no `flow` at its top level: read, not
    imported (unreadable or no Python: False, and its import says why)."""
    try:
        tree = ast.parse(Path(script).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    bound: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(stmt.name)
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):  # (`*`: maybe a flow)
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return "main" in bound and not {"flow", "*"} & bound


def _refused(refused: list[tuple[Path, str]]) -> str:
    """The runs not looked into, being not only this user's, with why (the first's reason
    says how to fix it)."""
    return (f"not looked into, as not only yours: {', '.join(str(run) for run, _ in refused)} "
            f"(the first: {refused[0][1]})")


def _passed_over(refused: list[tuple[Path, str]], elsewhere: list[tuple[Path, str]]) -> str:
    """The runs not looked into, being not only this user's, and those of a flow file of
    the same name in another folder."""
    said = f"; {_refused(refused)}" if refused else ""
    for path in sorted({path for _, path in elsewhere}):  # (a copied recipe: another flow;
        runs = [str(run) for run, ran in elsewhere if ran == path]  # a moved one: this one)
        said += (f"; {', '.join(runs)} ran {path}, another file of that name (if this file "
                 f"is it moved, give --run-dir {runs[-1]})")
    return said


def newest_run_of(script: str, root: Path) -> tuple[tuple[Path, Path] | None,
                                                    list[tuple[Path, str]],
                                                    list[tuple[Path, str]]]:
    """(run folder, its newest complete checkpoint) of the run under `root` that checkpointed
    flow file `script` last (None if none); the runs refused unread, with why (where one is
    found: those ordered after it); and those of another file of its name, with its path. A
    run is matched by the flow file's real path, kept in its launch options (another
    folder's file of the same name is another flow: a copied recipe); a run of before that,
    by the names of its nodes' files (checkpoint.identity). That is matched before the flow
    file is imported (with the run's settings); its nodes, groups and sizes are checked once
    it is, as on any resume. Only this user's checkpoints are read (another's settings must
    not reach the import)."""
    from asyncrl.controller import checkpoint
    from asyncrl.errors import CheckpointError

    name, here = os.path.basename(script), os.path.realpath(script)
    found: list[tuple[float, Path, Path]] = []
    refused: list[tuple[float, Path, str]] = []
    elsewhere: list[tuple[Path, str]] = []
    for run in sorted(root.iterdir()) if root.is_dir() else []:
        path = checkpoint.latest(run)
        if path is None:
            continue
        try:
            checkpoint._own(path)
        except CheckpointError as e:  # this user's run, said (its fix may be a chmod);
            if _yours(run):  # another user's is none of this resume's business
                refused.append((_mtime(path), run, str(e)))
            continue
        try:
            meta = checkpoint.read_meta(path)
            when = (path / "meta.json").stat().st_mtime
        except (CheckpointError, OSError):
            continue  # damaged or gone: never resumed unasked
        options, flow = meta.get("launch_options"), meta.get("flow")
        kept = options.get("flow_file") if isinstance(options, dict) else None
        if isinstance(kept, str):
            if kept == here:
                found.append((when, run, path))
            elif os.path.basename(kept) == name:
                elsewhere.append((run, kept))
            continue
        files = flow.get("file") if isinstance(flow, dict) else None  # (a run of before
        if isinstance(files, str) and name in files.split(", "):  # flow_file was kept)
            found.append((when, run, path))
    if not found:
        return None, [(run, why) for _, run, why in refused], elsewhere
    when, run, path = max(found)
    newer = [(other, why) for at, other, why in refused if (at, other) > (when, run)]
    return (run, path), newer, elsewhere


def _yours(run: Path) -> bool:
    try:
        return run.stat().st_uid == os.getuid()
    except OSError:
        return False


def _mtime(path: Path) -> float:
    """When a refused run's checkpoint wrote its meta.json (runs are ordered by it, as
    newest_run_of orders those it reads); inf if it cannot be told: taken for newer."""
    try:
        return (path / "meta.json").stat().st_mtime
    except OSError:
        return math.inf
