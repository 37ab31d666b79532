"""`asyncrl bench`, `export`, `run` and `launch` around the runs they read and write: a bench
is no run to resume, another user's checkpoint or saved settings are refused, a full disk
is said in a line, a driver's --resume is its own."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NO_GROUPS_FLOW, ROOT

COUNTED = ("import asyncrl\n\n\n@asyncrl.node\ndef n(x):\n    return {'v': x}\n\n\n"
           "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': range(100)})\n")


def _asyncrl(cwd: Path, *args: str, limit: int | None = None,
             umask: int | None = None) -> subprocess.CompletedProcess:
    """`python -m asyncrl ARGS` from `cwd` (its runs/); `limit`: files may grow to that many
    bytes, a write beyond it fails (EFBIG, SIGXFSZ ignored): a full disk, for this process."""
    def limited() -> None:
        if umask is not None:
            os.umask(umask)
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    env = {**os.environ, "ASYNCRL_FORK_AGENTS": "0", "PYTHONPATH": os.pathsep.join([
        ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limited)


def _run_dir(out: subprocess.CompletedProcess) -> str:
    return out.stdout.split("run_dir: ")[1].split("\n")[0]


def test_a_bench_writes_no_checkpoint_and_a_resume_continues_the_training_run(tmp_path):
    """bench checkpointed at its end as launch does: `launch flow.py --resume` then continued
    the bench's run (the newest with a checkpoint of flow.py), not the training run."""
    (tmp_path / "counted_flow.py").write_text(COUNTED)
    out = _asyncrl(tmp_path, "launch", "counted_flow.py", "--steps", "2")
    assert out.returncode == 0, out.stderr
    trained = _run_dir(out)
    out = _asyncrl(tmp_path, "bench", "counted_flow.py", "--steps", "1")
    benched = tmp_path / _run_dir(out)  # (no group: it ran, with no group calls to analyse)
    assert "nothing to analyse" in out.stderr and (benched / "metrics.jsonl").is_file()
    assert not (benched / "checkpoints").exists()
    out = _asyncrl(tmp_path, "launch", "counted_flow.py", "--resume", "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert f"--resume: continuing {trained} (its step_000001)" in out.stderr
    rows = (tmp_path / trained / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2]


def _checkpoint(run: Path) -> Path:
    step = run / "checkpoints" / "step_000000"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 0}))
    return step


def test_another_users_checkpoint_is_not_exported(tmp_path, monkeypatch):
    """`asyncrl export` read any checkpoint: its .metadata unpickled, its model.json's
    trust_remote_code run, as the user exporting; --resume refused it."""
    pytest.importorskip("transformers")
    import asyncrl.hybrid.export
    from asyncrl.cli import main
    from asyncrl.controller import checkpoint

    step = _checkpoint(run := tmp_path / "run")
    read = []

    def write(path, out, group, dtype):
        read.append(path)
        return {"out": str(out), "checkpoint": str(path), "group": "actor", "parameters": 1,
                "dtype": "float32", "notes": []}

    monkeypatch.setattr(asyncrl.hybrid.export, "export", write)
    monkeypatch.setattr(checkpoint, "not_yours", lambda path: "owned by user 4242")
    monkeypatch.delenv(checkpoint.TRUST_RUN_DIR, raising=False)
    for given in (run, step):
        with pytest.raises(SystemExit, match=f"^asyncrl export: {run} is owned by user 4242; "
                                             f"a checkpoint is loaded with pickle .* is "
                                             f"exported: .*ASYNCRL_TRUST_RUN_DIR=1"):
            main(["export", str(given), str(tmp_path / "out")])
    assert read == []
    monkeypatch.setenv(checkpoint.TRUST_RUN_DIR, "1")  # (its owner lies: root on NFS)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0 and read == [step]


def test_another_users_saved_settings_are_refused_before_the_flow_takes_them(
        tmp_path, monkeypatch):
    """`asyncrl run --inputs RUN_DIR/inputs/...` took RUN_DIR/inputs/overrides.json into the
    flow file's import whoever wrote it (--resume refuses another user's settings)."""
    from asyncrl.cli import main
    from asyncrl.controller import checkpoint

    (inputs := tmp_path / "run" / "inputs" / "step0").mkdir(parents=True)
    (inputs.parent / "overrides.json").write_text(json.dumps({"lr": "1"}))
    (saved := inputs / "echo.msgpack").write_bytes(b"")
    (flow := tmp_path / "imported_flow.py").write_text(
        "raise RuntimeError('the flow file was imported')\n")
    monkeypatch.setattr(checkpoint, "not_yours", lambda path: "owned by user 4242")
    monkeypatch.delenv(checkpoint.TRUST_RUN_DIR, raising=False)
    with pytest.raises(SystemExit, match=f"^asyncrl run: {tmp_path / 'run'} is owned by user "
                                         f"4242; the run's settings in .*overrides.json would "
                                         f"reach the flow file's import"):
        main(["run", str(flow), "--node", "echo", "--inputs", str(saved)])


