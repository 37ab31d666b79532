"""Ranks' output: streamed to the controller, prefixed on its console, kept per rank in the
run directory, rate-limited on the console only, and read back with `asyncrl logs` (the
command's own tests: test_cli_edges.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, assert_gone, group_pids, poll_until, run, wait_until

import asyncrl
from asyncrl.actors import output
from asyncrl.controller.logs import LogSink


class Chatty(asyncrl.Worker):
    @asyncrl.register
    def talk(self, n: int) -> int:
        for i in range(n):
            print(f"line {i} from rank {self.rank}")
        os.write(2, f"raw stderr from rank {self.rank}\n".encode())  # not through Python
        return n


def test_rank_output_reaches_the_run_directory_and_the_console(tmp_path, capfd):
    def lines(rank: int) -> list[str]:
        path = tmp_path / "logs" / "chatty" / f"rank{rank}.log"
        return path.read_text().splitlines() if path.is_file() else []

    async def main():
        async with asyncrl.Controller(run_dir=tmp_path) as ctl:
            g = await ctl.spawn(Chatty, nprocs=2, name="chatty")
            await g.talk(300)
            await poll_until(lambda: all(f"raw stderr from rank {r}" in lines(r)
                                       for r in (0, 1)), 20, "both ranks' output in its file")
            return group_pids(g)
    pids = run(main())
    assert_gone(pids)
    for r in (0, 1):
        got = lines(r)
        assert [x for x in got if x.startswith("line ")] == \
            [f"line {i} from rank {r}" for i in range(300)]  # every line, in order
    err = capfd.readouterr().err
    assert "chatty:1 | line 0 from rank 1" in err
    shown = [x for x in err.splitlines() if x.startswith("chatty:0 | line ")]
    assert 0 < len(shown) < 300  # the console was spared most of them...
    assert "chatty:0 | [asyncrl]" in err and "lines not shown" in err  # ...and says so


def test_console_rate_limit_counts_what_it_hides(tmp_path, capsys):
    sink = LogSink(tmp_path, lines_per_s=0.001, burst=3)
    sink.write("g", 0, [f"l{i}" for i in range(10)])
    sink.close()
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["g:0 | l0", "g:0 | l1", "g:0 | l2"] and len(err) == 5
    assert "lines not shown" in err[3] and str(tmp_path / "g" / "rank0.log") in err[3]
    # how many, said when the output ends in the burst (a traceback, often): it was not
    assert err[4] == f"g:0 | [asyncrl] 7 lines were not shown; all are in {tmp_path}/g/rank0.log"
    assert (tmp_path / "g" / "rank0.log").read_text().splitlines() == [f"l{i}" for i in range(10)]
    sink = LogSink(tmp_path, lines_per_s=0.001, burst=1)
    sink.write("h", 0, ["a", "b"])
    sink.close_group("h")  # a group's close says it too
    sink.console.close()  # (written by the console's thread)
    assert capsys.readouterr().err.splitlines()[-1].startswith("h:0 | [asyncrl] 1 lines were")


def test_a_log_file_that_cannot_be_written_hides_nothing_on_the_console(tmp_path, capsys):
    """The file was written before the echo: a full disk raised there, the lines never
    showed, and the channel logged a traceback for every message."""
    (tmp_path / "g").write_text("a file where the group's folder goes")
    sink = LogSink(tmp_path)
    sink.write("g", 0, ["one"])
    sink.write("g", 1, ["two"])
    sink.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "g:0 | one" and err[-1] == "g:1 | two"
    assert len([line for line in err if "failed" in line]) == 1  # said once


@contextlib.contextmanager
def pumped(send):
    """An OutputCapture's reader fed from a pipe of ours instead of fds 1 and 2; yields the
    pipe's write end, whose close (the last writer) makes the reader send the rest and end."""
    from asyncrl.actors.output import OutputCapture

    capture = OutputCapture(send)
    read_fd, write_fd = os.pipe()
    capture._read_fd, capture._original = read_fd, os.open(os.devnull, os.O_WRONLY)
    pump = threading.Thread(target=capture._pump, daemon=True)
    pump.start()
    try:
        yield write_fd
    finally:
        os.close(write_fd)
        pump.join(30)
        os.close(read_fd)
        os.close(capture._original)
    assert not pump.is_alive()


