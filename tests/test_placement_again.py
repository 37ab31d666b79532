"""A group placed again (closed, then spawned under its name; respawned) keeps to what the
placed groups asked of it; a colocated group's other constraints are judged on the GPUs its
ranks use; a worker parameter named as a runtime keyword (nice=, relay=) given a value is
refused. More placement in test_placement.py."""

from __future__ import annotations

import logging
import re

import pytest
from helpers import run

import asyncrl
from asyncrl.controller.placement import Host, Placer


def test_a_group_placed_again_stays_apart_from_those_placed_separate_from_it():
    """A on [0, 1], B separate_from(A) on [2, 3]; A closed and spawned again with 4 ranks
    was given [0, 1, 2, 3], B's GPUs too."""
    p = Placer(Host(4, (0, 1)))
    p.place("a", 2, None)
    b = p.place("b", 2, asyncrl.separate_from("a")).devices
    p.forget("a")
    with pytest.raises(asyncrl.PlacementError) as e:
        p.place("a", 4, None)
    assert "group 'a' needs 4 GPU(s) apart from 'b' (placed separate_from(a)), but only 2 " \
        "of this host's 4 are free of those groups" in str(e.value)
    assert "close ['b'] before placing 'a' again" in str(e.value)
    assert "a" not in p.placed
    again = p.place("a", 1, None).devices  # what fits beside b
    assert not set(again) & set(b)


def test_a_group_placed_again_goes_to_the_devices_of_those_colocated_with_it():
    """A on [0, 1], B colocate_with(A) on them; A spawned again with 1 rank was placed on
    the least used GPU, [2], and B stayed on [0, 1]."""
    p = Placer(Host(4, (0, 1)))
    p.place("a", 2, None)
    b = p.place("b", 2, asyncrl.colocate_with("a")).devices
    p.forget("a")
    assert p.place("a", 1, None).devices == b
    # its own constraints disagree with b's: refused, saying which group holds it
    p.forget("a")
    p.place("c", 1, asyncrl.separate_from("b"))
    with pytest.raises(asyncrl.PlacementError) as e:
        p.place("a", 1, asyncrl.colocate_with("c"))
    assert f"'b' (placed colocate_with(a), on {b})" in str(e.value)
    assert "close ['b'] before placing 'a' again" in str(e.value)
    assert "a" not in p.placed


def test_a_cpu_only_host_places_a_group_again_with_a_warning(caplog):
    p = Placer(Host(0, (0, 1, 2, 3)))
    p.place("a", 2, None)
    b = p.place("b", 2, asyncrl.separate_from("a")).devices
    p.forget("a")
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        p.place("a", 4, None)
    assert "apart from 'b' (placed separate_from(a))" in caplog.text
    assert "ranks will share cores" in caplog.text
    assert set(p.placed["b"]) == set(b)


def test_a_colocated_groups_constraints_are_judged_on_the_gpus_its_ranks_use():
    """ref's 2 ranks on actor's GPUs 0-3 use 0 and 1: separate_from(x), on GPU 2, holds;
    and 2 ranks on GPUs 2-5 use 2 and 3, within one nvlink_group(4) domain."""
    p = Placer(Host(4, (0, 1)))
    p.place("a", 2, None)  # 0, 1
    p.place("b", 2, None)  # 2, 3
    assert p.place("actor", 4, None).devices == [0, 1, 2, 3]
    assert p.place("x", 1, asyncrl.separate_from("a")).devices == [2]
    ref = p.place("ref", 2, [asyncrl.colocate_with("actor"), asyncrl.separate_from("x")])
    assert ref.devices == [0, 1, 2, 3]
    with pytest.raises(asyncrl.PlacementError, match=re.escape(  # 3 ranks: GPU 2 too
            "which conflicts with separate_from(x) (on [2])")):
        p.place("wide", 3, [asyncrl.colocate_with("actor"), asyncrl.separate_from("x")])
    p.forget("x")  # respawned: kept apart from the GPUs ref's ranks use, not all of actor's
    assert p.place("x", 1, asyncrl.separate_from("a")).devices == [2]
    nv = Placer(Host(8, (0, 1)))
    nv.place("small", 2, None)  # 0, 1
    assert nv.place("actor", 4, None).devices == [2, 3, 4, 5]  # domains 0-3 and 4-7
    assert nv.place("ref", 2, [asyncrl.colocate_with("actor"),
                               asyncrl.nvlink_group(4)]).devices == [2, 3, 4, 5]
    with pytest.raises(asyncrl.PlacementError, match="not within one NVLink domain"):
        nv.place("wide", 3, [asyncrl.colocate_with("actor"), asyncrl.nvlink_group(4)])


class Niced(asyncrl.Worker):
    def __init__(self, relay=None, *, nice=0):
        self.relay, self.nice = relay, nice


def test_a_runtime_keyword_that_the_worker_also_takes_is_refused_not_lost():
    """Issues 2 and 4 reserve nprocs, name, mesh, place and env; the runtime also takes
    relay, nice, max_restarts and restart_backoff, and a worker's own nice= or relay= went
    to it, the worker silently getting its default."""
    with pytest.raises(TypeError, match=re.escape(
            "asyncrl.group(): nice=5 is taken by the runtime, but Niced.__init__ also has a "
            "parameter 'nice', which would not get it; rename that parameter")):
        asyncrl.group(Niced, nice=5)
    with pytest.raises(TypeError, match="relay=True .* pass the worker's relay positionally"):
        asyncrl.group(Niced, relay=True)

    async def main():
        async with asyncrl.Controller() as ctl:
            with pytest.raises(TypeError, match=r"spawn\(\): relay=False is taken"):
                await ctl.spawn(Niced, relay=False)
            with pytest.raises(TypeError, match=r"spawn\(\): nice=3 is taken"):
                await ctl.spawn(Niced, nice=3)
            assert not ctl.groups  # refused before anything started
    run(main())


def test_a_roles_settings_are_checked_without_the_runtimes_relay():
    """group() keeps relay= in the worker's kwargs for spawn(), and gave it to the role's
    check_settings too: asyncrl.group(Critic, ..., relay=False) raised "unexpected keyword
    argument 'relay'" for every built-in role."""
    from asyncrl.controller.declare import declared_count, forget_declared_after
    from asyncrl.rl.critic import Critic

    count = declared_count()
    try:
        spec = asyncrl.group(Critic, model={"preset": "tiny-llama"}, relay=False)
    finally:
        forget_declared_after(count)  # (declared by no flow file)
    assert spec.kwargs.get("relay") is False


class Plain(asyncrl.Worker):
    def __init__(self, size=1):
        self.size = size


class Loose(asyncrl.Worker):
    def __init__(self, **options):
        self.options = options


def test_spawn_refuses_a_dataflows_restarts():
    """spawn(max_restarts=3) went to Plain(...) on every rank (a TypeError after the launch,
    blamed on the worker), or into a **kwargs worker's options: restarts are a DataFlow's."""
    async def main():
        async with asyncrl.Controller() as ctl:
            with pytest.raises(TypeError, match=r"spawn\(\): max_restarts=3: Plain.__init__ "
                                                r"has no parameter 'max_restarts'.*asyncrl.group"):
                await ctl.spawn(Plain, max_restarts=3)
            with pytest.raises(TypeError, match=r"spawn\(\): restart_backoff=2.0: Loose.__init__ "
                                                r"has no parameter"):
                await ctl.spawn(Loose, restart_backoff=2.0)
            assert not ctl.groups  # refused before anything started
    run(main())
