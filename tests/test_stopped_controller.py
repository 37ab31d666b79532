"""A controller stopped from outside: Ctrl-C and SIGTERM shut every group down; a killed
one leaves no rank (torchrun dies with it, or the ranks' heartbeat watchdog ends them) and
no shared memory (tests/drivers/hold.py is the driver)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, assert_gone, wait_until

from asyncrl.actors.procs import kill_pids, pid_alive

HOLD = os.path.join(os.path.dirname(__file__), "drivers", "hold.py")
ASYNCRL = [sys.executable, "-m", "asyncrl"]



def _start_hold(*extra: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    # Ctrl-C as a terminal gives it: a test run started in the background (`cmd &` in a
    # script) ignores SIGINT, and so would the driver, which inherits that
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", reset, *ASYNCRL[1:], "launch", HOLD,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    with selectors.DefaultSelector() as sel:  # its pids: one line, written at once
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(120) else ""
    if not line:
        if proc.poll() is None:  # (silent for 120 s: killed)
            proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"driver failed: {err}")
    return proc, json.loads(line)


def _finished(proc: subprocess.Popen, timeout: float) -> str:
    """The driver's stderr once it exited; if it does not within `timeout`, its threads'
    stacks (hold.py dumps them on SIGUSR1) in the failure, and it is killed."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        proc.kill()
        err = proc.communicate()[1]
        raise AssertionError(f"the driver did not exit within {timeout} s; its stderr and "
                             f"stacks:\n{err[-12000:]}") from None


def test_ctrl_c_shuts_every_group_down():
    proc, pids = _start_hold()
    proc.send_signal(signal.SIGINT)
    err = _finished(proc, 30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_gone([pids["agent"], *pids["ranks"]])


def test_a_flow_stopped_before_its_first_checkpoint_says_its_run_dir_cannot_resume(tmp_path):
    """Its run directory, holding a finished step's metrics but no checkpoint, refuses
    --resume and a fresh launch alike: said when it stops, with what to do."""
    flow = tmp_path / "waits.py"
    flow.write_text(
        "import asyncio\nimport asyncrl\n\n\n@asyncrl.node\nasync def wait(x):\n"
        "    if x == 2:\n        await asyncio.Event().wait()\n    return {'x': x}\n\n\n"
        "flow = asyncrl.DataFlow(nodes=[wait], inputs={'x': [1, 2]})\n")
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", reset, *ASYNCRL[1:], "launch", str(flow),
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    rows = run_dir / "metrics.jsonl"
    try:
        wait_until(lambda: rows.is_file() and rows.stat().st_size > 0, 60, "step 0's metrics")
    finally:
        proc.send_signal(signal.SIGINT)
    err = _finished(proc, 30)
    assert proc.returncode == 130, err
    assert f"asyncrl: stopped before its first checkpoint, so {run_dir} cannot be resumed: " \
        "launch again in another --run-dir, or remove it" in err, err
    # (3.10's asyncio.run cancelled the node itself: "raised CancelledError", a traceback)
    assert "CancelledError" not in err and "Traceback" not in err, err


def test_sigterm_shuts_every_group_down_as_ctrl_c_does(killed_driver_env):
    """scancel, docker stop: SIGTERM ended the controller at once (no close: its ranks,
    shared memory and private folders were left to chance)."""
    proc, pids = _start_hold(env=killed_driver_env)
    proc.send_signal(signal.SIGTERM)
    err = _finished(proc, 30)
    assert proc.returncode == 143, err
    assert "asyncrl: terminated (SIGTERM); every group was shut down" in err
    assert_gone([pids["agent"], *pids["ranks"]])
    assert not [p for p in os.listdir(killed_driver_env["TMPDIR"])
                if p.startswith("asyncrl-secret-")]  # its secret's folder removed at close


@pytest.mark.parametrize("forked", ["1", "0"], ids=["forked-ranks", "ranks-anew"])
def test_a_killed_controllers_ranks_leave_no_shared_memory(killed_driver_env, forked):
    """The ranks of a killed controller were stopped by torchrun's SIGTERM (started anew)
    or by their stand-in's end (forked: a SIGKILL of their own): their pools stayed in
    /dev/shm, RAM until a reboot. Each unlinks its own first now."""
    env = {**killed_driver_env, "ASYNCRL_FORK_RANKS": forked}
    proc, pids = _start_hold("--pull", env=env)
    everyone = [pids["agent"], *pids["ranks"]]

    def segments() -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"asyncrl-{pids['run']}-")]
    try:
        try:
            assert segments(), "the pulls made no segment"  # (else this test checks nothing)
        finally:
            proc.kill()
            proc.communicate(timeout=10)
        assert_gone(everyone, timeout=30)
        assert segments() == []
    finally:  # (what a failure left: not for the next test, nor RAM until a reboot)
        kill_pids([p for p in everyone if pid_alive(p)])
        for name in segments():
            with contextlib.suppress(FileNotFoundError):  # (a dying rank's own unlink)
                os.unlink(f"/dev/shm/{name}")


def test_killed_controller_ranks_exit_on_lost_heartbeat(killed_driver_env):
    proc, pids = _start_hold("--orphanable", env=killed_driver_env)
    try:
        proc.kill()
        proc.communicate(timeout=10)
        # torchrun does not die with the controller here: the ranks' watchdog must end them
        assert_gone(pids["ranks"], timeout=2.0 + 15)
        assert_gone([pids["agent"]])
    finally:  # (else a regressed watchdog's agent and ranks idle for ever)
        kill_pids([p for p in [pids["agent"], *pids["ranks"]] if pid_alive(p)])
    logs = "".join(p.read_text(errors="replace") for p in Path(
        killed_driver_env["TMPDIR"]).glob("asyncrl-*/logs/*.log"))  # the group's, torchrun's
    said = re.findall(r"no heartbeat from the controller for [\d.]+s \(limit [\d.]+s\)"
                      r"(?:, and its process is gone)?; exiting", logs)
    assert len(said) == len(pids["ranks"]), logs[-2000:]  # each rank ended itself, said why