def test_progress_bars_and_long_lines_without_a_newline_are_streamed(tmp_path, monkeypatch):
    from asyncrl.actors.output import LINE_CAP, split_lines

    assert split_lines(b"a\r\nb\n\nc\r d\r e") == ([b"a", b"b", b"", b"c", b" d"], b" e")
    # a CRLF split between two reads makes no empty line; a blank CRLF line stays one
    lines, rest = split_lines(b"abc\r")
    more, rest = split_lines(rest + b"\ndef\r\n\r\n")
    assert (lines, more, rest) == ([], [b"abc", b"def", b""], b"")
    lines, rest = split_lines(b"x" * LINE_CAP + b"\r")  # a full piece, then half a CRLF
    assert (lines, split_lines(rest + b"\nnext\n")) == ([], ([b"x" * LINE_CAP, b"next"], b""))
    sent: list[str] = []
    first = threading.Event()

    def send(lines: list[str], dropped: int) -> None:
        assert dropped == 0
        sent.extend(lines)
        first.set()

    monkeypatch.setattr(output, "PARTIAL_S", 600)  # (a quiet line's send: tested below)
    with pumped(send) as write_fd:
        os.write(write_fd, b"\r 10%|#    |\r 20%|##   |")  # tqdm: no newline until the end
        assert first.wait(30), "a progress bar's redraws were held back for a newline"
        assert sent == [" 10%|#    |"]
        long = "é" * LINE_CAP  # 2 * LINE_CAP bytes, never a newline
        os.write(write_fd, long.encode())
    assert sent[1].startswith(" 20%|##   |é") and "".join(sent[1:]) == " 20%|##   |" + long
    assert len(sent) > 2 and all(len(x.encode()) <= LINE_CAP for x in sent)


def test_a_partial_line_is_sent_after_a_quiet_second(monkeypatch):
    """A line without its end (tqdm's redraws start with \\r; a `print(..., end="")`) waited
    for one: 3 s after a bar's last redraw the controller had its 50% only, and a hung rank
    showed stale output. It is sent after a quiet second (progress dots were cut a second
    after they began); its end makes no empty line (a blank print() after it was lost too)."""
    monkeypatch.setattr(output, "PARTIAL_S", 0.6)  # 12 times the time between two dots
    sent, written = [], []
    with pumped(lambda lines, dropped: sent.extend(lines)) as write_fd:
        os.write(write_fd, b"\rshards 50%\rshards 100%")
        wait_until(lambda: "shards 100%" in sent, 5, "a line without its end, quiet")
        os.write(write_fd, b"\nnext\n")
        for _ in range(30):  # 1.5 s of dots: cut at 0.6 s and 1.2 s when cut by age
            written.append(time.monotonic())
            os.write(write_fd, b".")
            time.sleep(0.05)
        os.write(write_fd, b" done\nLoading...")
        wait_until(lambda: "Loading..." in sent, 5, "a line without its end, quiet")
        os.write(write_fd, b"\n")  # print(): the line's end, read on its own
        time.sleep(0.3)
        os.write(write_fd, b"\nSummary\n")  # print(), print("Summary")
    quiet = max(later - at for at, later in zip(written, written[1:], strict=False))
    assert (sent[:3], sent[-3:]) == (["shards 50%", "shards 100%", "next"],
                                     ["Loading...", "", "Summary"]), sent
    assert sent[3:-3] == ["." * 30 + " done"] or quiet >= output.PARTIAL_S, sent  # (or stalled)


