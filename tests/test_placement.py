"""Placement on one described host: which GPUs or cores each group gets, constraints,
what a closed or respawned group frees, and the GPU ids the ranks are given."""

from __future__ import annotations

import asyncio
import re

import pytest
from helpers import NoLogFolder

import asyncrl
from asyncrl.controller.placement import Host, Placer


def test_placement_forget_frees_exactly_what_place_counted():
    p = Placer(Host(8, (0, 1)))
    assert p.place("actor", 4, None).devices == [0, 1, 2, 3]
    # 2 ranks on actor's 4 GPUs: ranks use GPUs 0 and 1, and closing it frees those two
    assert p.place("ref", 2, asyncrl.colocate_with("actor")).devices == [0, 1, 2, 3]
    p.forget("ref")
    assert p.place("next", 2, None).devices == [4, 5]  # not actor's GPUs 2, 3
    # share_gpus: 4 ranks on 2 GPUs count twice each, and are forgotten twice each
    p.place("shared", 4, asyncrl.share_gpus(2))
    p.forget("shared")
    p.forget("next")
    assert {d: n for d, n in p._use.items() if n} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert p.place("last", 4, None).devices == [4, 5, 6, 7]


def test_placement_names_the_gpus_the_controller_was_given():
    """Under SLURM (CUDA_VISIBLE_DEVICES=4,5,6,7) the first group went to physical GPUs 0
    and 1, outside the job's allocation: the ranks' list now names the controller's GPUs."""
    slurm = Placer(Host(4, (0, 1), ("4", "5", "6", "7")))
    assert slurm.place("actor", 2, None).env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert slurm.place("ref", 1, None).env == {"CUDA_VISIBLE_DEVICES": "6"}
    uuids = Placer(Host(2, (0, 1), ("GPU-aa", "GPU-bb")))
    assert uuids.place("a", 1, asyncrl.share_gpus(2)).env == {"CUDA_VISIBLE_DEVICES": "GPU-aa"}
    assert Placer(Host(2, (0, 1))).place("b", 2, None).env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_placement_of_a_respawned_group_goes_back_where_it_was():
    """A dead group respawned after a rewind was placed on the least-used GPUs again: the
    groups colocated with it stayed on its old ones (the hybrid engine's CUDA IPC apart),
    and one kept separate_from it could end up sharing its new ones."""
    p = Placer(Host(4, (0, 1)))
    assert p.place("actor", 2, None).devices == [0, 1]
    assert p.place("rollout", 2, asyncrl.colocate_with("actor")).devices == [0, 1]
    assert p.place("critic", 1, None).devices == [2]
    p.forget("actor")  # died: closed, then spawned again with its own place=
    assert p.place("actor", 2, None).devices == [0, 1]  # least used: [3, 0]
    # a group nobody placed itself with respect to: closed, its name taken again by a new
    # group, placed afresh (not onto the GPUs another took meanwhile)
    eight = Placer(Host(8, (0, 1)))
    eight.place("eval", 2, None)
    eight.place("train", 2, None)
    eight.forget("eval")
    assert eight.place("gen", 2, None).devices == [0, 1]
    assert eight.place("eval", 2, None).devices == [4, 5]
    apart = Placer(Host(3, (0, 1)))
    apart.place("actor", 1, None)
    assert apart.place("reward", 2, asyncrl.separate_from("actor")).devices == [1, 2]
    apart.place("ref", 1, asyncrl.colocate_with("actor"))
    apart.forget("actor")
    assert apart.place("actor", 1, None).devices == [0]  # not reward's GPU 1
    # where it was no longer meets what it asks now: placed afresh
    apart.forget("reward")
    assert apart.place("reward", 2, asyncrl.separate_from("ref")).devices == [1, 2]
    apart.forget("ref")
    assert apart.place("ref", 1, asyncrl.separate_from("actor")).devices == [1]


def test_placement_nvlink_group_stays_within_one_aligned_domain():
    p = Placer(Host(8, (0, 1)))
    p.place("small", 2, None)  # GPUs 0, 1
    assert p.place("nv", 4, asyncrl.nvlink_group(4)).devices == [4, 5, 6, 7]  # not 2-5
    assert p.place("nv2", 2, asyncrl.nvlink_group(2)).devices == [2, 3]
    apart = Placer(Host(8, (0, 1)))
    apart.place("a", 2, None)  # GPUs 0, 1
    apart.place("b", 2, asyncrl.separate_from("a"))  # GPUs 2, 3
    apart.place("c", 1, None)  # GPU 4
    # 6 GPUs are free of a and c, but no aligned block of 4 holds 4 of them
    with pytest.raises(asyncrl.PlacementError) as e:
        apart.place("nv", 4, [asyncrl.nvlink_group(4), asyncrl.separate_from("a"),
                              asyncrl.separate_from("c")])
    assert "nvlink_group(4) needs its 4 GPU(s) within one NVLink domain" in str(e.value)
    assert "GPUs 0-3, 4-7" in str(e.value) and "drop nvlink_group" in str(e.value)
    assert "nv" not in apart.placed
    # colocated on GPUs of two domains
    apart.place("d", 2, None)  # GPUs 5, 6
    with pytest.raises(asyncrl.PlacementError, match=re.escape(
            "colocate_with(d) puts it on GPUs [5, 6], which are not within one NVLink domain")):
        apart.place("co", 2, [asyncrl.colocate_with("d"), asyncrl.nvlink_group(2)])


def test_placement_refuses_more_ranks_than_colocated_gpus_without_share_gpus():
    p = Placer(Host(8, (0, 1)))
    p.place("actor", 2, None)
    with pytest.raises(asyncrl.PlacementError) as e:
        p.place("ref", 4, asyncrl.colocate_with("actor"))
    assert "group 'ref': colocate_with(actor) puts its 4 ranks on the 2 GPU(s) [0, 1], 2 " \
        "ranks per GPU" in str(e.value)
    assert "nprocs <= 2" in str(e.value) and "asyncrl.share_gpus(2)" in str(e.value)
    assert "ref" not in p.placed
    assert p.place("ref", 4, [asyncrl.colocate_with("actor"), asyncrl.share_gpus(2)]).env == \
        {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert p.place("hybrid", 2, asyncrl.colocate_with("actor")).devices == [0, 1]


class _Idle(asyncrl.Worker):
    pass


def test_placement_of_a_group_whose_agent_failed_to_start_is_freed(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    async def main():
        async with NoLogFolder(echo_logs=False) as ctl:
            ctl.blocker = str(blocker)
            with pytest.raises(FileExistsError, match="not-a-folder"):  # (not a timeout)
                await ctl.spawn(_Idle, nprocs=1, name="idle")
            assert ctl.groups == {} and ctl.placer.placed == {}
            assert not any(ctl.placer._use.values())
    asyncio.run(asyncio.wait_for(main(), 60))
