"""Controller scale: the controller's CPU time per rank for one call, at 64, 256 and 1024 ranks.

    this process: the real Controller and GroupHandle (SimController starts other "agents")
        │ its ZeroMQ ROUTER, signed frames, the real messages
    at most 16 host processes of up to 64 simulated ranks each; every simulated rank has
    the two RankSockets of a real one ("io", "exec") and answers as a real rank would:
        Hello ×2 ─▶ Construct ─▶ Ready(methods of ScaleWorker)
        Call ─▶ Result at once (a tiny value, kept "in the store": the controller later
        sends Release) · Heartbeat both ways · Shutdown ─▶ exit

For each size: spawn, warm up, then time.process_time() of this process (the controller's
loop, its ZeroMQ I/O thread and the release of each result) over many sequential calls of

    broadcast  ScaleWorker.ping(7): ONE_TO_ALL, every rank's value collected in a list
    dp         ScaleWorker.score(batch): DP, a TensorBatch of one row per rank split across
               the ranks, each answering a one-row TensorBatch, concatenated back

in `--repeat` rounds, the best reported (CPU time on a shared machine moves with its load).
First, the floor: a plain pyzmq ROUTER here sending one frame of a Call's size to each of N
DEALERs (forked echo processes) and receiving one back, nothing else: a direct fan-out
("relay": false), the like for like of --no-relay; a relayed call's per-rank frames go through
the HostRelay threads of the host processes, whose CPU is not counted.

    {"bench": "controller_scale", "ranks": N, "call": "broadcast"|"dp"|"zmq_floor",
     "us_per_rank": ..., "zmq_io_us_per_rank": ... (the part ZeroMQ's I/O thread used), ...}

One line per (ranks, call); then the targets, in a line of its own bench
("controller_scale_summary").

Run: `.venv/bin/python benchmarks/controller_scale.py [--sizes 64,256,1024] [--repeat 3]
[--rank-calls 20000] [--warmup 0.2] [--encrypt] [--no-relay]` (about 80 s on 2 cores). The
host processes run this file with `--host`; driver code stays behind __main__.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq
from machine import describe, version

import asyncrl
from asyncrl import TensorBatch
from asyncrl.actors.protocols import mesh_coords
from asyncrl.actors.register import registered_methods
from asyncrl.comm import codec
from asyncrl.comm.auth import CurveKeys, read_curve, read_secret
from asyncrl.comm.channel import RankSocket
from asyncrl.comm.messages import (
    SPAWN_ENV,
    Call,
    Construct,
    Heartbeat,
    Hello,
    Ready,
    Result,
    Shutdown,
)
from asyncrl.comm.relay import RELAY_ROLES, HostRelay, relay_address, relay_identity
from asyncrl.controller.launcher import Agent, HostAgents, rank_env
from asyncrl.futures.store import schema_of

MAX_HOSTS = 16
RANKS_PER_HOST = 64  # two sockets each: well under ZeroMQ's 1023 sockets per context
TARGET_US = 10.0
HELLO_TIMEOUT_S = 30.0  # the floor's wait for its next peer's hello


class ScaleWorker(asyncrl.Worker):
    """What the simulated ranks stand for: they never build it, they answer as it would."""

    @asyncrl.register
    def ping(self, x: int) -> int:
        return x

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def score(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"y": batch["x"].float()})


# -- the simulated ranks (host processes) ----------------------------------------------------
class _SimRank:
    def __init__(self, ctx: zmq.Context, address: dict[str, str], group: str, rank: int,
                 secret: bytes, curve: CurveKeys | None):
        self.rank = rank
        pid = os.getpid()
        self.io = RankSocket(ctx, address["io"], f"{group}/{rank}/io/{pid}".encode(), secret,
                             curve=curve)
        self.exec = RankSocket(ctx, address["exec"], f"{group}/{rank}/exec/{pid}".encode(),
                               secret, curve=curve)


def host_main(group: str, first: int, count: int, world: int) -> None:
    """Run simulated ranks first .. first+count-1 of `group` until each is shut down."""
    env = os.environ
    secret, address = read_secret(env["ASYNCRL_SECRET_FILE"]), env["ASYNCRL_ADDR"]
    hb_interval, hb_timeout = float(env["ASYNCRL_HB_INTERVAL"]), float(env["ASYNCRL_HB_TIMEOUT"])
    methods = registered_methods(ScaleWorker)
    one = 1  # each method's answer, as the real rank's `keep` would send it
    small = TensorBatch({"y": torch.zeros(1)})
    answers = {"ping": (msgspec.Raw(codec.encode(one)), schema_of(one)),
               "score": (msgspec.Raw(codec.encode(small)), schema_of(small))}
    ctx = zmq.Context()
    curve = read_curve(env["ASYNCRL_SECRET_FILE"])  # None unless --encrypt
    relays, addresses = [], {"io": address, "exec": address}
    if env.get("ASYNCRL_RELAY"):  # this host's relays, as its local rank 0 would run them
        for role in RELAY_ROLES:
            addresses[role] = relay_address(env["ASYNCRL_RELAY"], int(env["GROUP_RANK"]), role)
            relays.append(HostRelay(address, addresses[role],
                                    relay_identity(group, first, role, str(os.getpid())),
                                    secret, curve).start())
        curve = None
    ranks = [_SimRank(ctx, addresses, group, r, secret, curve)
             for r in range(first, first + count)]
    poller = zmq.Poller()
    owner: dict[Any, tuple[_SimRank, RankSocket]] = {}
    host = socket.gethostname()
    for sim in ranks:
        for role, sock in (("io", sim.io), ("exec", sim.exec)):
            sock.send(Hello(group, sim.rank, world, sim.rank % RANKS_PER_HOST, os.getpid(),
                            host, role, spawn=env.get(SPAWN_ENV, "")))
            poller.register(sock._sock, zmq.POLLIN)
            owner[sock._sock] = (sim, sock)
    running = len(ranks)
    last_heard = next_beat = time.monotonic()
    while running:
        for zsock, _ in poller.poll(max(0, int((next_beat - time.monotonic()) * 1000))):
            sim, sock = owner[zsock]
            msg = sock.recv(0)
            if msg is None:
                continue
            last_heard = time.monotonic()
            if isinstance(msg, Call):
                value, schema = answers[msg.method]
                sock.send(Result(msg.call_id, sim.rank, value=value, schema=schema))
            elif isinstance(msg, Construct):
                sock.send(Ready(sim.rank, methods=methods,
                                coords=mesh_coords(tuple(msg.mesh), sim.rank)))
            elif isinstance(msg, Shutdown):
                poller.unregister(zsock)
                running -= 1
        now = time.monotonic()
        if now >= next_beat:
            for sim in ranks:
                sim.io.send(Heartbeat())
            next_beat = now + hb_interval
        if now - last_heard > hb_timeout:
            sys.exit(f"controller_scale host {group}:{first}: the controller went silent")
    for sim in ranks:
        sim.io.close()
        sim.exec.close()
    for relay in relays:
        relay.close()
    ctx.term()


class SimController(asyncrl.Controller):
    """The real Controller; its groups' ranks are simulated by host processes of this file."""

    def _make_agent(self, name: str, nprocs: int, extra: dict[str, str]) -> HostAgents:
        assert self.run_dir is not None
        hosts = min(MAX_HOSTS, -(-nprocs // RANKS_PER_HOST))
        per = -(-nprocs // hosts)
        env = rank_env(dict(os.environ), extra)
        agents = []
        for i, first in enumerate(range(0, nprocs, per)):
            count = min(per, nprocs - first)
            command = [sys.executable, os.path.abspath(__file__), "--host", name, str(first),
                       str(count), str(nprocs)]
            agents.append(Agent(name, count, {**env, "GROUP_RANK": str(i)},
                                self.run_dir / "logs" / f"{name}.{i}.log", True, command))
        return HostAgents(agents)


# -- the measurement ---------------------------------------------------------------------------
def context() -> dict[str, Any]:
    return describe(torch=version("torch"), pyzmq=zmq.__version__, libzmq=zmq.zmq_version(),
                    msgspec=msgspec.__version__, uvloop=version("uvloop"),
                    asyncrl=asyncrl.__version__)


def zmq_io_cpu() -> float:
    """CPU seconds of this process's ZeroMQ I/O threads so far (0 where /proc is missing):
    from schedstat's run time in ns where the kernel has it; else from stat's utime + stime,
    in clock ticks (10 ms: a repeat's I/O time is only a few ticks, so that reading is +-1
    tick, +-25-50 %; the figures benchmarks/README.md quotes were read so)."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if not stat[stat.index("(") + 1:stat.rindex(")")].startswith("ZMQbg/IO"):
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def timed(run: Callable[[], Any]) -> tuple[float, float, float]:
    """(CPU seconds of this process, of its ZeroMQ I/O threads, wall seconds) of run()."""
    cpu, io, wall = time.process_time(), zmq_io_cpu(), time.perf_counter()
    run()
    return time.process_time() - cpu, zmq_io_cpu() - io, time.perf_counter() - wall


def record(n: int, call: str, calls: int, repeats: list[tuple[float, float, float]],
           **extra: Any) -> dict[str, Any]:
    """The best of the repeats (the least disturbed by other work on the machine), and their
    median."""
    per = calls * n
    cpu, io, wall = min(repeats)
    return {"bench": "controller_scale", "ranks": n, "call": call,
            "us_per_rank": round(cpu / per * 1e6, 2),
            "zmq_io_us_per_rank": round(io / per * 1e6, 2),  # of which ZeroMQ's I/O thread
            "us_per_rank_median": round(statistics.median(r[0] for r in repeats) / per * 1e6, 2),
            "us_per_call": round(cpu / calls * 1e6, 1), "calls": calls,
            "repeats": len(repeats), "wall_s": round(wall, 3), **extra}


async def measure(ctl: SimController, n: int, kinds: list[str], calls: int, warmup: int,
                  repeat: int) -> list[dict]:
    t0 = time.perf_counter()
    group = await ctl.spawn(ScaleWorker, nprocs=n, name=f"sim{n}")
    spawn_s = round(time.perf_counter() - t0, 2)
    batch = TensorBatch({"x": torch.arange(n)})

    async def one(call: str) -> None:
        if call == "broadcast":
            assert await group.ping(7) == [1] * n
        else:
            assert len(await group.score(batch)) == n

    async def many(call: str, count: int) -> tuple[float, float, float]:
        cpu, io, wall = time.process_time(), zmq_io_cpu(), time.perf_counter()
        for _ in range(count):
            await one(call)
        return time.process_time() - cpu, zmq_io_cpu() - io, time.perf_counter() - wall

    for call in kinds:
        await many(call, warmup)
    repeats: dict[str, list[tuple[float, float, float]]] = {call: [] for call in kinds}
    for _ in range(repeat):  # the calls take turns: a disturbance hits each alike
        for call in kinds:
            repeats[call].append(await many(call, calls))
    relayed = bool(ctl.relay_of)
    await ctl.close_group(group)
    return [record(n, call, calls, repeats[call], hosts=len(group.agent.agents),
                   spawn_s=spawn_s, relay=relayed, warmup=warmup) for call in kinds]


def plan(n: int, rank_calls: int, warmup: float) -> tuple[int, int]:
    """(timed calls, untimed warm-up calls) for n ranks: the same for the floor and the calls."""
    calls = max(10, rank_calls // n)
    return calls, max(2, int(calls * warmup))


async def bench(sizes: list[int], kinds: list[str], rank_calls: int, warmup: float,
                repeat: int, encrypt: bool, relay: bool | None) -> list[dict]:
    # heartbeats every 30 s: supervision is not what a call costs (it runs between calls)
    async with SimController(heartbeat_interval=30, heartbeat_timeout=120, echo_logs=False,
                             shutdown_grace=10, encrypt=encrypt, relay=relay) as ctl:
        results = []
        for n in sizes:
            results += await measure(ctl, n, kinds, *plan(n, rank_calls, warmup), repeat)
        return results


# -- the floor: raw pyzmq, the same frames, no asyncrl ------------------------------------------
def echo_peers(conn: Any, first: int, count: int, parent: int) -> None:
    """A forked child: `count` DEALERs to the address `conn` brings that send a hello, then
    echo every message (until told to stop, or the parent is gone)."""
    while not conn.poll(1):
        if os.getppid() != parent:
            return
    address = conn.recv()
    ctx = zmq.Context()
    socks = []
    for i in range(first, first + count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"peer%d" % i)
        sock.setsockopt(zmq.LINGER, 0)  # an exit never waits on a hello not yet taken
        sock.connect(address)
        sock.send(b"hello")
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    while os.getppid() == parent:
        for sock, _ in poller.poll(1000):
            frames = sock.recv_multipart()
            if frames[0] == b"stop":
                return
            sock.send_multipart(frames)


def hellos(router: zmq.Socket, n: int, procs: list[Any]) -> list[bytes]:
    """The identities of the n peers, from their hellos; an error naming the open-file limit
    if an echo process exits or the hellos stop short (libzmq failing to accept a peer past
    the limit says nothing)."""
    peers: list[bytes] = []
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    while len(peers) < n:
        if router.poll(100):
            peers.append(router.recv_multipart()[0])
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            continue
        dead = [proc.exitcode for proc in procs if proc.exitcode is not None]
        if dead or time.monotonic() > deadline:
            why = f"an echo process exited ({dead[0]})" if dead else \
                f"no more within {HELLO_TIMEOUT_S:.0f} s"
            raise RuntimeError(
                f"zmq_floor: heard {len(peers)} of {n} peers' hellos, {why}; the open-file "
                f"limit is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} (a descriptor per "
                f"peer here, two per peer in an echo process): raise it with `ulimit -n` or "
                f"give smaller --sizes")
    return peers


def zmq_floor(n: int, calls: int, warmup: int, repeat: int) -> dict[str, Any]:
    """One 3-part frame of a Call's size to each of n peers and one back, from a plain ROUTER
    (blocking receives, no signing, no decoding): what ZeroMQ alone costs per rank here."""
    fork = mp.get_context("fork")  # no asyncrl import per child: forked before any thread
    per = -(-n // min(MAX_HOSTS, -(-n // RANKS_PER_HOST)))
    # a descriptor here per peer, two per peer in an echo process (which inherits ours):
    # past the limit libzmq fails to accept without a word, and the hellos never come
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = len(os.listdir("/proc/self/fd")) + max(n, 2 * per) + 16 \
        if os.path.isdir("/proc/self/fd") else 0
    if soft != resource.RLIM_INFINITY and need > soft:
        raise RuntimeError(f"zmq_floor: {n} peers need about {need} open files, more than the "
                           f"open-file limit of {soft}; raise it (`ulimit -n {need}`; the "
                           f"hard limit bounds it) or give smaller --sizes or --no-floor")
    procs, pipes = [], []
    for first in range(0, n, per):
        child_end, our_end = fork.Pipe(duplex=False)
        procs.append(fork.Process(target=echo_peers, daemon=True,
                                  args=(child_end, first, min(per, n - first), os.getpid())))
        procs[-1].start()
        pipes.append(our_end)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    for pipe in pipes:
        pipe.send(address)
        pipe.close()
    peers: list[bytes] = []
    try:
        peers = hellos(router, n, procs)
        body, mac = b"b" * 70, b"m" * 32

        def one() -> None:
            for peer in peers:
                router.send(peer, zmq.SNDMORE)
                router.send(body, zmq.SNDMORE)
                router.send(mac)
            for _ in range(n):
                frame = router.recv(copy=False)
                while frame.more:
                    frame = router.recv(copy=False)

        def many(count: int) -> None:
            for _ in range(count):
                one()

        many(warmup)
        # relay False: a direct fan-out, one frame per rank from here (the like for like of
        # --no-relay; a relayed call's per-rank frames are sent by relays in the hosts)
        return record(n, "zmq_floor", calls, [timed(lambda: many(calls)) for _ in range(repeat)],
                      hosts=len(procs), relay=False, warmup=warmup)
    finally:
        for peer in peers:
            router.send_multipart([peer, b"stop"])
        for proc in procs:
            proc.join(10 if len(peers) == n else 0)  # a peer not heard is not told to stop
            if proc.is_alive():
                proc.kill()
        router.close(0)
        ctx.term()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        group, first, count, world = sys.argv[2], *map(int, sys.argv[3:6])
        host_main(group, first, count, world)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64,256,1024", help="group sizes (ranks), comma-separated")
    p.add_argument("--calls", default="broadcast,dp", help="which calls: broadcast, dp")
    p.add_argument("--rank-calls", type=int, default=20_000,
                   help="calls x ranks timed per size, call and repeat (at least 10 calls)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds; the best is reported")
    p.add_argument("--warmup", type=float, default=0.2, help="untimed calls, as a share")
    p.add_argument("--no-floor", action="store_true", help="skip the raw ZeroMQ floor")
    p.add_argument("--encrypt", action="store_true", help="Controller(encrypt=True): CURVE")
    p.add_argument("--no-relay", action="store_true",
                   help="Controller(relay=False): every rank talks to the controller itself")
    args = p.parse_args()
    # descriptors up to the hard limit (as a rank raises its own): the floor holds one per
    # peer, 1024 at the largest default size, which a soft limit of 1024 cannot hold
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # (a container's odd limits: as they are)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    logging.getLogger("asyncrl").setLevel(logging.ERROR)  # "ranks share cores": expected
    ctx = {**context(), "warmup_share": args.warmup,
           # where zmq_io_us_per_rank was read from: "schedstat" (ns) or "stat" (10 ms ticks)
           "zmq_io_from": "schedstat" if os.path.exists(
               f"/proc/self/task/{threading.get_native_id()}/schedstat") else "stat"}
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.calls.split(",")
    floors = [] if args.no_floor else [  # first: forked before any thread is started
        zmq_floor(n, *plan(n, args.rank_calls, args.warmup), args.repeat) for n in sizes]
    results = asyncrl.run(bench(sizes, kinds, args.rank_calls, args.warmup, args.repeat,
                                args.encrypt, False if args.no_relay else None))
    for rec in results:
        rec["encrypt"] = args.encrypt
    for rec in floors + results:
        print(json.dumps({**rec, **ctx}), flush=True)
    by = {(r["ranks"], r["call"]): r["us_per_rank"] for r in results}
    largest, smallest = max(sizes), min(sizes)
    # a bench of its own: a reader of the lines never takes it for a result
    summary: dict[str, Any] = {"bench": "controller_scale_summary", "summary": True,
                               "target_us_per_rank": TARGET_US, "encrypt": args.encrypt,
                               # the calls' at the largest size (the floor's is direct)
                               "relay": next(r["relay"] for r in results
                                             if r["ranks"] == largest)}
    for call in kinds:
        top, base = by[(largest, call)], by[(smallest, call)]
        # the target: at most TARGET_US per rank at the largest size, and no faster than
        # linear growth (the cost per rank not rising with the ranks)
        summary[call] = {"us_per_rank": top, "met": top <= TARGET_US and top <= base,
                         f"growth_{smallest}_to_{largest}": round(top / base, 2)}
    if floors:
        summary["zmq_floor_us_per_rank"] = floors[-1]["us_per_rank"]
    print(json.dumps({**summary, **ctx}), flush=True)


if __name__ == "__main__":
    main()