def test_a_rank_whose_output_tee_is_killed_prints_on_to_its_log():
    """The tee gone, the rank's prints failed on its broken pipe (BrokenPipeError in user
    code); they go to the log itself now, and the controller is told."""
    script = """if True:
        import json, os, signal, threading
        from asyncrl.actors.output import OutputCapture
        sent, through = [], threading.Event()
        capture = OutputCapture(lambda lines, dropped: (sent.extend(lines), through.set()))
        capture.start()
        print("before", flush=True)
        assert through.wait(30)  # through the tee (what it has not read yet dies with it)
        os.kill(capture._tee.pid, signal.SIGKILL)
        capture._tee.wait()
        capture._thread.join(30)  # the reader sees the tee's end
        print("after", flush=True)
        capture.close()
        os.write(capture._original, ("sent " + json.dumps(sent) + "\\n").encode())
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    note = "[asyncrl] the output tee exited: this rank's output goes to this log only"
    assert lines[:3] == ["before", note, "after"], lines
    assert json.loads(lines[3].removeprefix("sent ")) == ["before", note]


def test_a_respawned_agent_reports_only_its_own_part_of_the_shared_log(tmp_path):
    from asyncrl.controller.launcher import Agent

    def agent_printing(text: str) -> Agent:  # an agent whose "torchrun" prints `text`, exits
        done = threading.Event()
        agent = Agent("g", 1, dict(os.environ), tmp_path / "g.log", die_with_parent=False,
                      command=[sys.executable, "-c", f"print({text!r})"])
        agent.start(lambda code: done.set())
        assert done.wait(60)
        agent.wait()
        return agent

    failed = agent_printing(
        "old: Traceback boom\n[E] failed (exitcode: 1) local_rank: 1\nRoot Cause (first "
        "observed failure):\n  rank      : 1 (local_rank: 1)\n  exitcode  : 7 (pid: 9)")
    assert failed.tail() == "old: Traceback boom" and failed.root_cause() == (1, 7)
    stopping = agent_printing(  # torchrun stopping the rest, and a rank printing the words
        "W1202 03:54:54.826000 3349 api.py:1028] Sending process 3354 closing signal SIGTERM\n"
        "Sending process 77 closing signal SIGTERM")
    assert stopping.stopped_pids() == {3354}
    again = agent_printing("new: the respawned group's line")  # appends to the same file
    assert "old:" in (tmp_path / "g.log").read_text()
    assert again.tail() == "new: the respawned group's line"
    assert again.root_cause() is None and again.stopped_pids() == set()


class Crasher(asyncrl.Worker):
    def __init__(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind

    @asyncrl.register
    def crash(self) -> None:
        print("a line before", flush=True)
        os.write(2, b"terminate called after throwing an instance of 'c10::Error'\n")
        os.abort()  # as C++ does after that: no Python cleanup, no reader thread left

    @asyncrl.register
    def segfault(self) -> None:
        import ctypes

        print("a line before", flush=True)
        ctypes.string_at(0)


@pytest.mark.parametrize("how, last_words", [
    ("crash", "terminate called after throwing"),
    ("segfault", "Fatal Python error: Segmentation fault")])
def test_what_a_rank_wrote_as_it_crashed_is_in_its_log_and_the_error(how, last_words):
    """The rank's reader thread dies with it: its last words (a fault's Python traceback
    too) reach torchrun's log through a tee of their own, and the dead group's error shows
    them."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Crasher, name="crasher")
            pids = group_pids(group)
            with pytest.raises(asyncrl.GroupDeadError) as info:
                await getattr(group, how)()
            return pids, str(info.value)
    pids, err = run(main())
    assert_gone(pids)
    assert "a line before" in err and last_words in err, err


