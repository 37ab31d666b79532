"""A cluster's hosts: what an ssh host's command line carries, and rendezvous ports of hosts
that share an address (more in test_cluster.py)."""

from __future__ import annotations

import random
import shlex

from asyncrl.controller.cluster import Cluster, HostSpec, torchrun_command
from asyncrl.controller.launcher import cluster_agents, host_env


def test_ranks_on_an_ssh_host_get_unbuffered_output():
    """rank_env set PYTHONUNBUFFERED=1, but ssh's command line carried only the variables
    of a few prefixes: a rank's prints reached its log only when its buffer filled."""
    host = HostSpec("n1", "10.0.0.1", cpus=2, via="ssh")
    env = host_env(host, [0], {}, {"ASYNCRL_GROUP": "g"})
    assert env["PYTHONUNBUFFERED"] == "1"
    command = torchrun_command(host, env, 1, 0, 1, "10.0.0.1:25000", "g-run")
    assert command[0] == "ssh"
    remote = shlex.split(command[-1])
    exports = remote[remote.index("env") + 1:remote.index("-m") - 1]  # before python -m
    assert "PYTHONUNBUFFERED=1" in exports


def test_rendezvous_ports_are_held_per_address_not_per_host_name(tmp_path, monkeypatch):
    """Two hosts at one address (one machine listed under two names): each host's ports were
    held apart, and two groups could draw one port there."""
    draws = iter([25000, 25000, 26000])
    monkeypatch.setattr(random.SystemRandom, "randint", lambda self, lo, hi: next(draws))
    cluster = Cluster([HostSpec("n1", "10.0.0.1", cpus=1, via="ssh"),
                       HostSpec("n1b", "10.0.0.1", cpus=1, via="ssh")])

    def endpoint(group: str) -> tuple[str, str]:  # (commands only: nothing starts)
        agents = cluster_agents(cluster, group, 1, {}, tmp_path, "run", die_with_parent=False)
        agent = agents.agents[0]
        return agent.host, agent.command()[-1].split("--rdzv-endpoint ")[1].split()[0]
    assert endpoint("a") == ("n1", "10.0.0.1:25000")
    assert endpoint("b") == ("n1b", "10.0.0.1:26000")  # 25000 is a's, at the same address