def test_settings_saved_under_umask_0_are_taken_back_by_asyncrl_run(tmp_path):
    """(`asyncrl run` refuses saved settings others can write: --save-inputs, under umask 0,
    made inputs/ and its overrides.json so.)"""
    from asyncrl.controller.launch import saved_overrides

    (tmp_path / "no_groups_flow.py").write_text(NO_GROUPS_FLOW)
    out = _asyncrl(tmp_path, "launch", "no_groups_flow.py", "--run-dir", "run",
                   "--save-inputs", umask=0)
    assert out.returncode == 0, out.stderr
    assert (saved := tmp_path / "run" / "inputs" / "step0" / "echo.msgpack").is_file()
    assert saved_overrides(saved) == {}


def test_a_full_disk_at_a_checkpoint_is_said_in_a_line_and_hides_no_nodes_error(tmp_path):
    """torch.save's "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos
    64 vs 0" ended launch in a 60-line traceback that named neither the checkpoint nor the
    run; the run's last timeline write failing in a `finally` replaced the run's own error."""
    (tmp_path / "no_groups_flow.py").write_text(NO_GROUPS_FLOW)
    out = _asyncrl(tmp_path, "launch", "no_groups_flow.py", "--run-dir", "run", limit=4096)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "asyncrl launch: the checkpoint of step 0 could not be written into run/" \
           "checkpoints (RuntimeError: " in out.stderr
    assert "free space on its file system" in out.stderr
    assert "then launch again in another --run-dir (run holds no complete checkpoint" \
        in out.stderr
    (tmp_path / "failing_flow.py").write_text(COUNTED.replace(
        "    return", "    if x == 2:\n        raise ValueError('boom')\n    return"))
    out = _asyncrl(tmp_path, "launch", "failing_flow.py", "--run-dir", "failed", limit=256)
    assert out.returncode == 1, out.stderr
    assert "asyncrl: node 'n' failed at step 2" in out.stderr
    assert "writing the run's last timeline spans failed" in out.stderr
    assert "During handling" not in out.stderr


def test_a_bench_runs_on_the_slurm_allocation_and_hosts_as_launch_does(tmp_path, monkeypatch):
    """bench ran every group on this machine inside an allocation, and had no --hosts."""
    from asyncrl.cli import main
    from asyncrl.controller import launch

    class Launched(Exception):
        pass

    given = {}

    def launch_flow(flow, steps, run_dir, **options):
        given.update(options)
        raise Launched

    monkeypatch.setattr(launch, "launch_flow", launch_flow)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    for name, value in (("SLURM_JOB_NODELIST", "gpu[1-2]"), ("SLURM_GPUS_ON_NODE", "8"),
                        ("SLURM_CPUS_ON_NODE", "64")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    (flow := tmp_path / "no_groups_flow.py").write_text(NO_GROUPS_FLOW)
    with pytest.raises(Launched):
        main(["bench", str(flow), "--steps", "2", "--run-dir", str(tmp_path / "b"),
              "--controller-address", "10.0.0.5"])
    assert [(h.name, h.via) for h in given["cluster"].hosts] == [("gpu1", "srun"),
                                                                 ("gpu2", "srun")]
    assert given["host"] == "10.0.0.5" and given["checkpoints"] is False
    with pytest.raises(SystemExit, match=r"^asyncrl bench: --controller-address 127\.0\.0\.1"):
        main(["bench", str(flow), "--steps", "2", "--controller-address", "127.0.0.1"])


def test_a_drivers_resume_says_main_resumes_itself(tmp_path, monkeypatch):
    """`launch driver.py --resume` asked for --run-dir, which it then refused: "resume in
    main()"."""
    from asyncrl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    (tmp_path / "drv.py").write_text("async def main():\n    pass\n")
    with pytest.raises(SystemExit, match=r"--resume continues the run of a flow file's "
                                         r"`flow`; drv.py defines main\(\) \(a driver\), .*"
                                         r"resume in main\(\)"):
        main(["launch", "drv.py", "--resume"])


def test_a_full_disks_error_names_a_resume_command_that_finds_the_flow_file(tmp_path):
    """The command to resume named the flow file by its base name: run from another folder
    (`asyncrl launch examples/grpo.py`), it said `asyncrl launch grpo.py --resume`."""
    from types import SimpleNamespace

    from asyncrl.controller import checkpoint
    from asyncrl.errors import CheckpointError

    flow_file = tmp_path / "sub" / "f.py"
    run_dir = tmp_path / "run"
    kept = run_dir / "checkpoints" / "step_000000"
    kept.mkdir(parents=True)
    (kept / "meta.json").write_text(json.dumps({"step": 0}))
    flow = SimpleNamespace(launch_options={"flow_file": str(flow_file)})
    with pytest.raises(CheckpointError, match="step_000000") as e:
        with checkpoint.writing(flow, run_dir, 1):
            raise OSError(28, "No space left on device")
    assert f"asyncrl launch {flow_file} --resume --run-dir {run_dir}" in str(e.value)