def test_two_writes_of_one_json_file_at_once_do_not_mix(tmp_path, monkeypatch):
    """A checkpoint's timeline.json write (in a thread) still running when the run's last
    one began (a SIGTERM meanwhile) shared one temporary file: the later replace found it
    gone (FileNotFoundError, hiding the interrupt) or the file mixed both."""
    from asyncrl.controller import logs

    path = tmp_path / "timeline.json"
    real_replace, inner = os.replace, []

    def meanwhile(src, dst):  # the other write runs whole between this one's write and rename
        if not inner:
            inner.append(1)
            logs.replace_json(path, {"events": "the run's last"})
        real_replace(src, dst)
    monkeypatch.setattr(logs.os, "replace", meanwhile)
    logs.replace_json(path, {"events": "a checkpoint's"})
    assert json.loads(path.read_text()) == {"events": "a checkpoint's"}
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]


def test_a_group_on_two_hosts_is_named_by_the_host_whose_agent_exited_first(tmp_path):
    """A rank killed on host B (OOM, -9) makes host A's ranks fail in their collectives, and
    A's torchrun names one of them: the group's error read host A's report first, whichever
    agent had exited first, and named a follower (rank 0, exit 1)."""
    from asyncrl.controller.launcher import Agent, HostAgents

    agents, exits = [], {}
    for host, rank, code in (("A", 0, 1), ("B", 2, -9)):
        log = tmp_path / f"g.{host}.log"
        log.write_text(f"{host}: Traceback\nRoot Cause (first observed failure):\n"
                       f"  rank      : {rank} (local_rank: 0)\n  exitcode  : {code} (pid: 9)")
        agent = Agent("g", 2, {}, log, die_with_parent=False, command=["true"], host=host)
        agent.start = lambda on_exit, host=host: exits.__setitem__(host, on_exit)
        agents.append(agent)
    group, reported = HostAgents(agents), []
    group.start(reported.append)
    exits["B"](1)
    exits["A"](1)  # (reported once: the first)
    assert reported == [1] and group.root_cause() == (2, -9)
    assert group.tail().startswith("B: Traceback")


