"""A checkpoint's save and load on every group: each ends before a failure is raised."""

from __future__ import annotations

import asyncio
import types

import pytest

from asyncrl.controller import checkpoint
from asyncrl.errors import GroupDeadError


def _flow(loop, done):
    """A stand-in flow of a live group whose save or load takes a while, listed before a
    dead group (GroupHandle.call refuses a dead group's call as it is made)."""
    class Live:
        dead = None

        def _slow(self, path):
            async def go():
                await asyncio.sleep(0.2)
                done.append(path)
            return loop.create_task(go())
        save_checkpoint = load_checkpoint = _slow

    class Dead:
        dead = GroupDeadError("scorer", 0, -9, "killed")

        def _refused(self, path):
            raise GroupDeadError("scorer", 0, -9, "killed")
        save_checkpoint = load_checkpoint = _refused

    return types.SimpleNamespace(
        positions=lambda: {}, _ctl=None, launch_options={},
        groups=[types.SimpleNamespace(name="trainer", handle=Live()),
                types.SimpleNamespace(name="scorer", handle=Dead())])


def test_a_dead_groups_refused_save_or_load_waits_for_the_live_groups(tmp_path):
    """A group dead as the save began raised at once while the trainer still wrote its
    state: a resave (after ~63 s) took the live save for hung and respawned it; a rewind's
    load went on in the live groups while the dead one was respawned, then loaded again."""
    async def main():
        loop, done = asyncio.get_running_loop(), []
        flow = _flow(loop, done)
        with pytest.raises(GroupDeadError, match="scorer"):
            await checkpoint.save(flow, tmp_path / "run", 3)
        saved = list(done)
        with pytest.raises(GroupDeadError, match="scorer"):
            await checkpoint.restore(flow, tmp_path / "run", {"step": 3})
        return saved, done
    saved, done = asyncio.run(main())
    assert len(saved) == 1 and len(done) == 2  # each live call ended before the raise
