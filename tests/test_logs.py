"""Ranks' output: streamed to the controller, prefixed on its console, kept per rank in the
run directory, rate-limited on the console only, and read back with `asyncrl logs`."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT, assert_gone, group_pids, poll_until, run

import asyncrl
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
    assert err[:3] == ["g:0 | l0", "g:0 | l1", "g:0 | l2"] and len(err) == 4
    assert "lines not shown" in err[3] and str(tmp_path / "g" / "rank0.log") in err[3]
    assert (tmp_path / "g" / "rank0.log").read_text().splitlines() == [f"l{i}" for i in range(10)]


def test_asyncrl_logs_prints_a_rank_log_and_names_the_known_ones(tmp_path):
    sink = LogSink(tmp_path / "logs", echo=False)
    sink.write("actor", 1, ["first", "second", "third"])
    sink.close()
    out = subprocess.run([sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group",
                          "actor", "--rank", "1", "--tail", "2"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.splitlines() == ["second", "third"]
    bad = subprocess.run([sys.executable, "-m", "asyncrl", "logs", str(tmp_path), "--group",
                          "critic", "--rank", "0"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert bad.returncode != 0 and "actor:1" in bad.stderr