def test_a_rank_whose_output_pipe_has_a_descriptor_past_1024_still_streams():
    """select() refuses a descriptor >= 1024 (a group of ~1000 ranks: gloo's sockets take
    the low ones): the reader died at once, the pipe filled, and every print blocked."""
    script = """if True:
        import json, os, resource, threading
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        from asyncrl.actors.output import OutputCapture
        sent, through = [], threading.Event()
        capture = OutputCapture(lambda lines, dropped: (
            sent.extend(lines), "last" in lines and through.set()))
        capture.start()
        assert capture._read_fd >= 1024, capture._read_fd
        for i in range(2000):  # ~200 KB: more than a pipe holds
            print(f"line {i:04d} " + "x" * 90)
        print("last", flush=True)
        assert through.wait(30)
        capture.close()
        os.write(capture._original, ("sent %d\\n" % len(sent)).encode())
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "sent 2001"


class PausedConsole:
    """stderr of a console that does not read until `reading` is set (a paused `| less`);
    what it wrote, in `shown`."""

    def __init__(self) -> None:
        self.reading, self.shown = threading.Event(), []
        self.test_thread = threading.get_ident()

    def write(self, text: str) -> None:
        # paused, written on the caller's thread, it would block there (the controller's
        # loop): a failure at once, not a 60 s wait per write
        assert self.reading.is_set() or threading.get_ident() != self.test_thread, \
            "a paused console written on the caller's thread"
        self.reading.wait(60)
        self.shown.append(text)

    def flush(self) -> None:
        pass


def test_a_console_that_does_not_read_never_stops_the_controller(tmp_path, monkeypatch):
    """The echo wrote stderr on the controller's loop: a paused `| less` or Ctrl-S stopped
    every call and heartbeat (the ranks gave up on the controller after their timeout). It
    is queued now; what the console could not take is counted and said when it reads."""
    paused = PausedConsole()
    monkeypatch.setattr(sys, "stderr", paused)
    reading, shown = paused.reading, paused.shown
    sink = LogSink(tmp_path, lines_per_s=1e9, burst=10**9)
    for i in range(3000):  # returns at once, whatever the console does
        sink.write("g", 0, [f"line {i}"])
    assert not shown
    reading.set()  # it reads again
    wait_until(lambda: not sink.console._queue.qsize(), 30, "the console to catch up")
    sink.write("g", 0, ["after"])
    sink.close()
    text = "".join(shown)
    assert "g:0 | line 0\n" in text and text.endswith("g:0 | after\n")
    lost = int(re.search(r"\[asyncrl\] (\d+) lines were not shown \(the console did not "
                         r"keep up\)", text)[1])
    assert lost + text.count("g:0 | line ") == 3000  # each line shown or counted
    assert (tmp_path / "g" / "rank0.log").read_text().count("line ") == 3000
    reading.clear()  # paused again, then the run closes once it reads: the count is said
    shown.clear()
    sink = LogSink(tmp_path, lines_per_s=1e9, burst=10**9)
    for i in range(3000):
        sink.write("h", 0, [f"line {i}"])
    reading.set()
    sink.close()
    assert re.search(r"\[asyncrl\] \d+ lines were not shown", "".join(shown))


def test_a_console_gone_at_close_and_a_ranks_notices_and_drops(tmp_path, capsys, monkeypatch):
    """Closing a group or the run wrote the hidden-lines count to a console gone (a closed
    pipe): BrokenPipeError out of the close, its files left open. A rank's own [asyncrl]
    notice (a breakpoint waiting for `asyncrl attach`) was hidden by the rate limit; lines
    the rank could not stream were said in its file only."""
    sink = LogSink(tmp_path, lines_per_s=0.001, burst=3)
    sink.write("g", 0, [f"l{i}" for i in range(10)] + ["[asyncrl] g:0 waits for a debugger"],
               dropped=4)
    sink.console.close()
    err = capsys.readouterr().err
    assert "g:0 | [asyncrl] g:0 waits for a debugger" in err
    assert "g:0 | [asyncrl] 4 lines were not streamed (over the rank's limit, or its queue " \
           "full): they are only in the group's torchrun log" in err

    class Gone(PausedConsole):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Gone())
    sink.write("g", 1, [f"m{i}" for i in range(10)])
    sink.close_group("g")
    sink.close()
    assert sink._files == {} and not sink.echo
    assert (tmp_path / "g" / "rank1.log").read_text().count("m") == 10


def test_the_progress_line_goes_through_the_console_thread(tmp_path, monkeypatch):
    """The progress line, a line a step, was printed on the controller's loop: a console
    that does not read stopped the loop there too."""
    from asyncrl.controller.launch import Metrics
    from asyncrl.controller.timeline import Timeline

    paused = PausedConsole()
    monkeypatch.setattr(sys, "stderr", paused)
    reading, shown = paused.reading, paused.shown
    sink = LogSink(tmp_path, lines_per_s=1e9, burst=10**9)
    metrics = Metrics(tmp_path, 3, Timeline(), trackers=[])
    metrics.say = sink.console.write  # as asyncrl launch sets it
    sink.write("g", 0, ["a rank's line"])
    for step in range(3):  # returns at once, whatever the console does
        metrics(step, {"train": {"loss": 1.0}}, 0.5)
    assert not shown
    reading.set()
    sink.close()
    text = "".join(shown)
    assert text.index("g:0 | a rank's line") < text.index("step 1/3") < text.index("step 3/3")


def test_a_trackers_notices_go_through_the_console_thread(tmp_path, monkeypatch):
    """A tracker's notice (TensorBoard or wandb failing mid-run) was printed on the
    controller's loop: a console that does not read stopped the loop there too."""
    from asyncrl.controller.trackers import TensorBoard

    class Broken:
        def add_scalar(self, *args):
            raise OSError(28, "No space left on device")
    paused = PausedConsole()
    monkeypatch.setattr(sys, "stderr", paused)
    sink, board = LogSink(tmp_path, lines_per_s=1e9, burst=10**9), TensorBoard(tmp_path)
    board.say, board.writer = sink.console.write, Broken()  # as asyncrl launch sets it
    board.log(0, {"loss": 1.0})  # returns at once, whatever the console does
    assert not paused.shown
    paused.reading.set()
    sink.close()
    assert "tensorboard: logging step 0 failed (OSError" in "".join(paused.shown)


