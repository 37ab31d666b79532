"""One torchrun job per group: start it, watch it, read its log, and stop it for certain.

The job runs in its own session (Ctrl-C in the terminal reaches the controller, which shuts
groups down in order). torchrun puts every rank in a session of its own too, so stopping is
by pid: the agent, the ranks that said hello, and any child the agent still has.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import asyncrl
from asyncrl.actors import rank_client
from asyncrl.actors.agent_main import LIFELINE
from asyncrl.actors.gpu_slots import GPU_SLOTS
from asyncrl.actors.procs import PROCESS_ENV, birth, child_pids, kill_pids, state
from asyncrl.actors.rank_fork import RANK_ENV_DEFAULTS, rank_threads
from asyncrl.controller.agent_fork import AgentServer, ForkedAgent, forking_enabled
from asyncrl.controller.agent_fork import die_with_parent as _die_with_parent
from asyncrl.controller.agent_fork import pid_alive as pid_alive  # (its users import it here)
from asyncrl.controller.cluster import (
    Cluster,
    HostSpec,
    lifeline_env,
    torchrun_command,
)

_AGENT_REPORT = re.compile(r"^.*\] failed \(exitcode: ", re.MULTILINE)
log = logging.getLogger("asyncrl")
_SAID: set[str] = set()  # why an agent was not forked, said once each
_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
# torchrun's own log line (not a rank's print) as it stops the ranks left
_STOPPED = re.compile(r"\] Sending process (\d+) closing signal")


FREEZE_S = 1.0  # the longest signal_all waits for the agent to be stopped
HANG_UP_S = 1.0  # the longest hang_up waits for remote agents' ssh or srun, at each step
_ASK = object()  # Agent.start: ask the agent server for a forked torchrun


class Agent:
    """The torchrun process of one group."""

    def __init__(self, group: str, nprocs: int, env: dict[str, str], log_path: Path,
                 die_with_parent: bool = True, command: list[str] | None = None,
                 host: str | None = None, local: bool = True, scratch: Path | None = None,
                 server: AgentServer | None = None):
        self.group, self.nprocs, self.log_path = group, nprocs, log_path
        self.scratch = scratch  # torchrun's own folders (else a torchelastic_* left in /tmp)
        self.host = host  # the host it starts ranks on (None: this one)
        self.local = local  # whether its ranks run on this machine (their pids mean something)
        self._env = env
        self._die_with_parent = die_with_parent
        self._command = command  # one host's agent of a group spread over hosts
        self.lifeline_env = b"{}\n"  # a remote agent's: its lifeline's first line
        self._server = server  # forks torchrun from a warm process (this host's groups)
        self.proc: subprocess.Popen | ForkedAgent | None = None
        self._hung_up = False  # a remote agent's lifeline closed (close_lifeline)
        self.hanging_up = False  # and hang_up's thread not yet through with it
        self.rank_pids: dict[int, int] = {}
        self._rank_birth: dict[int, str | None] = {}  # when each rank's process started
        self._launched: dict[int, int] = {}  # the pid torchrun started -> the rank's
        self._log_start = 0  # where this agent's output starts in the log (a respawned
        # group's agent appends to its predecessor's): tail() and root_cause() read from there

    def command(self) -> list[str]:
        if self._command is not None:
            return self._command
        return [sys.executable, "-m", "torch.distributed.run", *self._torchrun_args()]

    def _torchrun_args(self, forked_ranks: bool = False) -> list[str]:
        """torchrun's arguments; `forked_ranks`: each rank's process is a stand-in for a
        rank the agent server forks (asyncrl/actors/rank_fork.py)."""
        scratch = ["--log-dir", str(self.scratch)] if self.scratch is not None else []
        program = ["--no-python", sys.executable, "-I", "-S", rank_client.__file__] \
            if forked_ranks else ["-m", "asyncrl.actors.rank_main"]
        return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(self.nprocs),
                "--max-restarts", "0", "--monitor-interval", "0.1", *scratch, *program]

    def _forked(self) -> ForkedAgent | None:
        """The agent forked by the server (None: none, or it could not: torchrun anew)."""
        if self._server is None or self._command is not None or not self._server.alive:
            return None
        ranks = self._server.ranks_address() if forking_enabled("RANKS") else None
        env = {**self._env, rank_client.SERVER: ranks} if ranks else self._env
        try:
            return self._server.start(self._torchrun_args(ranks is not None), env,
                                      str(self.log_path), self._die_with_parent)
        except RuntimeError as e:
            if str(e) not in _SAID:  # once: every group after would say the same
                _SAID.add(str(e))
                log.warning("asyncrl: torchrun of group %r started anew (%s)", self.group, e)
            return None

    def wait(self, timeout: float | None = None) -> None:
        if self.proc is not None:
            self.proc.wait(timeout)

    def rank_started(self, rank: int, pid: int, host: str, launched: int = 0) -> None:
        """Rank `rank` runs as `pid`; torchrun knows it as `launched` (its stand-in's pid
        when the agent server forked it)."""
        if self.local:
            self.rank_pids[rank] = pid
            self._rank_birth[rank] = birth(pid)
            self._launched[launched or pid] = pid

    def blamed(self, heard: set[str]) -> list[str]:
        """The hosts at fault when the group failed with no rank named: its host."""
        return [self.host] if self.host is not None else []

    def fork(self) -> ForkedAgent | None:
        """torchrun forked by the agent server, or None (it cannot: `start` starts it anew).
        It may wait seconds for the server (starting, or busy): the controller asks from a
        thread of its own, then hands the agent to `start` on its loop."""
        self._mark_log_start()
        return self._forked()

    def start(self, on_exit: Callable[[int], None], forked: Any = _ASK) -> None:
        """Start torchrun (`forked`: what `fork` gave already, None: anew; by default the
        agent server is asked here); `on_exit(returncode)` is called from a watcher thread."""
        if forked is _ASK:
            forked = self.fork()
        with open(self.log_path, "ab") as log:
            self.proc = forked
            if self.proc is None:
                # a remote agent's lifeline (agent_main.py): a pipe kept open, its first
                # line the ranks' environment ssh would show, then never written
                lifeline = self._env.get(LIFELINE) == "1"
                self.proc = subprocess.Popen(
                    self.command(), stdin=subprocess.PIPE if lifeline else subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT, env=self._env, start_new_session=True,
                    preexec_fn=functools.partial(_die_with_parent, os.getpid())
                    if self._die_with_parent else None)
                if lifeline:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(self.lifeline_env)
                    self.proc.stdin.flush()
        proc = self.proc
        threading.Thread(target=lambda: on_exit(proc.wait()), daemon=True,
                         name=f"asyncrl-agent-{self.group}").start()

    def _mark_log_start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = os.fstat(log.fileno()).st_size

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def tail(self, lines: int = 30) -> str:
        """The last lines the ranks printed (torchrun's own failure report left out: the
        exit code and rank it reports are in the error already)."""
        text = self._read_log(65536)
        report = _AGENT_REPORT.search(text)
        if report is not None:
            text = text[:report.start()]
        return "\n".join(text.splitlines()[-lines:])

    def root_cause(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first failed rank, as torchrun reported it."""
        matches = _ROOT_CAUSE.findall(self._read_log(1 << 18))  # its report: at the end
        return (int(matches[-1][0]), int(matches[-1][1])) if matches else None

    def exit_seen(self, rank: int) -> int | None:
        """Rank `rank`'s exit code as the agent server that forked it saw it (torchrun, slow
        on a loaded host, may not have reported it yet); None: running, or not forked."""
        pid = self.rank_pids.get(rank)
        if self._server is None or pid is None or pid in self._launched:  # (started anew:
            return None                                                  # its own pid)
        return self._server.rank_exit(pid)

    def stopped_pids(self) -> set[int]:
        """Pids torchrun itself stopped because another rank failed: followers, not causes
        (logged at the end: the log's last 256 KiB)."""
        return {self._launched.get(int(p), int(p))
                for p in _STOPPED.findall(self._read_log(1 << 18))}

    def _read_log(self, last: int | None = None) -> str:
        """This agent's part of its log (at most its `last` bytes); "" when unreadable."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = self._log_start if size >= self._log_start else 0  # truncated: all
                f.seek(start if last is None else max(start, size - last))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def all_pids(self) -> list[int]:
        """The agent and its children while it runs, and every rank that said hello and is
        still the process that did: a pid reaped may be someone else's by now."""
        if self.proc is None:
            return []
        running = self.proc.poll() is None and (  # (a forked one: reaped by its server)
            not isinstance(self.proc, ForkedAgent) or self.proc.is_itself())
        pids = {self.proc.pid, *child_pids(self.proc.pid)} if running else set()
        pids |= {pid for rank, pid in self.rank_pids.items()
                 if (born := birth(pid)) is not None and born == self._rank_birth.get(rank)}
        return sorted(pids)

    def signal_all(self, sig: int) -> None:
        if sig == signal.SIGKILL and self.close_lifeline():  # (a remote one: the rest on a
            hang_up([self])  # thread of its own, after its ssh or srun passed that on)
            return
        if sig == signal.SIGKILL and self.hanging_up:  # (a second stop: the hang-up's own
            return  # kill follows; killed now, srun would pass nothing on)
        if sig == signal.SIGKILL:  # stopped first: a child it started while its children
            self._freeze()  # were listed (torchrun starting its ranks) was never signalled
        kill_pids(self.all_pids(), sig)
        for rank, pid in list(self.rank_pids.items()):  # torchrun starts each rank in a session
            # of its own: what a rank started (a sandbox, a compile worker) goes with it. Its
            # pid is not reused while its group has members; a live process of another
            # birth under it is someone else's, left alone
            born = birth(pid)
            if born is not None and born != self._rank_birth.get(rank):
                continue
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _freeze(self) -> None:
        """SIGSTOP to the agent, and a short wait for it to be stopped (or gone)."""
        proc = self.proc
        if proc is None or proc.poll() is not None or (
                isinstance(proc, ForkedAgent) and not proc.is_itself()):
            return
        try:
            os.kill(proc.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + FREEZE_S
        while state(proc.pid) not in (None, "T", "t", "Z", "X") and time.monotonic() < deadline:
            time.sleep(0.001)  # (a stop takes effect at the process's next kernel exit)

    def close_lifeline(self) -> bool:
        """A remote agent's end of its lifeline closed while its ssh or srun runs, to pass
        that on (once): whether it did."""
        proc = self.proc
        if self.local or self._hung_up or not isinstance(proc, subprocess.Popen) \
                or proc.poll() is not None:
            return False
        self._hung_up = self.hanging_up = True
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:  # (its end gone already)
            pass
        return True

    def terminate(self) -> None:
        """SIGTERM to the agent's process (a remote agent's: its ssh or srun)."""
        if isinstance(self.proc, subprocess.Popen) and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def exit_by(self, deadline: float) -> None:
        """Wait for the agent to exit until `deadline` (time.monotonic()) at most."""
        try:
            self.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def hang_up(told: list[Agent]) -> None:
    """Stop remote agents whose lifelines were just closed (`close_lifeline`) through their
    ssh or srun before those are killed, on a thread of its own (the caller, the controller's
    loop, goes on): a SIGKILLed srun passes on nothing (slurmstepd keeps the agent's stdin
    open until srun says it ended), and the ranks there kept their GPUs until a collective
    timed out. The agent there stops its ranks, cleans up and exits, its ssh or srun with it;
    those still running after HANG_UP_S get SIGTERM (srun SIGKILLs its step, ranks
    included), and after HANG_UP_S more, SIGKILL with whatever is left of them."""
    def stop() -> None:
        running = told
        for terminate in (False, True):
            if terminate:
                running = [a for a in running if a.returncode is None]
                for a in running:
                    a.terminate()
            deadline = time.monotonic() + HANG_UP_S
            for a in running:
                a.exit_by(deadline)
        for a in told:
            a.hanging_up = False
            a.signal_all(signal.SIGKILL)  # (its lifeline closed: killed at once now)

    try:
        threading.Thread(target=stop, name="asyncrl-hang-up").start()
    except RuntimeError:  # (at interpreter exit, on some Pythons: "can't create new thread")
        stop()


class HostAgents:
    """The agents of one group spread over several hosts, as one Agent: it has exited when
    any of them has (a group missing a host is broken), and stopping stops them all."""

    def __init__(self, agents: list[Agent]):
        self.agents = agents
        self.group = agents[0].group
        self.log_path = agents[0].log_path
        self._exited = threading.Lock()
        self._first: Agent | None = None  # the agent that exited first: its host's the cause

    @property
    def rank_pids(self) -> dict[int, int]:
        return {r: p for a in self.agents for r, p in a.rank_pids.items()}

    def rank_started(self, rank: int, pid: int, host: str, launched: int = 0) -> None:
        """Pids of ranks on this machine only: a remote pid names nothing here."""
        for a in self.agents:
            if a.host == host:
                a.rank_started(rank, pid, host, launched)

    @property
    def proc(self) -> subprocess.Popen | ForkedAgent | None:
        return self.agents[0].proc

    @property
    def pid(self) -> int | None:
        return self.agents[0].pid

    @property
    def returncode(self) -> int | None:
        codes = [a.returncode for a in self.agents]
        return next((c for c in codes if c is not None), None)

    def start(self, on_exit: Callable[[int], None]) -> None:
        def first(agent: Agent, code: int) -> None:  # on the watcher threads: the first only
            with self._exited:
                if self._first is not None:
                    return
                self._first = agent
            on_exit(code)

        for a in self.agents:
            a.start(functools.partial(first, a))

    def _cause_first(self) -> list[Agent]:
        """The agents, the one that exited first leading: a rank killed on host B makes host
        A's ranks fail in their collectives, and A's torchrun names one of them."""
        first = self._first
        return self.agents if first is None else [first, *(a for a in self.agents
                                                            if a is not first)]

    def wait(self, timeout: float | None = None) -> None:
        for a in self.agents:
            a.wait(timeout)

    def blamed(self, heard: set[str]) -> list[str]:
        """The hosts at fault when the group failed with no rank named: the host whose agent
        exited first (ssh could not connect, torchrun failed there), else each host none of
        whose ranks said hello (`heard`: the hosts of those that did; an agent hung at the
        rendezvous)."""
        if self._first is not None:
            return self._first.blamed(heard)
        return [a.host for a in self.agents if a.host is not None and a.host not in heard]

    def tail(self, lines: int = 30) -> str:
        return "\n".join(t for a in self._cause_first() if (t := a.tail(lines)))

    def root_cause(self) -> tuple[int, int] | None:
        return next((c for a in self._cause_first() if (c := a.root_cause()) is not None), None)

    def exit_seen(self, rank: int) -> int | None:
        return next((c for a in self.agents if (c := a.exit_seen(rank)) is not None), None)

    def stopped_pids(self) -> set[int]:
        """This machine's only: a remote host's pids are of another pid namespace."""
        return {p for a in self.agents if a.local for p in a.stopped_pids()}

    def all_pids(self) -> list[int]:
        return sorted({p for a in self.agents for p in a.all_pids()})

    def signal_all(self, sig: int) -> None:
        told = [a for a in self.agents if a.close_lifeline()] if sig == signal.SIGKILL else []
        if told:  # every host's at once: one wait for them all
            hang_up(told)
        for a in self.agents:
            if a not in told:
                a.signal_all(sig)


def check_env(group: str, env: Any) -> None:
    """A group's `env=`: names and values, both str, that an environment can hold (None:
    nothing to add)."""
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"group {group!r}: env= maps names to values, like {{'NAME': 'value'}}; "
                        f"got a {type(env).__name__}: {env!r}")
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"group {group!r}: env={{{key!r}: {value!r}}}: environment names "
                            f"and values are str; pass {str(key)!r}: {str(value)!r}")
        # what no environment can hold (torchrun, or Popen, failed on it later, unnamed)
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"group {group!r}: env={{{key!r}: {value!r}}}: an environment "
                             f"name is not empty and has no '=' or NUL; rename {key!r}")
        if "\0" in value:
            raise ValueError(f"group {group!r}: env={{{key!r}: {value!r}}}: an environment "
                             f"value has no NUL; remove it from the value of {key!r}")


