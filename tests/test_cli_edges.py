"""`asyncrl launch`, `run`, `logs` and `timeline` at their edges: a run directory others can
write, errors whose notes say more, a file that is no Python, damaged saved inputs, a reader
that stops early, a --resume that finds its run."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
from helpers import NO_GROUPS_FLOW as NO_GROUPS
from helpers import ROOT


@pytest.fixture
def cli_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # (launch sets the flow's)


def test_a_run_dir_every_user_can_write_is_refused_before_anything_in_it_goes(
        tmp_path, monkeypatch, capsys, cli_argv):
    """The Controller refused it, but only after a fresh run's cleanup had removed the
    earlier run's wandb.json (and the others) in it: an asyncio traceback, exit 1."""
    from asyncrl.cli import main
    from asyncrl.controller.checkpoint import TRUST_RUN_DIR
    from asyncrl.controller.launch import hold_run_dir

    monkeypatch.delenv(TRUST_RUN_DIR, raising=False)
    (flow := tmp_path / "no_groups_flow.py").write_text(NO_GROUPS)
    (shared := tmp_path / "shared").mkdir()
    shared.chmod(0o777)
    (shared / "wandb.json").write_text("{}")
    assert main(["launch", str(flow), "--run-dir", str(shared)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"run_dir {shared} is writable by every user" in err
    assert (shared / "wandb.json").read_text() == "{}"
    monkeypatch.setenv(TRUST_RUN_DIR, "1")  # where its mode says so falsely: taken
    os.close(hold_run_dir(shared))


LOCKS = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\ntry:\n"
         "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n"
         "    sys.exit(3)\n")


def test_a_run_dirs_lock_is_on_a_regular_file_opened_for_writing(tmp_path):
    """The lock was flock() on the folder: NFS keeps such a lock to its own host, so a
    second controller on another node sharing the run directory was not refused."""
    from asyncrl.controller.launch import hold_run_dir

    lock = (run_dir := tmp_path / "run") / ".lock"
    held = hold_run_dir(run_dir)
    try:
        assert os.path.samestat(os.fstat(held), lock.lstat()) and lock.is_file()
        assert fcntl.fcntl(held, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        taken = subprocess.run([sys.executable, "-c", LOCKS, str(lock)], timeout=60)
        assert taken.returncode == 3  # another process's lock on it: refused
    finally:
        os.close(held)
    assert subprocess.run([sys.executable, "-c", LOCKS, str(lock)], timeout=60).returncode == 0


def test_a_failures_own_notes_are_said_beside_its_causes(tmp_path, capsys):
    """Only a NodeError's cause's notes were printed (not its own: why recovery gave up),
    and none of any other error's (a RemoteError's other ranks that raised too)."""
    from asyncrl.cli import _run_flow
    from asyncrl.compat import add_note
    from asyncrl.controller.nodes import NodeError
    from asyncrl.errors import RemoteError

    def remote() -> RemoteError:
        error = RemoteError("reward", 0, "score", "ValueError", "boom", "tb")
        for rank in range(1, 7):  # (the first 4 said, the others counted)
            add_note(error, f"reward[rank {rank}].score raised too: ValueError: boom")
        return error

    async def fails(error: BaseException) -> None:
        raise error

    node = NodeError("score", 3, cause := remote())
    node.__cause__ = cause
    spent = "not recovered: group 'reward' used its 1 restart(s) (max_restarts=1)"
    add_note(node, spent)
    for error, last in ((node, spent), (remote(), "... and 2 more ranks")):
        assert _run_flow("launch", tmp_path, fails(error)) == 1
        err = capsys.readouterr().err
        assert "reward[rank 4].score raised too: ValueError: boom\n... and 2 more ranks" in err
        assert "rank 5]" not in err
        assert f"\n{last}\nrun_dir: {tmp_path}" in err


def test_a_resume_of_a_wandb_run_without_wandb_says_how_to_go_on(tmp_path, monkeypatch):
    """It said "--wandb needs the wandb package" to a user who never passed --wandb."""
    from asyncrl import cli
    from asyncrl.controller import trackers

    (tmp_path / "wandb.json").write_text('{"id": "abc123", "project": "p1"}')
    monkeypatch.setattr(trackers, "find_spec", lambda name: None)  # wandb not installed
    args = cli.parser().parse_args(["launch", "flow.py", "--run-dir", str(tmp_path),
                                    "--resume"])
    with pytest.raises(SystemExit, match="the run logged to wandb project 'p1': install "
                                         "wandb .* or pass --no-wandb to resume without it"):
        cli._wandb(args, tmp_path)
    args.no_wandb = True
    assert cli._wandb(args, tmp_path) is None


def test_damaged_saved_inputs_are_said_in_a_line(tmp_path):
    """load_inputs said what was wrong (a ValueError, or a KeyError for a dict without its
    values), and `asyncrl run` printed it as a traceback."""
    from asyncrl.cli import main
    from asyncrl.comm import codec
    from asyncrl.controller.saved_inputs import NODE_INPUTS

    (flow := tmp_path / "no_groups_flow.py").write_text(NO_GROUPS)
    whole = codec.encode({"format": NODE_INPUTS, "values": {"x": 1}, "futures": {}})
    for damaged in (whole[:-3], codec.encode({"format": NODE_INPUTS})):  # cut; no values
        (saved := tmp_path / "x.msgpack").write_bytes(damaged)
        with pytest.raises(SystemExit, match=f"asyncrl run: {saved} cannot be read as a "
                                             f"node's inputs .*; save them again"):
            main(["run", str(flow), "--node", "x", "--inputs", str(saved)])


def test_a_file_that_is_no_python_is_said_to_be_so(tmp_path, cli_argv):
    """flow.txt: "importing flow.txt failed at .../asyncrl/comm/refs.py:167: ImportError
    ... install the missing module"."""
    from asyncrl.cli import main

    (flow := tmp_path / "flow.txt").write_text(NO_GROUPS)
    for command in (["launch", str(flow)], ["run", str(flow), "--node", "x", "--inputs",
                                              str(flow)]):
        with pytest.raises(SystemExit, match=f"^asyncrl: {flow} is not a Python file \\(.py\\)"):
            main(command)


def test_asyncrl_logs_prints_a_rank_log_and_names_the_known_ones(tmp_path):
    from asyncrl.controller.logs import LogSink, read_log

    sink = LogSink(tmp_path / "logs", echo=False)
    sink.write("actor", 1, ["first", "second", "third"])
    sink.close()
    out = subprocess.run([sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group",
                          "actor", "--rank", "1", "--tail", "2"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.splitlines() == ["second", "third"]
    assert list(read_log(tmp_path, "actor", 1, 0)) == []  # not the whole log
    other = tmp_path / "other"
    sink = LogSink(other / "logs", echo=False)  # a group closed: its files closed too
    sink.write("actor", 0, ["a"])
    sink.write("critic", 0, ["b"])
    opened = set(os.listdir("/proc/self/fd"))
    sink.close_group("actor")
    assert len(opened - set(os.listdir("/proc/self/fd"))) == 1
    sink.write("actor", 0, ["c"])  # a respawned group's rank: opened again, appended to
    sink.close()
    assert list(read_log(other, "actor", 0)) == ["a", "c"]
    assert list(read_log(tmp_path, "actor", 1, 5)) == ["first", "second", "third"]
    with pytest.raises(FileNotFoundError, match=r"no log for group 'critic' rank 1 .*logs "
                                                r"there: \['actor:0', 'critic:0'\]"):
        read_log(other, "critic", 1)
    (other / "logs" / "critic.log").write_text("torchrun's\n")  # the group ran, its rank 1
    with pytest.raises(FileNotFoundError, match=r"rank 1 of group 'critic' printed nothing .*"
                                                r"torchrun log is .*critic\.log"):
        read_log(other, "critic", 1)  # printed nothing (its file is made at its first line)
    (other / "logs" / "critic.log").unlink()  # on a cluster: one torchrun log per host
    for host in ("n1", "n2"):
        (other / "logs" / f"critic.{host}.log").write_text("torchrun's\n")
    with pytest.raises(FileNotFoundError, match=r"printed nothing .*torchrun logs are "
                                                r".*critic\.n1\.log, .*critic\.n2\.log"):
        read_log(other, "critic", 1)
    # read from the end, a block at a time: lines across blocks come whole
    from asyncrl.controller.logs import _last_lines

    big = tmp_path / "big.log"
    big.write_text("".join(f"{i:05d} " + "x" * (i % 37) + "\n" for i in range(3000)))
    want = big.read_text().splitlines()
    for n in (0, 1, 7, 500, 5000):
        assert _last_lines(big, n, block=100) == want[max(len(want) - n, 0):]
    bad = subprocess.run([sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group",
                          "critic", "--rank", "0"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert bad.returncode != 0 and "actor:1" in bad.stderr


def test_asyncrl_logs_keeps_a_ranks_lines_whole_and_stops_quietly_for_head(tmp_path):
    """Lines split at newlines only (str.splitlines also split at U+2028, \\x0c...: a
    fragment came out as a line of its own); a reader that stops early (`| head -1`) ended
    in a BrokenPipeError traceback and exit code 1."""
    from asyncrl.controller.logs import LogSink, read_log

    sink = LogSink(tmp_path / "logs", echo=False)
    sink.write("actor", 0, ["sep\u2028arated", "form\x0cfeed"] + [f"line {i}" for i in range(
        20000)])
    sink.close()
    assert list(read_log(tmp_path, "actor", 0))[:2] == ["sep\u2028arated", "form\x0cfeed"]
    assert list(read_log(tmp_path, "actor", 0, 20001))[0] == "form\x0cfeed"
    with subprocess.Popen([sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group",
                           "actor", "--rank", "0"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=ROOT) as logs:  # (pipes closed, reaped)
        try:
            assert logs.stdout.readline() == "sep\u2028arated\n".encode()
            logs.stdout.close()  # as `head -1` does
            assert logs.wait(60) == 0
            assert logs.stderr.read() == b""
        finally:
            if logs.poll() is None:  # (failed midway)
                logs.kill()


def test_a_ranks_escape_sequences_in_the_runs_last_error_are_shown_escaped(tmp_path, capsys):
    """The run's last error was printed as it was: a rank's exception message (a model's
    output in it) or a dead group's log tail set the terminal's title, cleared it... The
    console escapes them in the ranks' lines; the error now too, its newlines kept."""
    from asyncrl.cli import _run_flow
    from asyncrl.controller.nodes import NodeError
    from asyncrl.errors import CheckpointError, RemoteError

    raw = "bad answer \x1b]0;pwned\x07\x1b[2J"
    cause = RemoteError("reward", 0, "score", "ValueError", raw, f"Traceback\nValueError: {raw}")
    node = NodeError("score", 3, cause)
    node.__cause__ = cause

    async def fails(error: BaseException) -> None:
        raise error

    for error, code in ((node, 1), (cause, 1), (CheckpointError(raw), 2)):
        assert _run_flow("launch", tmp_path, fails(error)) == code
        err = capsys.readouterr().err
        assert not {"\x07", "\x1b"} & set(err), repr(err)
        assert "bad answer \\x1b]0;pwned\\x07\\x1b[2J" in err
        assert code == 2 or "\n--- remote traceback (group 'reward', rank 0) ---\n" in err


def test_asyncrl_timeline_where_its_picture_cannot_be_written_says_so(tmp_path):
    """A run directory this user cannot write (another user's run): the picture's OSError
    ended `asyncrl timeline` in a traceback. Said in a line; --out draws it elsewhere."""
    pytest.importorskip("matplotlib")
    from asyncrl.cli import main
    from asyncrl.controller.timeline import Timeline

    timeline = Timeline(tmp_path)
    timeline.node("generate", 0, 1.0, 1.5)
    timeline.write(timeline.take())
    (tmp_path / "timeline.png").mkdir()  # (a folder this user cannot write, even as root)
    with pytest.raises(SystemExit, match=f"asyncrl timeline: drawing {tmp_path}/timeline.json "
                                         f"into {tmp_path}/timeline.png failed .*Is a "
                                         f"directory.*; give --out FILE.png"):
        main(["timeline", str(tmp_path)])
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0


COUNTED = ("import asyncrl\n\n\n@asyncrl.node\ndef n(x):\n    return {'v': x}\n\n\n"
           "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': range(100)})\n")


def test_a_resume_without_run_dir_continues_the_newest_run_of_its_flow_file(tmp_path):
    """`asyncrl launch flow.py --resume` (the issue's words) exited: --resume needs --run-dir."""
    def launch(*args: str) -> subprocess.CompletedProcess:  # from tmp_path: its runs/
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [
            os.environ.get("PYTHONPATH")])])}
        return subprocess.run([sys.executable, "-m", "asyncrl", "launch", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    def steps(run: str) -> list[int]:
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(row)["step"] for row in rows]

    (tmp_path / "counted_flow.py").write_text(COUNTED)
    (tmp_path / "other_flow.py").write_text(COUNTED)
    out = launch("counted_flow.py", "--resume")
    assert out.returncode == 1 and out.stderr == (
        "asyncrl launch: --resume needs --run-dir DIR, the run to continue (its checkpoints "
        "are in DIR/checkpoints): no run under runs/ holds a complete checkpoint of "
        "counted_flow.py\n")
    runs = []
    for flow, n in (("counted_flow.py", "1"), ("counted_flow.py", "2"), ("other_flow.py", "1")):
        out = launch(flow, "--steps", n)  # the last one: the newest run, of another file
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split("run_dir: ")[1].split("\n")[0])
    out = launch("counted_flow.py", "--resume", "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert f"asyncrl launch: --resume: continuing {runs[1]} (its step_000001), the newest " \
           f"run under runs/ with a checkpoint of counted_flow.py" in out.stderr
    assert f"run_dir: {runs[1]}\n" in out.stdout
    assert [steps(run) for run in runs] == [[0], [0, 1, 2], [0]]
