"""`asyncrl launch FLOW --resume` without --run-dir: the run to continue, found under runs/
(where launches without --run-dir go, see launch.default_run_dir)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

RUNS = Path("runs")


def run_to_resume(script: str, root: Path = RUNS) -> Path:
    """The run folder under `root` whose newest complete checkpoint is of `script` and the
    newest such, said; none: SystemExit asking for --run-dir."""
    if not os.path.isfile(script):
        raise SystemExit(f"asyncrl: no such file: {script}")
    name = os.path.basename(script)
    found = newest_run_of(name, root)
    if found is None:
        raise SystemExit(f"asyncrl launch: --resume needs --run-dir DIR, the run to continue "
                         f"(its checkpoints are in DIR/checkpoints): no run under {root}/ "
                         f"holds a complete checkpoint of {name}")
    run, step = found
    print(f"asyncrl launch: --resume: continuing {run} (its {step.name}), the newest run "
          f"under {root}/ with a checkpoint of {name}; give --run-dir DIR for another",
          file=sys.stderr)
    return run


def newest_run_of(name: str, root: Path) -> tuple[Path, Path] | None:
    """(run folder, its newest complete checkpoint) of the run under `root` that checkpointed
    flow file `name` last; None if none. A checkpoint names the files of its flow's nodes
    (checkpoint.identity): that is matched here, before the flow file is imported (with the
    run's settings); its nodes, groups and sizes are checked once it is, as on any resume.
    Only this user's checkpoints are read (another's settings must not reach the import)."""
    from asyncrl.controller import checkpoint
    from asyncrl.errors import CheckpointError

    found = []
    for run in sorted(root.iterdir()) if root.is_dir() else []:
        path = checkpoint.latest(run)
        if path is None:
            continue
        try:
            checkpoint._own(path)
            meta = checkpoint.read_meta(path)
            when = (path / "meta.json").stat().st_mtime
        except (CheckpointError, OSError):
            continue  # another user's, damaged or gone: never resumed unasked
        flow = meta.get("flow")
        files = flow.get("file") if isinstance(flow, dict) else None
        if isinstance(files, str) and name in files.split(", "):
            found.append((when, run, path))
    if not found:
        return None
    _, run, path = max(found)
    return run, path
