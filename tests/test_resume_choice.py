"""`asyncrl launch FLOW --resume` without --run-dir: which run under runs/ it continues, and
what it says when it finds none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from asyncrl.cli_resume import run_to_resume

COUNTED = ("import asyncrl\n\n\n@asyncrl.node\ndef n(x):\n    return {'v': x}\n\n\n"
           "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': range(100)})\n")


def _launch(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m asyncrl launch ARGS` from `cwd` (its runs/)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [
        os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "asyncrl", "launch", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_resume_without_run_dir_takes_no_run_of_a_copied_flow_file(tmp_path):
    """Runs were matched by the flow file's name: after a run of exp2/train.py (a copied
    recipe folder), `launch exp1/train.py --resume` continued it (its weights, settings,
    metrics.jsonl). They are matched by the file's real path."""
    def steps(run: str) -> list[int]:
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(row)["step"] for row in rows]

    for folder in ("exp1", "exp2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.py").write_text(COUNTED)
    out = _launch(tmp_path, "exp2/train.py", "--steps", "1")
    assert out.returncode == 0, out.stderr
    theirs = out.stdout.split("run_dir: ")[1].split("\n")[0]
    out = _launch(tmp_path, "exp1/train.py", "--resume", "--steps", "2")
    assert out.returncode == 1 and out.stderr == (
        f"asyncrl launch: --resume needs --run-dir DIR, the run to continue (its checkpoints "
        f"are in DIR/checkpoints): no run under runs/ holds a complete checkpoint of "
        f"train.py; {theirs} ran {os.path.realpath(tmp_path / 'exp2' / 'train.py')}, another "
        f"file of that name (if this file is it moved, give --run-dir {theirs})\n")
    assert steps(theirs) == [0]
    out = _launch(tmp_path, "exp1/train.py", "--steps", "1")  # then exp2's newest again:
    assert out.returncode == 0, out.stderr  # exp1's own run is continued
    mine = out.stdout.split("run_dir: ")[1].split("\n")[0]
    assert _launch(tmp_path, "exp2/train.py", "--resume", "--steps", "2").returncode == 0
    out = _launch(tmp_path, "exp1/train.py", "--resume", "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert f"continuing {mine} (its step_000000)" in out.stderr
    assert (steps(mine), steps(theirs)) == ([0, 1, 2], [0, 1])


def _checkpoint(run: Path, meta: dict) -> Path:
    folder = run / "checkpoints" / "step_000000"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 0, **meta}))
    return folder


def test_a_resume_without_run_dir_names_the_runs_it_could_not_read(tmp_path, monkeypatch,
                                                                    capsys):
    """A run refused as not only this user's (an earlier asyncrl's run under umask 0) was
    passed over unsaid: --resume asked for --run-dir as if there were none, or continued an
    older run as "the newest". A run of before the flow file's path was kept is still found
    by its name. Another user's run is passed over unsaid, as before."""
    monkeypatch.delenv("ASYNCRL_TRUST_RUN_DIR", raising=False)
    flow = tmp_path / "train.py"
    flow.write_text(COUNTED)
    runs = tmp_path / "runs"
    shared = _checkpoint(runs / "20250101-000000", {
        "flow": {"file": "train.py"}, "launch_options": {"flow_file": str(flow.resolve())}})
    shared.chmod(0o777)
    with pytest.raises(SystemExit, match=(
            f"no run under {re.escape(str(runs))}/ holds a complete checkpoint of train.py; "
            f"not looked into, as not only yours: {re.escape(str(shared.parent.parent))} "
            f"\\(the first: --resume: {re.escape(str(shared))} is writable by every user; "
            f".*`chmod -R o-w {re.escape(str(shared))}` if you trust its contents")):
        run_to_resume(str(flow), runs)
    older = runs / "20240101-000000"  # (no flow_file in its meta.json)
    os.utime(_checkpoint(older, {"flow": {"file": "train.py"}}) / "meta.json", (0, 0))
    capsys.readouterr()
    assert run_to_resume(str(flow), runs) == older
    said = capsys.readouterr().err
    assert f"warning: newer runs under {runs}/ were not looked into, as not only yours: " \
           f"{shared.parent.parent} (the first: " in said and "`chmod -R o-w " in said
    assert "the newest run under" not in said
    shared.chmod(0o775)
    assert run_to_resume(str(flow), runs) == runs / "20250101-000000"
    assert "warning" not in capsys.readouterr().err
    if os.getuid() != 0:  # (giving a run to another user needs root)
        return
    theirs = runs / "20260101-000000"  # another user's newer run: none of this user's
    _checkpoint(theirs, {"flow": {"file": "train.py"},  # business (no chmod fixes it)
                         "launch_options": {"flow_file": str(flow.resolve())}})
    os.chown(theirs, 4242, 4242)
    assert run_to_resume(str(flow), runs) == runs / "20250101-000000"
    assert str(theirs) not in capsys.readouterr().err