def rank_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The environment of a group's ranks: ours, the user's `env=`, and the package path."""
    env = dict(base)
    env.pop("WANDB_SERVICE", None)  # the controller's wandb service: a rank's wandb its own
    env.update(extra)
    # a group's OMP_NUM_THREADS sets its torch threads too (torch set 1 over it: only numpy
    # got them); not the launching shell's: a rank pinned to one core keeps one thread
    if "OMP_NUM_THREADS" in extra and "ASYNCRL_THREADS" not in extra:
        env["ASYNCRL_THREADS"] = extra["OMP_NUM_THREADS"]
    env["OMP_NUM_THREADS"] = rank_threads(env)
    for key, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    pkg_root = str(Path(asyncrl.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def host_env(h: HostSpec, slots: list[int], base: Mapping[str, str],
             extra: dict[str, str]) -> dict[str, str]:
    """The environment of a group's agent on host `h`, given `slots` there. A GPU slot d is
    the host's GPU d, as the ranks find their CUDA_VISIBLE_DEVICES there (gpu_slots.py); the
    controller's own list names its machine's GPUs, so it goes only to hosts on this machine
    (local, netns), unless the group's env= sets one for every host."""
    base = dict(base)
    remote = h.via not in ("local", "netns")
    if remote and "CUDA_VISIBLE_DEVICES" not in extra:
        base.pop("CUDA_VISIBLE_DEVICES", None)
    where = {GPU_SLOTS: ",".join(map(str, slots))} if h.gpus else {}
    extra = dict(extra)
    if remote:  # its agent stops its ranks once ssh or srun here is gone, and stands in for
        where[LIFELINE] = "1"  # this process there, which its ranks cannot see (agent_main)
        extra.pop(PROCESS_ENV, None)
    return rank_env(base, {**extra, **where, "ASYNCRL_HOST_NAME": h.name,
                           "ASYNCRL_DATA_HOST": h.address})


