"""`asyncrl attach` when several ranks wait (a breakpoint() in SPMD code stops every rank of
its group): a terminal picks one from a numbered list; without one, the refusal names
--group and --rank. And with no RUN_DIR, the newest run under runs/ where a rank waits."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest


def _sessions(run_dir, *ranks: int) -> None:
    """Session files of ranks of group g that wait here (this live process's pid, a port
    nothing listens on: a connect is refused, as for a rank that just continued)."""
    debug = run_dir / "debug"
    debug.mkdir(mode=0o700, parents=True, exist_ok=True)
    for rank in ranks:
        (debug / f"g-{rank}-t.json").write_text(json.dumps({
            "group": "g", "rank": rank, "pid": os.getpid(), "host": "127.0.0.1", "port": 9,
            "token": "t", "where": f"flow.py:{rank + 3} in step", "thread": "MainThread",
            "since": float(rank)}))


def test_several_waiting_ranks_are_listed_and_the_number_given_is_attached(tmp_path):
    from asyncrl.controller.attach import choose, waiting

    _sessions(tmp_path, 0, 1, 2)
    prompts: list[str] = []
    answers = iter(["", "7", "x", "2"])  # asked again until a number of the list

    def ask(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    chosen = choose(waiting(tmp_path), None, None, ask=ask)
    assert (chosen["group"], chosen["rank"]) == ("g", 1)
    listed = prompts[0].splitlines()
    assert listed[0] == "several ranks wait for a debugger:"
    assert [line.split()[:2] for line in listed[1:4]] == [["1)", "g:0"], ["2)", "g:1"],
                                                        ["3)", "g:2"]]
    assert f"pid {os.getpid()}" in listed[2] and "thread MainThread" in listed[2] and \
        listed[2].endswith("at flow.py:4 in step")
    assert listed[4] == "attach to which (1-3)? "
    assert prompts[1:] == [f"{a!r} is none of them; give a number from 1 to 3: "
                           for a in ("", "7", "x")]
    with pytest.raises(LookupError, match="no rank chosen; pick one with --group and --rank"):
        choose(waiting(tmp_path), "g", None, ask=lambda prompt: (_ for _ in ()).throw(EOFError))


def test_attach_asks_on_a_terminal_and_refuses_without_one(tmp_path, monkeypatch, capsys):
    from asyncrl.cli import main

    _sessions(tmp_path, 0, 1)
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # no terminal: refused, as before
    with pytest.raises(SystemExit, match=r"several ranks wait for a debugger: g:0 .*, g:1 "
                                         r".*; pick one with --group and --rank"):
        main(["attach", str(tmp_path)])

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", lambda prompt: "2")
    # the choice is connected to (nothing listens on port 9: it "no longer waits")
    with pytest.raises(SystemExit, match=r"g:1 no longer waits at flow.py:4 in step"):
        main(["attach", str(tmp_path)])
    # no RUN_DIR: the newest run under runs/ where a rank waits
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no run under runs/ has a rank waiting"):
        main(["attach", "--list"])
    _sessions(tmp_path / "runs" / "old", 0)
    (tmp_path / "runs" / "quiet" / "debug").mkdir(parents=True)  # newer, none waits
    assert main(["attach", "--list"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("g:0  host 127.0.0.1") and out.out.count("\n") == 1
    assert "asyncrl attach: runs/old, the newest run under runs/ with a rank waiting" in \
        out.err
