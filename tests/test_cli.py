"""The `asyncrl` command, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_help_from_the_module_and_the_console_script():
    out = _run("--help")
    assert out.returncode == 0 and "launch" in out.stdout
    script = subprocess.run([f"{sys.prefix}/bin/asyncrl", "launch", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "main()" in script.stdout


def test_launch_runs_the_example_driver():
    out = _run("launch", "examples/driver.py")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("spawned 2 groups")
    assert sum(line.startswith("prompt ") for line in lines) == 6
    assert "(rank 0)" in out.stdout and "(rank 1)" in out.stdout
    means = next(line for line in lines if line.startswith("mean reward"))
    a, b = means.split(": ", 1)[1].strip("[]").split(", ")
    assert a == b  # the all-reduce gave both ranks the same value


def test_launch_errors_are_clear(tmp_path):
    out = _run("launch", str(tmp_path / "missing.py"))
    assert out.returncode != 0 and "no such file" in out.stderr
    script = tmp_path / "nomain.py"
    script.write_text("x = 1\n")
    out = _run("launch", str(script))
    assert out.returncode != 0 and "defines no `flow` and no main()" in out.stderr
    out = _run("launch", "examples/driver.py", "--resume", "--run-dir", str(tmp_path))
    assert out.returncode != 0 and "--resume and --checkpoint-every work on a DataFlow" \
        in out.stderr
    out = _run("launch", "examples/flow.py", "--checkpoint-every", "0")
    assert out.returncode != 0 and "--checkpoint-every must be >= 1, got 0" in out.stderr


def test_a_broken_flow_file_is_named_with_its_line_and_the_fix(tmp_path):
    bad = tmp_path / "bad_syntax.py"
    bad.write_text("import asyncrl\ndef f(:\n    pass\n")
    out = _run("launch", str(bad))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{bad} is not valid Python: invalid syntax at {bad}:2" in out.stderr
    assert "def f(:" in out.stderr and "fix the file" in out.stderr
    missing = tmp_path / "bad_import.py"
    missing.write_text("import asyncrl\n\nimport no_such_module_xyz\n")
    out = _run("launch", str(missing))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"importing {missing} failed at {missing}:3: ModuleNotFoundError" in out.stderr
    assert "install the missing module" in out.stderr