def netns_interface(h: HostSpec) -> str:
    """The interface that holds netns host `h`'s address in its namespace (named like it)."""
    try:
        out = subprocess.run(["ip", "-n", h.name, "-o", "addr", "show", "to", h.address],
                             capture_output=True, text=True, timeout=10)
        why = out.stderr.strip() or "ip lists none"
        fields = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired) as e:
        why, fields = str(e), []
    if len(fields) < 2:
        raise ValueError(f"host {h.name!r} (via netns): no interface of network namespace "
                         f"{h.name!r} found holding its address {h.address} ({why}); give "
                         f"the host the address it has there, or the interface as "
                         f"GLOO_SOCKET_IFNAME in the group's env=")
    return fields[1].partition("@")[0]  # ("5: eth0    inet 10.0.0.2/24 ...")


def cluster_agents(cluster: Cluster, name: str, nprocs: int, extra: dict[str, str],
                   log_dir: Path, run_id: str, die_with_parent: bool,
                   scratch: Path | None = None) -> HostAgents:
    """One torchrun agent per host group `name` spreads over, meeting at the first host."""
    hosts = cluster.spread(name, nprocs)
    per = nprocs // len(hosts)
    first = hosts[0][0]
    endpoint = f"{first.address}:{cluster.rendezvous_port(name, first)}"
    agents = []
    for i, (h, slots) in enumerate(hosts):
        env = host_env(h, slots, os.environ, extra)
        if h.via == "netns" and "GLOO_SOCKET_IFNAME" not in env:  # gloo would pick the
            env["GLOO_SOCKET_IFNAME"] = netns_interface(h)  # machine's address, not the host's
        command = torchrun_command(h, env, len(hosts), i, per, endpoint, f"{name}-{run_id}",
                                   None if scratch is None else str(scratch), frozenset(extra))
        agent = Agent(name, per, env, log_dir / f"{name}.{h.name}.log", die_with_parent,
                      command, h.name, h.via in ("local", "netns"))
        agent.lifeline_env = lifeline_env(h, env, frozenset(extra))
        agents.append(agent)
    return HostAgents(agents)
