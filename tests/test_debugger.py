"""breakpoint() inside a worker: the rank waits, `asyncrl attach` reaches its pdb, the call
completes after `c`; the group's next call waits, another group goes on."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from helpers import ROOT, assert_gone, group_pids, poll_until, run

import asyncrl


class Stops(asyncrl.Worker):
    @asyncrl.register
    def compute(self, x: int) -> int:
        y = x * 2
        breakpoint()
        return y + 1

    @asyncrl.register
    def ping(self) -> str:
        return "pong"


class Other(asyncrl.Worker):
    @asyncrl.register
    def ping(self) -> str:
        return "other pong"


def test_attach_drives_pdb_in_a_rank_and_the_call_completes(tmp_path):
    async def main():
        async with asyncrl.Controller(run_dir=tmp_path, echo_logs=False) as ctl:
            stops = await ctl.spawn(Stops, nprocs=1, name="stops")
            other = await ctl.spawn(Other, nprocs=1, name="other")
            pids = group_pids(stops) + group_pids(other)
            call = stops.compute(21)
            session = tmp_path / "debug" / "stops-0.json"
            await poll_until(session.is_file, 60, "the rank to wait for a debugger")
            info = json.loads(session.read_text())
            assert info["where"].endswith("in compute") and (session.stat().st_mode & 0o77) == 0
            later = stops.ping()  # waits behind the call in the debugger
            assert await other.ping() == ["other pong"]  # another group goes on
            assert not later.done() and not call.done()
            listing = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl", "attach", str(tmp_path), "--list", cwd=ROOT,
                stdout=asyncio.subprocess.PIPE)
            listed = (await listing.communicate())[0].decode()
            assert "stops:0" in listed and "in compute" in listed
            attach = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl", "attach", str(tmp_path), "--group", "stops",
                "--rank", "0", cwd=ROOT, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(attach.communicate(b"p y\nc\n"), 60)
            result = await call
            assert await later == ["pong"]
            return out.decode(), result, pids
    out, result, pids = run(main())
    assert_gone(pids)
    assert "attached to stops:0" in out and "42" in out and "continuing" in out
    assert result == [43]
    assert not (tmp_path / "debug" / "stops-0.json").exists()


def test_attach_says_who_waits_when_the_choice_is_wrong(tmp_path, capsys):
    from asyncrl.cli import main

    with pytest.raises(SystemExit, match="no rank waits for a debugger .* waiting: none"):
        main(["attach", str(tmp_path)])
