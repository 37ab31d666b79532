"""Beyond one machine: cluster descriptions, SLURM, the per-host torchrun commands, and a
group spread over two "hosts" on loopback that rendezvous through --rdzv-endpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, NoLogFolder, assert_gone, group_pids, poll_until, run, wait_until

import asyncrl
from asyncrl import TensorBatch
from asyncrl.actors.gpu_slots import select_gpus
from asyncrl.controller.cluster import (
    Cluster,
    HostSpec,
    expand_nodelist,
    free_port,
    lifeline_env,
    torchrun_command,
)
from asyncrl.controller.launcher import host_env, kill_pids, pid_alive


def test_slurm_node_lists_expand():
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07",
                                                      "gpu5"]
    assert expand_nodelist("a1") == ["a1"]
    # text after a range, and several ranges (the last fastest, as scontrol expands them)
    assert expand_nodelist("gpu[1-2]-ib,x") == ["gpu1-ib", "gpu2-ib", "x"]
    assert expand_nodelist("r[1-2]-n[08-09]") == ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]


def test_a_slurm_allocation_becomes_a_cluster_launched_with_srun():
    env = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_CPUS_ON_NODE": "64(x2)"}
    cluster = Cluster.from_slurm(env)
    assert cluster is not None
    assert [(h.name, h.gpus, h.cpus, h.via) for h in cluster.hosts] == [
        ("gpu1", 8, 64, "srun"), ("gpu2", 8, 64, "srun")]
    assert Cluster.from_slurm({}) is None
    # one node, this one: placed as one host (colocated groups share its GPUs; as a cluster
    # each group took GPUs of its own and colocate_with was refused); from a login node
    # (salloc's shell) the node is another machine
    one = {"SLURM_JOB_NODELIST": "gpu7", "SLURM_GPUS_ON_NODE": "8"}
    assert Cluster.from_slurm(one, here="gpu7.cluster.example") is None
    assert [h.name for h in Cluster.from_slurm(one, here="login1").hosts] == ["gpu7"]
    assert len(Cluster.from_slurm(env, here="gpu1").hosts) == 2
    assert Cluster.from_slurm({**one, "SLURMD_NODENAME": "gpu7"}) is None  # (SLURM's own name)
    # each node's own CPUs (SLURM_CPUS_ON_NODE is this node's only), and GPUs asked per
    # node; GPUs asked for the job whose split over the nodes is not known here: refused
    mixed = {"SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_JOB_CPUS_PER_NODE": "64(x2),32",
             "SLURM_CPUS_ON_NODE": "64", "SLURM_GPUS_PER_NODE": "a100:4"}
    assert [(h.gpus, h.cpus) for h in Cluster.from_slurm(mixed, here="gpu1").hosts] == [
        (4, 64), (4, 64), (4, 32)]
    uneven = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_GPUS": "12", "SLURM_GPUS_ON_NODE": "8"}
    for total in ("12", "a100:12", "a100:8,v100:4"):  # --gpus=[TYPE:]N, of one type or more
        with pytest.raises(ValueError, match="12 GPUs over 2 nodes .* ask for them per node"):
            Cluster.from_slurm({**uneven, "SLURM_GPUS": total}, here="gpu1")
    for total in ("16", "a100:16"):
        even = {**uneven, "SLURM_GPUS": total}
        assert [h.gpus for h in Cluster.from_slurm(even, here="gpu1").hosts] == [8, 8]
    spread = cluster.spread("actor", 16)  # 16 ranks: 8 on each node
    assert [(h.name, slots) for h, slots in spread] == [("gpu1", list(range(8))),
                                                        ("gpu2", list(range(8)))]
    h = spread[1][0]
    cmd = torchrun_command(h, {"ASYNCRL_GROUP": "actor", "CUDA_VISIBLE_DEVICES": "0,1"}, 2,
                           1, 8, "gpu1:29400", "actor-run")
    # --overlap: a 2nd group's step waited for the 1st's (SLURM 20.11+); unbound (one CPU: 22.05+)
    assert cmd[:7] == ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--nodelist=gpu2",
                       "--export=ALL", "--cpu-bind=none"]
    # the environment goes with srun's own (a list would split "0,1" at the comma)
    assert not any("CUDA_VISIBLE_DEVICES" in c or "ASYNCRL_GROUP" in c for c in cmd)
    i = cmd.index("--nnodes")
    assert cmd[i:i + 6] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "gpu1:29400"
    with pytest.raises(asyncrl.PlacementError, match="do not fit evenly"):
        cluster.spread("critic", 2)  # the nodes are full
    cluster.forget("actor")
    assert len(cluster.spread("critic", 2)) == 1


def test_a_hosts_gpus_are_picked_there_from_its_own_visible_list():
    """Each host's agent got raw slot numbers as its CUDA_VISIBLE_DEVICES: under SLURM's
    "4,5,6,7" (or a node's own list) its ranks went to GPUs 0.. outside the allocation, and
    the controller's list was sent to other machines by ssh."""
    controller = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "PATH": "/bin"}
    for via in ("srun", "ssh"):  # another machine: the controller's list is not its own
        env = host_env(HostSpec("n2", "n2", gpus=4, via=via), [2, 3], controller, {})
        assert env["ASYNCRL_GPU_SLOTS"] == "2,3" and "CUDA_VISIBLE_DEVICES" not in env
    here = host_env(HostSpec("a", "127.0.0.1", gpus=4, via="local"), [2, 3], controller, {})
    assert here["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and here["ASYNCRL_GPU_SLOTS"] == "2,3"
    mine = host_env(HostSpec("n2", "n2", gpus=2, via="ssh"), [0], controller,
                    {"CUDA_VISIBLE_DEVICES": "1,3"})  # the group's env= holds everywhere
    assert mine["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "ASYNCRL_GPU_SLOTS" not in host_env(HostSpec("c", "c", cpus=4), [0, 1], {}, {})
    # the controller's process, which ranks on its machine check: not sent elsewhere (a
    # remote agent stands in for it there)
    ctl = {"ASYNCRL_CONTROLLER_PROCESS": "123:456"}
    srun = HostSpec("n2", "n2", cpus=2, via="srun")
    assert "ASYNCRL_CONTROLLER_PROCESS" not in host_env(srun, [0], {}, ctl)
    assert host_env(HostSpec("a", "a", cpus=2, via="local"), [0], {}, ctl)[
        "ASYNCRL_CONTROLLER_PROCESS"] == "123:456"
    # the rank, on its host: its slots out of the list it finds there, before CUDA starts
    for found, want in (({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "6,7"), ({}, "2,3"),
                        ({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b,GPU-c,GPU-d"}, "GPU-c,GPU-d")):
        rank = {**found, "ASYNCRL_GPU_SLOTS": "2,3"}
        select_gpus(rank)
        assert rank == {"CUDA_VISIBLE_DEVICES": want}
    untouched = {"CUDA_VISIBLE_DEVICES": "4,5"}
    select_gpus(untouched)  # a group of one host: the Placer wrote the list itself
    assert untouched == {"CUDA_VISIBLE_DEVICES": "4,5"}
    short = {"CUDA_VISIBLE_DEVICES": "0,1", "ASYNCRL_GPU_SLOTS": "2,3",
             "ASYNCRL_HOST_NAME": "n2"}
    with pytest.raises(RuntimeError, match=r"host n2: .*its GPU 2, but CUDA_VISIBLE_DEVICES=0,1 "
                                           r"here shows 2: give the host its real number"):
        select_gpus(short)
    hidden = {"CUDA_VISIBLE_DEVICES": "", "ASYNCRL_GPU_SLOTS": "0"}  # set, empty: none here
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES= here shows 0"):
        select_gpus(hidden)


def test_ssh_hosts_and_bad_hosts_files(tmp_path):
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({"hosts": [{"name": "n1", "address": "10.0.0.1", "gpus": 4}]}))
    (h,) = Cluster.from_file(f).hosts
    cmd = torchrun_command(h, {"ASYNCRL_ADDR": "tcp://10.0.0.9:5000", "HOME": "/root",
                               "THP_MEM_ALLOC_ENABLE": "1"}, 1, 0, 4, "10.0.0.1:1", "g-run")
    assert cmd[:3] == ["ssh", "-o", "BatchMode=yes"] and cmd[5] == "10.0.0.1"
    # ours, and the ranks' defaults (huge pages), which ssh would not pass on; started where
    # the controller runs (ssh starts in $HOME: a relative run dir's checkpoints went there)
    assert cmd[6].startswith(f"cd {os.getcwd()} && env ASYNCRL_ADDR=tcp://10.0.0.9:5000 "
                             f"THP_MEM_ALLOC_ENABLE=1 ")
    assert " -m asyncrl.actors.agent_main " in cmd[6]  # its torchrun folder goes with it
    # the group's own env= goes too, whatever its names (it was dropped), in the lifeline
    # and never on the command line: `ps` showed a WANDB_API_KEY or HF_TOKEN to every user
    env = {"MY_FLAG": "a b", "HF_TOKEN": "s3cr3t", "NCCL_DEBUG": "INFO", "HOME": "/root",
           "PYTHONPATH": "/pkg:/mine"}
    given = frozenset({"MY_FLAG", "HF_TOKEN", "NCCL_DEBUG", "PYTHONPATH"})
    mine = torchrun_command(h, env, 1, 0, 4, "10.0.0.1:1", "g-run", given=given)
    assert not any(v in part for part in mine for v in ("s3cr3t", "a b"))
    assert "HOME" not in mine[6]
    # what the agent needs to start (PYTHONPATH: the package) and what users tune stay there
    assert "PYTHONPATH=/pkg:/mine" in mine[6] and "NCCL_DEBUG=INFO" in mine[6]
    assert json.loads(lifeline_env(h, env, given)) == {"MY_FLAG": "a b", "HF_TOKEN": "s3cr3t"}
    assert lifeline_env(HostSpec("n2", "n2", via="srun"), env, given) == b"{}\n"  # (srun
    # passes the environment itself)
    f.write_text(json.dumps({"hosts": [{"name": "n1", "gpu": 4}]}))
    with pytest.raises(ValueError, match="unknown keys \\['gpu'\\]"):
        Cluster.from_file(f)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="expected JSON like"):
        Cluster.from_file(f)
    for bad in (None, "eight", -2, 1.5, True):  # each named, with its file and host
        f.write_text(json.dumps({"hosts": [{"name": "n1", "gpus": bad, "cpus": 4}]}))
        with pytest.raises(ValueError, match=f"{f}: host 'n1': \"gpus\" is a whole number"):
            Cluster.from_file(f)
    # GPU hosts beside CPU-only ones: a group would land on either kind, or on both
    with pytest.raises(ValueError, match=r"hosts \['g'\] have GPUs and \['c'\] none"):
        Cluster([HostSpec("g", "g", gpus=8), HostSpec("c", "c", cpus=64)])
    # one machine listed twice: each entry handed out its GPUs 0..n-1, two groups on a GPU
    with pytest.raises(ValueError, match=r"GPU hosts \['a', 'b'\] are one machine "
                                         r"\(10.0.0.1\): list each machine once"):
        Cluster([HostSpec(n, "10.0.0.1", gpus=4, via="ssh") for n in "ab"])
    Cluster([HostSpec(n, "127.0.0.1", cpus=1, via="local") for n in "ab"])  # CPUs: as tests do
    for address in ("fd00::2", "::1", "[fd00::2]"):  # the data plane bound tcp://fd00::2
        with pytest.raises(ValueError, match="'a'.*IPv6 .*not supported yet; give the host's IPv4"):
            Cluster([HostSpec("a", address, cpus=2, via="ssh")])


def test_gpu_hosts_that_are_one_machine_are_refused():
    """local and netns hosts are all this machine, an ssh host's name and its IP one: each
    handed out GPUs 0..n-1 (two groups got CUDA_VISIBLE_DEVICES=0,1 of the same GPUs)."""
    for via in ("local", "netns"):
        with pytest.raises(ValueError, match=r"'a', 'b'\] are all this machine .*one host with"):
            Cluster([HostSpec("a", "127.0.0.1", gpus=2), HostSpec("b", "10.7.0.2", 2, via=via)])
    ssh = [HostSpec("a", "localhost", gpus=2, via="ssh"), HostSpec("b", "127.0.0.1", 2, via="ssh")]
    with pytest.raises(ValueError, match=r"\['a', 'b'\] are one machine \(127.0.0.1\): list"):
        Cluster(ssh)
    with pytest.raises(ValueError, match=r"\['b', 'a'\] are one machine \(this machine\)"):
        Cluster([HostSpec("b", "127.0.0.2", gpus=2), ssh[0]])  # ssh to this machine
    Cluster([HostSpec("a", "n1.invalid", gpus=2, via="ssh"),  # (unresolved: ssh may know it)
             HostSpec("b", "127.0.0.1", 2)])


def test_an_agent_off_this_machine_removes_its_torchrun_folder(tmp_path):
    """ssh and srun hosts run torchrun through agent_main: torchrun's folder (its ranks'
    error files) lives in a temporary one, gone after a normal exit and after a SIGTERM.
    So are the shared-memory pools its ranks left (a killed rank's stay otherwise: the
    controller sweeps its own machine's /dev/shm only), and nothing else."""
    run_id = f"agent{os.getpid()}"
    pool = f"/dev/shm/asyncrl-{run_id}-grp+0-"  # + the rank's pid: what pool_prefix names
    rank = tmp_path / "rank.py"
    rank.write_text("import os, sys, time\n"  # (its pid beside `seen`, first)
                    "open(sys.argv[1] + '.pid', 'w').write(str(os.getpid()))\n"
                    f"open({pool!r} + str(os.getpid()) + '-0', 'w').close()\n"
                    "open(sys.argv[1], 'w').write(os.environ['TORCHELASTIC_ERROR_FILE'])\n"
                    "time.sleep(float(sys.argv[2]))\n")
    (scratch := tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "ASYNCRL_RUN_ID": run_id,
           "ASYNCRL_GROUP": "grp"}
    kept = [f"/dev/shm/asyncrl-{run_id}-grp+1-{os.getpid()}-0",  # a rank that runs
            f"/dev/shm/asyncrl-{run_id}-other+0-999999999-0"]  # another group's
    for path in kept:
        open(path, "w").close()

    def pools() -> list[str]:
        return sorted(f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
                      if n.startswith(f"asyncrl-{run_id}-"))
    try:
        _agent_cleans_up(tmp_path, rank, scratch, env)
        assert pools() == sorted(kept)
    finally:
        for path in pools():
            os.unlink(path)


def _agent_cleans_up(tmp_path: Path, rank: Path, scratch: Path, env: dict) -> None:
    """An agent whose rank exits, then one stopped by SIGTERM: torchrun's folder goes."""
    from helpers import kill_left
    def agent(seen: Path, sleep: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "asyncrl.actors.agent_main",
                                 "--standalone", "--nproc-per-node", "1", "--monitor-interval",
                                 "0.1", str(rank), str(seen), str(sleep)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    assert agent(tmp_path / "done", 0).wait(60) == 0
    assert (tmp_path / "done").read_text().startswith(str(scratch / "asyncrl-torchrun-"))
    assert list(scratch.iterdir()) == []
    stopped = agent(tmp_path / "stopped", 120)
    try:
        wait_until(lambda: (tmp_path / "stopped").exists(), 60, "the rank to start")
        assert len(list(scratch.iterdir())) == 1
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(30) != 0
    finally:
        stopped.kill()
        stopped.wait()
        kill_left(tmp_path / "stopped.pid", f"TMPDIR={scratch}")  # (a failed SIGTERM's rank)
    assert list(scratch.iterdir()) == []
    # stopped before its ranks start (waiting at the rendezvous for a host that failed):
    # torchrun's handler was not in place yet, and SIGTERM killed it with its folder left
    waiting = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.actors.agent_main", "--nnodes", "2", "--node-rank",
         "0", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{free_port()}", "--rdzv-conf", "is_host=true", str(rank),
         str(tmp_path / "never"), "0"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(scratch.iterdir()), 60, "the agent's folder")
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(30) == 128 + signal.SIGTERM
    finally:
        waiting.kill()
        waiting.wait()
    assert list(scratch.iterdir()) == [] and not (tmp_path / "never").exists()


class Spread(asyncrl.Worker):
    @asyncrl.register
    def where(self) -> dict:
        import os

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)  # over the rendezvous the two agents met at
        return {"rank": self.rank, "host": os.environ["ASYNCRL_HOST_NAME"], "sum": t.item()}

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def double(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"y": batch["x"] * 2})

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def host_of(self, batch: TensorBatch) -> TensorBatch:
        import os

        return batch.union(TensorBatch({"at": [os.environ["ASYNCRL_HOST_NAME"]] * len(batch)}))


def loopback_hosts() -> Cluster:
    return Cluster([HostSpec(f"host{c}", "127.0.0.1", cpus=1, via="local") for c in "ABC"])


def test_a_group_spread_over_two_hosts_meets_at_the_rendezvous_and_moves_data():
    async def main():
        async with asyncrl.Controller(cluster=loopback_hosts(), echo_logs=False) as ctl:
            spread = await ctl.spawn(Spread, nprocs=2, name="spread")
            agents = spread.agent.agents
            assert [a.host for a in agents] == ["hostA", "hostB"]
            assert len({a.pid for a in agents}) == 2  # one torchrun agent per host
            where = await spread.where()
            # another group on one host pulls the spread group's rows from both hosts (TCP:
            # the data plane sees two hosts)
            single = await ctl.spawn(Spread, nprocs=1, name="single")
            y = await single.host_of(spread.double(TensorBatch({"x": torch.arange(6.0)})))
            pids = [p for a in agents for p in a.all_pids()] + group_pids(single)
            return where, y, pids
    where, y, pids = run(main())
    assert_gone(pids)
    assert sorted(w["host"] for w in where) == ["hostA", "hostB"]
    assert all(w["sum"] == 3.0 for w in where)
    assert y["y"].tolist() == [0, 2, 4, 6, 8, 10] and set(y["at"]) == {"hostC"}


def test_a_group_respawned_after_a_rank_died_goes_to_another_host_first():
    """A respawn took the least used host, the one its rank had just died on when the group
    was alone there (a dead node, a failing GPU took it again)."""
    async def main():
        async with asyncrl.Controller(cluster=loopback_hosts(), echo_logs=False,
                                      heartbeat_interval=0.2) as ctl:
            first = await ctl.spawn(Spread, nprocs=1, name="g")
            pids = group_pids(first)
            os.kill(first.pids[0], signal.SIGKILL)
            await poll_until(lambda: first.dead is not None, 20, "the group to be dead")
            assert first.dead.rank == 0
            await ctl.close_group(first)
            again = await ctl.spawn(Spread, nprocs=1, name="g")
            other = await ctl.spawn(Spread, nprocs=2, name="h")  # needs two: hostA is used
            pids += group_pids(again) + group_pids(other)
            return (await again.where()), (await other.where()), pids
    again, other, pids = run(main(), timeout=120)
    assert_gone(pids)
    assert [w["host"] for w in again] == ["hostB"]
    assert sorted(w["host"] for w in other) == ["hostA", "hostC"]


def test_asyncrl_launch_with_a_hosts_file_runs_a_flow(tmp_path):
    hosts = tmp_path / "hosts.json"
    # one slot a host: the 2-rank policy group spreads over two hosts (two agents meeting
    # at the first one's rendezvous endpoint), reward and reference get one host each
    hosts.write_text(json.dumps({"hosts": [
        {"name": f"host{c}", "address": "127.0.0.1", "cpus": 1, "via": "local"}
        for c in "ABCD"]}))
    out = subprocess.run([sys.executable, "-m", "asyncrl", "launch", "examples/flow.py",
                          "--steps", "2", "--run-dir", str(tmp_path / "run"), "--hosts",
                          str(hosts)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert {"policy.hostA.log", "policy.hostB.log", "reward.hostC.log", "ref.hostD.log"} \
        <= set(logs), logs
    assert rows[-1]["train/p_good"] > rows[0]["train/p_good"]  # it trained across hosts


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    """Two network namespaces on a bridge, as two hosts with their own network stacks:
    asr_a 10.77.0.2 and asr_b 10.77.0.3; this machine is 10.77.0.1. Root only."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    created: list[tuple[str, ...]] = []

    def step(*cmd: str) -> None:
        out = _sh(*cmd)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")

    try:
        step("ip", "link", "add", "asrbr0", "type", "bridge")
        created.append(("ip", "link", "del", "asrbr0"))
        step("ip", "addr", "add", "10.77.0.1/24", "dev", "asrbr0")
        step("ip", "link", "set", "asrbr0", "up")
        for i, ns in enumerate(("asr_a", "asr_b")):
            step("ip", "netns", "add", ns)
            created.append(("ip", "netns", "del", ns))
            step("ip", "link", "add", f"asrv{i}", "type", "veth", "peer", "name", f"asrp{i}")
            created.append(("ip", "link", "del", f"asrv{i}"))
            step("ip", "link", "set", f"asrv{i}", "master", "asrbr0", "up")
            step("ip", "link", "set", f"asrp{i}", "netns", ns)
            step("ip", "-n", ns, "link", "set", f"asrp{i}", "name", "eth0")
            step("ip", "-n", ns, "addr", "add", f"10.77.0.{i + 2}/24", "dev", "eth0")
            step("ip", "-n", ns, "link", "set", "eth0", "up")
            step("ip", "-n", ns, "link", "set", "lo", "up")
    except RuntimeError as e:
        for cmd in reversed(created):
            _sh(*cmd)
        pytest.skip(f"network namespaces are not available here: {e}")
    yield ["asr_a", "asr_b"]
    for cmd in reversed(created):
        _sh(*cmd)


def test_a_group_across_network_namespaces_as_separate_hosts(namespaces):
    cluster = Cluster([HostSpec("asr_a", "10.77.0.2", cpus=1, via="netns"),
                       HostSpec("asr_b", "10.77.0.3", cpus=1, via="netns")])

    async def main():
        async with asyncrl.Controller(host="10.77.0.1", cluster=cluster,
                                      echo_logs=False) as ctl:
            spread = await ctl.spawn(Spread, nprocs=2, name="spread")
            where = await spread.where()  # gloo between the namespaces, over the bridge
            y = await spread.double(TensorBatch({"x": torch.arange(4.0)}))
            pids = [p for a in spread.agent.agents for p in a.all_pids()]
            return where, y, pids
    where, y, pids = run(main())
    assert_gone(pids)
    assert sorted(w["host"] for w in where) == ["asr_a", "asr_b"]
    assert all(w["sum"] == 3.0 for w in where)
    assert y["y"].tolist() == [0, 2, 4, 6]


def test_cluster_never_hands_out_the_slots_of_a_running_group():
    cluster = Cluster([HostSpec("h", "h", gpus=8)])
    assert cluster.spread("A", 4)[0][1] == [0, 1, 2, 3]
    assert cluster.spread("B", 4)[0][1] == [4, 5, 6, 7]
    cluster.forget("A")
    assert cluster.spread("C", 4)[0][1] == [0, 1, 2, 3]  # A's, not B's
    cluster.forget("B")
    assert cluster.spread("D", 2)[0][1] == [4, 5]
    with pytest.raises(asyncrl.PlacementError, match=r"of the hosts \[\('h', 2\)\]"):
        cluster.spread("E", 4)  # only 6, 7 are free
    two = Cluster([HostSpec(n, n, gpus=4, via="srun") for n in "ab"])
    two.spread("x", 2)  # a: 0, 1
    two.spread("y", 2)  # b: 0, 1
    two.spread("z", 2)  # a: 2, 3
    two.forget("x")
    assert [(h.name, s) for h, s in two.spread("w", 4)] == [("a", [0, 1]), ("b", [2, 3])]
    # a host a rank died on comes last, but is used when the others are full
    three = Cluster([HostSpec(n, n, gpus=2, via="srun") for n in "abc"])
    three.suspect("a")
    three.suspect("nowhere")  # (a name not in the cluster: nothing)
    assert [h.name for h, _ in three.spread("x", 2)] == ["b"]
    assert [h.name for h, _ in three.spread("y", 4)] == ["c", "a"]


def test_a_cluster_refuses_constraints_it_cannot_honour_and_frees_failed_starts(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    async def main():
        async with NoLogFolder(cluster=loopback_hosts(), echo_logs=False) as ctl:
            ctl.blocker = str(blocker)
            cluster = ctl.cluster
            for place in (asyncrl.colocate_with("x"), asyncrl.share_gpus(2),
                          asyncrl.nvlink_group(2), asyncrl.same_host_as("x")):
                with pytest.raises(asyncrl.PlacementError) as e:
                    await ctl.spawn(Spread, nprocs=1, name="g", place=place)
                assert f"place={place!r} is not supported on a cluster (--hosts or SLURM) " \
                    "yet" in str(e.value) and f"drop {place.kind}" in str(e.value)
            with pytest.raises(asyncrl.PlacementError, match="names a group that is not placed"):
                await ctl.spawn(Spread, nprocs=1, name="g", place=asyncrl.separate_from("x"))
            with pytest.raises(FileExistsError, match="not-a-folder"):  # the agents cannot
                # start (a spawn timing out is an OSError too): what they took is freed
                await ctl.spawn(Spread, nprocs=2, name="g")
            assert ctl.groups == {} and cluster._groups == {}
            assert not any(cluster._taken.values())
    run(main(), timeout=60)
    # separate_from holds by itself: groups never share a cluster's slots
    cluster = Cluster([HostSpec("h", "h", gpus=4)])
    cluster.spread("a", 2)
    cluster.check_place("b", asyncrl.separate_from("a"))
    assert cluster.spread("b", 2)[0][1] == [2, 3]


def test_a_spawn_whose_host_commands_fail_frees_its_slots(monkeypatch):
    """The slots a cluster gave a group stayed taken when making its hosts' commands
    failed (the controller's working directory gone, say): the next group did not fit."""
    import asyncrl.controller.launcher as launcher

    def no_cwd(*args, **kwargs):
        raise FileNotFoundError("the working directory is gone")

    async def main():
        async with asyncrl.Controller(cluster=loopback_hosts(), echo_logs=False) as ctl:
            with monkeypatch.context() as m:
                m.setattr(launcher, "torchrun_command", no_cwd)
                with pytest.raises(FileNotFoundError):
                    await ctl.spawn(Spread, nprocs=3, name="g")
            return dict(ctl.cluster._taken), ctl.groups
    taken, groups = run(main(), timeout=60)
    assert groups == {} and not any(taken.values()), taken


def test_a_flow_is_placed_on_a_cluster_on_paper_first():
    """Controller.check_placements (DataFlow.open): slots and constraints are tried on a copy
    of the cluster, in spawn order, and nothing is taken."""
    ctl = asyncrl.Controller(cluster=Cluster([HostSpec("h", "h", gpus=4)]))
    ctl.check_placements([("a", 2, None), ("b", 2, asyncrl.separate_from("a"))])
    with pytest.raises(asyncrl.PlacementError, match=r"group 'c': 1 ranks do not fit"):
        ctl.check_placements([("a", 2, None), ("b", 2, None), ("c", 1, None)])
    with pytest.raises(asyncrl.PlacementError, match="names a group that is not placed yet"):
        ctl.check_placements([("b", 2, asyncrl.separate_from("a")), ("a", 2, None)])
    assert ctl.cluster._groups == {} and not any(ctl.cluster._taken.values())


def test_a_cluster_controller_needs_an_address_remote_ranks_reach_and_an_absolute_run_dir(
        tmp_path, monkeypatch):
    """0.0.0.0 or localhost passed for the controller's address made remote ranks connect
    to themselves; a relative run directory was relative to $HOME for ranks started by ssh;
    the rendezvous port was drawn from the flow's seeded `random` (every run of a sweep the
    same port; the checkpointed RNG state shifted by each spawn)."""
    import random

    from asyncrl.controller.launcher import cluster_agents

    remote = Cluster([HostSpec("n1", "10.0.0.1", cpus=4, via="ssh")])
    for host in ("0.0.0.0", "localhost", "::1", "127.0.1.1"):
        with pytest.raises(ValueError, match=f"got '{host}'.*--controller-address"):
            asyncrl.Controller(cluster=remote, host=host)
    monkeypatch.chdir(tmp_path)
    assert asyncrl.Controller(run_dir="runs/a").run_dir == tmp_path / "runs" / "a"
    random.seed(0)
    state = random.getstate()
    ports = set()
    for i in range(4):
        agents = cluster_agents(Cluster([HostSpec("n1", "10.0.0.1", cpus=4, via="ssh")]),
                                f"g{i}", 2, {}, tmp_path, "run", die_with_parent=False)
        command = agents.agents[0].command()[-1]
        ports.add(int(command.split("--rdzv-endpoint ")[1].split()[0].rsplit(":", 1)[1]))
    assert random.getstate() == state and all(p < 32768 for p in ports)


def test_a_remote_agent_stops_its_ranks_when_its_ssh_or_srun_end_is_gone(tmp_path):
    """Killing the local ssh (or srun) of a group spread over hosts stopped nothing there:
    the ranks ran on, holding their GPUs, until a collective timed out. The agent's stdin is
    now its lifeline: at its end, torchrun stops the ranks. While it holds, the agent is the
    process the ranks check before taking a silent controller for gone: remote ranks exited
    after heartbeat_timeout of a controller loop busy with a node's own work."""
    from asyncrl.actors.procs import PROCESS_ENV, runs

    worker = tmp_path / "worker.py"
    pid_file = tmp_path / "rank.pid"
    worker.write_text(f"import os, sys, time\nopen(sys.argv[1] + '.env', 'w').write("
                      f"os.environ.get({PROCESS_ENV!r}, '') + '\\n' + "
                      f"os.environ.get('MY_TOKEN', ''))\n"
                      f"open(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(3600)\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.actors.agent_main", "--nnodes", "1",
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{free_port()}", "--max-restarts", "0", str(worker), str(pid_file)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "ASYNCRL_AGENT_LIFELINE": "1", "PYTHONPATH": ROOT},
        start_new_session=True)
    assert agent.stdin is not None
    agent.stdin.write(json.dumps({"MY_TOKEN": "s3cr3t"}).encode() + b"\n")  # the group's
    agent.stdin.flush()  # env= (over ssh: on no command line)
    rank = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), 120,
                   "the rank to start")
        rank = int(pid_file.read_text())
        watched, token = (tmp_path / "rank.pid.env").read_text().split("\n")
        assert watched.split(":")[0] == str(agent.pid) and runs(watched)
        assert token == "s3cr3t"  # the lifeline's environment reached the rank
        agent.stdin.close()  # the local ssh is gone
        assert agent.wait(60) != 0
        assert_gone([rank])
    finally:  # torchrun's ranks have a session of their own: stopped by pid, the agent
        if agent.poll() is None:  # gone or not (gone first: the very failure tested here)
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        if rank is not None and pid_alive(rank):
            kill_pids([rank])


class ClosesSlowlyOnB(asyncrl.Worker):
    def __init__(self, folder: str):
        self.folder = folder

    @asyncrl.register
    def host(self) -> str:
        return os.environ["ASYNCRL_HOST_NAME"]

    def on_close(self) -> None:
        host = os.environ["ASYNCRL_HOST_NAME"]
        if host == "hostB":  # (saving, flushing: what on_close is for) while hostA is done
            time.sleep(2.0)
        with open(os.path.join(self.folder, host), "w") as f:
            f.write("closed")


def test_closing_a_group_over_two_hosts_lets_the_slower_host_finish_on_close(tmp_path):
    """The group counts as exited with its first host's agent, then kills every host's
    ranks: torchrun's exit barrier holds a host's agent until every host's ranks have ended,
    so a slower host's on_close is not cut short (a review suspected it was)."""
    async def main():
        async with asyncrl.Controller(cluster=loopback_hosts(), echo_logs=False,
                                      shutdown_grace=60) as ctl:
            group = await ctl.spawn(ClosesSlowlyOnB, str(tmp_path), nprocs=2)
            assert sorted(await group.host()) == ["hostA", "hostB"]
            pids = [p for a in group.agent.agents for p in a.all_pids()]
            await ctl.close_group(group)
            return pids
    assert_gone(run(main(), timeout=120))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostA", "hostB"]