def test_the_controllers_notices_go_through_the_console_thread(tmp_path, monkeypatch):
    """A restart's, a rewind's or a checkpoint's notice was printed on the controller's loop:
    a console that does not read stopped the loop there (the heartbeats with it). They go
    through the console's thread now, in order with the ranks' lines; after the console
    closed, or with no controller, they are written at once."""
    from types import SimpleNamespace

    from asyncrl.controller.logs import say

    paused = PausedConsole()
    monkeypatch.setattr(sys, "stderr", paused)
    sink = LogSink(tmp_path / "logs", lines_per_s=1e9, burst=10**9)
    sink.write("g", 0, ["a rank's line"])
    say(SimpleNamespace(logs=sink), "[asyncrl] restarting group 'g' (1/2) in 1 s: gone")
    assert not paused.shown  # returned at once, whatever the console does
    paused.reading.set()
    sink.close()
    assert "".join(paused.shown) == \
        "g:0 | a rank's line\n[asyncrl] restarting group 'g' (1/2) in 1 s: gone\n"
    # in the logs too (a console that did not keep up may have missed it)
    assert (tmp_path / "controller.log").read_text() == \
        "[asyncrl] restarting group 'g' (1/2) in 1 s: gone\n"
    say(SimpleNamespace(logs=sink), "after the close")
    say(None, "without a controller")
    assert "".join(paused.shown).endswith("after the close\nwithout a controller\n")


def test_a_full_disk_at_a_groups_close_neither_raises_nor_keeps_files(tmp_path, capsys):
    """A rank's file whose write failed (a full disk: said once a group, the run goes on)
    failed again at its close, which flushes: close_group raised in the reaping of a dead
    group (a restart became the run's failure), and close left the other files open and the
    console's last lines unwritten."""
    keys = [(group, rank) for group in ("g", "h") for rank in (0, 1)]
    for group, rank in keys:
        (tmp_path / group).mkdir(exist_ok=True)
        (tmp_path / group / f"rank{rank}.log").symlink_to("/dev/full")
    sink = LogSink(tmp_path)
    for group, rank in keys:
        sink.write(group, rank, [f"a line of {group}:{rank}"])
    files = dict(sink._files)
    assert len(files) == 4
    sink.close_group("g")
    assert sorted(sink._files) == [("h", 0), ("h", 1)]
    assert files["g", 0].closed and files["g", 1].closed
    sink.close()
    assert sink._files == {} and all(f.closed for f in files.values())
    err = capsys.readouterr().err  # (the console's thread has written it all by its close)
    assert all(f"{g}:{r} | a line of {g}:{r}" in err for g, r in keys)
    assert err.count("[asyncrl] writing") == 2  # once a group


def test_a_ranks_escape_sequences_are_shown_escaped_not_obeyed(tmp_path, capsys):
    """A rank's control characters reached the terminal byte for byte: OSC 0 set the
    window's title (OSC 52 the clipboard), CSI 2J cleared the screen, tqdm's cursor-up wrote
    over other ranks' lines; a remote error's text in the controller's notices too; and
    `asyncrl logs` on a terminal. They are shown escaped; the rank's file keeps them as
    printed, and `asyncrl logs` writes them so to a pipe or a file. Colours pass (they were
    escaped too: a rank forcing colour showed \x1b[32m... on every line), reset at the end
    of a line that leaves one on."""
    from types import SimpleNamespace

    from asyncrl.controller.logs import say

    raw = "t \x1b]0;pwned\x07 \x1b[2J \x9b31m\t\x1b[31mred\x1b[0m \x1b[1;32mend"
    sink = LogSink(tmp_path / "logs")
    sink.write("g", 0, [raw])
    say(SimpleNamespace(logs=sink), f"[asyncrl] group 'g' failed: {raw}")
    sink.close()
    say(None, raw)  # no controller: stderr itself
    err = capsys.readouterr().err
    assert not {"\x07", "\x9b"} & set(err), repr(err)
    shown = "t \\x1b]0;pwned\\x07 \\x1b[2J \\x9b31m\t\x1b[31mred\x1b[0m \x1b[1;32mend\x1b[0m"
    assert err.splitlines() == [f"g:0 | {shown}", f"[asyncrl] group 'g' failed: {shown}",
                                shown]
    assert (tmp_path / "logs" / "g" / "rank0.log").read_text() == raw + "\n"
    command = [sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group", "g",
               "--rank", "0"]
    piped = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert piped.returncode == 0 and piped.stdout == raw + "\n", piped.stderr
    assert on_a_terminal(command) == (0, f"{shown}\r\n".encode())


