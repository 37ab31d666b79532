"""Placement on one described host: which GPUs or cores each group gets, constraints,
what a closed or respawned group frees, and the GPU ids the ranks are given; over a
cluster's hosts: which hosts are suspected, one machine listed twice, GPUs a host lacks,
rendezvous ports, and the controller's address (more in test_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket

import psutil
import pytest
from helpers import NoLogFolder

import asyncrl
import asyncrl.controller.cluster as cluster_module
from asyncrl.controller.cluster import Cluster, HostSpec
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
    apart.forget("ref")  # reward, placed separate_from(ref), holds GPUs 1 and 2
    with pytest.raises(asyncrl.PlacementError, match=re.escape(
            "apart from 'reward' (placed separate_from(ref)), but only 0")):
        apart.place("ref", 1, asyncrl.separate_from("actor"))
    apart.forget("reward")
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


# -- over a cluster's hosts -------------------------------------------------------------------
def _loopback_hosts() -> Cluster:
    return Cluster([HostSpec(f"host{c}", "127.0.0.1", cpus=1, via="local") for c in "ABC"])


def test_a_host_that_started_no_rank_is_suspected(monkeypatch):
    """A host whose agent never started a rank (ssh exited 255; an agent hung at the
    rendezvous until the startup timeout) was never suspected: spread picked it again (the
    least used, first listed) and recovery spent its restarts there."""
    import asyncrl.controller.launcher as launcher

    real, broken = launcher.torchrun_command, {"hostA": ["sh", "-c", "exit 255"]}
    monkeypatch.setattr(launcher, "torchrun_command",
                        lambda host, *a, **k: broken.get(host.name) or real(host, *a, **k))

    async def main():
        async with asyncrl.Controller(cluster=_loopback_hosts(), echo_logs=False) as ctl:
            with pytest.raises(asyncrl.SpawnError, match="exited with code 255"):
                await ctl.spawn(_Idle, nprocs=1, name="g")
            g = await ctl.spawn(_Idle, nprocs=1, name="g")
            hosts = [a.host for a in g.agent.agents]  # hostB, not hostA again
            broken.clear()
            broken["hostC"] = ["sleep", "60"]  # (its agent says nothing: hangs)
            ctl.startup_timeout = 2.0
            with pytest.raises(asyncrl.SpawnTimeout):
                await ctl.spawn(_Idle, nprocs=1, name="h")  # the least used: hostC
            ctl.startup_timeout = 30.0
            h = await ctl.spawn(_Idle, nprocs=1, name="h")  # hostA works now; hostC hung
            return hosts + [a.host for a in h.agent.agents]
    assert asyncio.run(asyncio.wait_for(main(), 120)) == ["hostB", "hostA"]


def test_gpu_slots_a_host_does_not_have_are_refused(tmp_path, monkeypatch):
    """A hosts file giving a host more GPUs than it has: slot 5 became
    CUDA_VISIBLE_DEVICES=5, CUDA found no device, and the rank ran gloo on the CPU."""
    import torch

    from asyncrl.actors.gpu_slots import check_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    check_gpus([], {})  # no slots: not a cluster group's GPU rank
    env = {"ASYNCRL_HOST_NAME": "n2", "CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(RuntimeError, match=r"host n2: .*GPU\(s\) \(5, .*\), but CUDA sees 0"
                                           r".*real number of GPUs in the hosts file"):
        check_gpus(["5"], env)
    async def main():  # a rank given a GPU slot its host hides (any machine: GPU 99)
        cluster = Cluster([HostSpec("g1", "127.0.0.1", gpus=1, via="local")])
        async with asyncrl.Controller(cluster=cluster, echo_logs=False) as ctl:
            with pytest.raises(asyncrl.SpawnError, match=r"host g1: the group was given 1 "
                                                         r"of its GPU\(s\) \(0, CUDA_VISIBLE"
                                                         r"_DEVICES=99 here\), but CUDA sees 0"):
                await ctl.spawn(_Idle, nprocs=1, name="g", env={"CUDA_VISIBLE_DEVICES": "99"})
    asyncio.run(asyncio.wait_for(main(), 60))
    hosts = tmp_path / "hosts.json"  # a local host is this machine: its GPUs are known
    hosts.write_text(json.dumps({"hosts": [{"name": "ctl", "address": "127.0.0.1", "gpus": 8,
                                            "via": "local"}]}))
    with pytest.raises(ValueError, match=r"hosts.json: host 'ctl' is this machine \(via "
                                         r"'local'\), which has 0 GPU\(s\) visible, but "
                                         r"\"gpus\" gives it 8: give it its real number"):
        Cluster.from_file(hosts)


def test_a_controller_name_that_resolves_to_loopback_is_refused_for_remote_hosts(
        tmp_path, monkeypatch):
    """Debian names its machine 127.0.1.1: a controller at that name was accepted, remote
    ranks connected to their own machine, and each spawn waited out its startup timeout."""
    import argparse

    from asyncrl import cli

    monkeypatch.setattr(cluster_module, "addresses", lambda name: {"127.0.1.1"})
    remote = Cluster([HostSpec("n1", "10.0.0.1", cpus=4, via="ssh")])
    with pytest.raises(ValueError, match=rf"got '{socket.gethostname()}' \(it resolves here "
                                         r"to 127\.0\.1\.1\).*routable address.*"
                                         r"--controller-address"):
        asyncrl.Controller(host=socket.gethostname(), cluster=remote)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"hosts": [{"name": "n1", "address": "10.0.0.1"}]}))
    given = argparse.Namespace(hosts=str(hosts), controller_address="myhost")
    with pytest.raises(SystemExit, match=r"--controller-address myhost \(it resolves here to "
                                         r"127\.0\.1\.1\), an address other machines cannot"):
        cli.launch_cluster(given)
    monkeypatch.setattr(cluster_module, "addresses", lambda name: None)
    with pytest.raises(ValueError, match=r"got 'nowhere' \(it does not resolve here\)"):
        asyncrl.Controller(host="nowhere", cluster=remote)


def test_a_local_gpu_host_and_an_ssh_host_at_this_machines_address_are_refused():
    """A local host named 'vm' and an ssh host at this machine's LAN address: neither
    address was resolved nor recognised as this machine's, and both handed out GPUs 0-7."""
    mine = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127."))
    if not mine:
        pytest.skip("this machine has no IPv4 address beyond loopback")
    with pytest.raises(ValueError, match=r"GPU hosts \['ctl', 'n1'\] are one machine \(this "
                                         r"machine\): list each machine once"):
        Cluster([HostSpec("ctl", "vm", gpus=8, via="local"),
                 HostSpec("n1", mine[0], gpus=8, via="ssh")])


def test_rendezvous_ports_held_by_placed_groups_are_not_drawn_again(tmp_path, monkeypatch):
    """A remote first host's rendezvous port was drawn at random with no record of those
    the groups placed there held: two groups could meet at one endpoint."""
    from asyncrl.controller.launcher import cluster_agents

    draws = iter([25000, 25000, 26000, 25000])
    monkeypatch.setattr(random.SystemRandom, "randint", lambda self, lo, hi: next(draws))
    cluster = Cluster([HostSpec("n1", "10.0.0.1", cpus=4, via="ssh")])

    def endpoint(group: str) -> str:  # (commands only: nothing starts)
        agents = cluster_agents(cluster, group, 1, {}, tmp_path, "run", die_with_parent=False)
        return agents.agents[0].command()[-1].split("--rdzv-endpoint ")[1].split()[0]
    assert endpoint("a") == "10.0.0.1:25000"
    assert endpoint("b") == "10.0.0.1:26000"  # 25000 is a's
    cluster.forget("a")
    assert endpoint("c") == "10.0.0.1:25000"  # a's, released


def test_a_spawn_with_a_bad_env_is_refused_before_it_is_placed():
    """env=["A=1"] raised TypeError after placement: the group stayed placed (a later
    separate_from it was satisfied by a group that never ran)."""
    async def main():
        async with asyncrl.Controller(echo_logs=False) as ctl:
            with pytest.raises(TypeError) as bad:
                await ctl.spawn(_Idle, nprocs=1, name="idle", env=["A=1"])
            assert ctl.placer.placed == {}  # (refused after placement: placed, never run)
            assert "group 'idle': env= maps names to values, like {'NAME': 'value'}; got a " \
                "list" in str(bad.value)
            with pytest.raises(TypeError, match=r"env=\{'A': 1\}: environment names and values "
                                                r"are str; pass 'A': '1'"):
                await ctl.spawn(_Idle, nprocs=1, name="idle", env={"A": 1})
            return dict(ctl.placer.placed)
    assert asyncio.run(asyncio.wait_for(main(), 60)) == {}