def on_a_terminal(command: list[str]) -> tuple[int, bytes]:
    """`command` run with a pseudo-terminal for its stdout and stderr: its exit code, and
    what it wrote there (the terminal turns each newline into CRLF)."""
    import pty
    import select

    leader, follower = pty.openpty()
    shown = b""
    try:
        with subprocess.Popen(command, stdout=follower, stderr=follower, cwd=ROOT) as proc:
            try:
                os.close(follower)
                follower = -1
                while select.select([leader], [], [], 60)[0]:  # to its end: EIO once the
                    try:  # command exited (its side of the terminal closed)
                        shown += os.read(leader, 4096)
                    except OSError:
                        break
                return proc.wait(60), shown
            finally:
                if proc.poll() is None:  # (failed midway)
                    proc.kill()
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)



def test_a_thousand_printing_ranks_leave_the_controller_descriptors_to_write_with(tmp_path):
    """A file held open per printing rank took every descriptor (the soft limit, 1024, kept)
    at ~1000 ranks: metrics.jsonl's append, every open after, failed with EMFILE."""
    script = """if True:
        import resource, sys
        from pathlib import Path
        from asyncrl.actors.procs import raise_open_file_limit
        from asyncrl.controller.logs import LogSink, append_line
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 300))  # a low hard limit too
        raise_open_file_limit()  # as the controller starts
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, 300)
        sink = LogSink(Path(sys.argv[1]), echo=False)  # 400 ranks: some files kept open
        for rank in [*range(400), 0]:  # (rank 0's file closed meanwhile: appended to)
            sink.write("g", rank, [f"rank {rank}"])
        append_line(Path(sys.argv[1]) / "metrics.jsonl", "{}")
        sink.close()
    """
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all((tmp_path / "g" / f"rank{r}.log").read_text() == f"rank {r}\n" * (1 + (r == 0))
               for r in range(400))


def test_a_group_name_with_a_newline_at_its_end_is_refused():
    """Its pattern ended in "$", which matches before a last newline too: "actor\\n" passed."""
    from asyncrl.controller.logs import check_group_name

    check_group_name("actor")
    for name in ("actor\n", "\nactor"):
        with pytest.raises(ValueError, match="use letters, digits"):
            check_group_name(name)


def test_rank_logs_stay_open_up_to_a_quarter_of_the_open_file_limit(tmp_path, monkeypatch):
    """A fixed 256 made every write past 256 printing ranks reopen its file (20x slower)."""
    from asyncrl.controller import logs

    opened = []
    monkeypatch.setattr(logs.resource, "getrlimit", lambda kind: (8192, 8192))
    monkeypatch.setattr(logs, "open", lambda *a, **k: opened.append(a[0]) or open(*a, **k),
                        raising=False)
    sink = LogSink(tmp_path, echo=False)
    for rank in [*range(1000)] * 3:
        sink.write("g", rank, ["x"])
    sink.close()
    assert len(opened) == 1000 and (tmp_path / "g" / "rank999.log").read_text() == "x\n" * 3
