"""Group start benchmark: how long a worker group takes to start (spawn until every rank's
worker is built) and to close, side by side in one run:

    asyncrl         the default: torchrun agents and ranks forked from the process's agent
                    server (asyncrl/controller/agent_fork.py, asyncrl/actors/rank_fork.py)
    asyncrl-agents  ranks started anew (ASYNCRL_FORK_RANKS=0): each imports torch itself
    asyncrl-anew    torchrun started anew too (ASYNCRL_FORK_AGENTS=0), as before session 19
    ray             Ray actors (one per rank) whose constructor does the same work; ray.init
                    is not counted (its worker pool starts there)

Workloads: "noop" (a worker that builds nothing) on 1 and 2 ranks, and "policy": a 2-rank
hybrid tiny-llama Policy (FSDP2 + the built-in engine; Ray's actors build the same model and
engine config, without a process group). Each system runs in a process of its own, so each
pays its own first start; `first_start_s` is that one, `start_s` the median of the rest.
What a start imports differs: asyncrl's forked ranks inherit torch, imported once by the
agent server (that cost is in the first workload's `first_start_s` only), while every Ray
actor and every rank started anew imports torch itself, in every start.

One JSON line per result:
    {"bench": "group_start", "system": ..., "workload": ..., "ranks": n, "repeats": ...,
     "first_start_s": ..., "start_s": ..., "close": ..., "close_s": ..., "machine": ...,
     "python": ..., "versions": ...}
A close lasts until the group's processes are gone, and the next start begins only then: no
start runs beside the last group's exit. asyncrl's close is graceful (every rank's
`on_close` after the calls under way, then torchrun's exit). Ray's is measured both ways, in
turns: `close_s` is `ray.kill` (a forced kill; it returns before the actors' processes have
exited, so the close waits for their pids) and `close_graceful_s` is
`actor.__ray_terminate__.remote()` (the actor exits after the calls queued before it) and the
same wait; each repeat starts the actors twice, once for each close.
Run: `.venv/bin/python benchmarks/group_start.py [--repeats 4]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from machine import describe, version

import asyncrl

POLICY = ({"preset": "tiny-llama", "seed": 0}, {"lr": 3e-3, "micro_batch_size": 2},
          {"max_new_tokens": 4})
WORKLOADS = (("noop", 1), ("noop", 2), ("policy", 2))
SYSTEMS = {"asyncrl": {}, "asyncrl-agents": {"ASYNCRL_FORK_RANKS": "0"},
           "asyncrl-anew": {"ASYNCRL_FORK_AGENTS": "0"}, "ray": {}}


class Noop(asyncrl.Worker):
    @asyncrl.register
    def built(self) -> bool:  # (never called: spawning is what is timed)
        return True


def context() -> dict[str, Any]:
    return describe(**{d: version(d) for d in ("torch", "pyzmq", "ray", "asyncrl")})


def summary(system: str, workload: str, ranks: int, starts: list[float],
            closes: list[float], close: str, **more: Any) -> dict[str, Any]:
    return {"bench": "group_start", "system": system, "workload": workload, "ranks": ranks,
            "repeats": len(closes), "first_start_s": round(starts[0], 3),
            "start_s": round(statistics.median(starts[1:] or starts), 3), "starts": len(starts),
            "close": close, "close_s": round(statistics.median(closes), 3), **more,
            **context()}


async def bench_asyncrl(system: str, repeats: int) -> list[dict[str, Any]]:
    from asyncrl.hybrid.roles import Policy

    out = []
    async with asyncrl.Controller(echo_logs=False) as ctl:
        for workload, ranks in WORKLOADS:
            starts, closes = [], []
            for i in range(repeats):
                t0 = time.perf_counter()
                if workload == "noop":
                    group = await ctl.spawn(Noop, nprocs=ranks, name=f"noop{ranks}-{i}")
                else:
                    group = await ctl.spawn(Policy, *POLICY, nprocs=ranks, name=f"policy-{i}")
                starts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await ctl.close_group(group)
                closes.append(time.perf_counter() - t0)
            out.append(summary(system, workload, ranks, starts, closes,
                               "graceful: on_close on every rank, then torchrun's exit"))
    return out


def bench_ray(repeats: int) -> list[dict[str, Any]]:
    import psutil
    import ray

    class Pid:
        def pid(self) -> int:  # (answered once the constructor is done: as __ray_ready__)
            return os.getpid()

    @ray.remote
    class RayNoop(Pid):
        def __init__(self) -> None:
            import torch  # what every rank of ours imports  # noqa: F401

    @ray.remote
    class RayPolicy(Pid):
        def __init__(self) -> None:
            from asyncrl.hybrid.engine import make_engine
            from asyncrl.hybrid.models import ModelConfig, build_model

            cfg = ModelConfig(**POLICY[0])
            self.model = build_model(cfg)  # the trainer's model
            self.engine = make_engine("builtin", cfg, None, None)  # and the engine's

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})

    def close(actors: list, pids: list[int], how: str) -> float:
        """Seconds from asking the actors to go until their processes are gone."""
        procs = [psutil.Process(pid) for pid in pids]  # (while they are there)
        t0 = time.perf_counter()
        for a in actors:
            if how == "kill":
                ray.kill(a)  # forced
            else:
                a.__ray_terminate__.remote()  # graceful: after the calls queued before it
        # neither waits for the process: psutil waits on each pid (the raylet, their
        # parent, reaps them)
        _, alive = psutil.wait_procs(procs, timeout=60)
        if alive:
            raise RuntimeError(f"Ray actor processes {[p.pid for p in alive]} were still "
                               f"there 60 s after {how}")
        return time.perf_counter() - t0

    out = []
    try:
        for workload, ranks in WORKLOADS:
            cls = RayNoop if workload == "noop" else RayPolicy
            starts: list[float] = []
            closes: dict[str, list[float]] = {"kill": [], "graceful": []}
            for _ in range(repeats):
                for how, done in closes.items():  # in turns: each start closed one way
                    t0 = time.perf_counter()
                    actors = [cls.remote() for _ in range(ranks)]
                    pids = ray.get([a.pid.remote() for a in actors])
                    starts.append(time.perf_counter() - t0)
                    done.append(close(actors, pids, how))
            out.append(summary(
                "ray", workload, ranks, starts, closes["kill"], "forced: ray.kill",
                close_graceful="actor.__ray_terminate__.remote()",
                close_graceful_s=round(statistics.median(closes["graceful"]), 3)))
    finally:
        ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--system", choices=sorted(SYSTEMS), help="(one system, in this process)")
    args = ap.parse_args()
    if args.system is None:  # each system in a process of its own
        for system, env in SYSTEMS.items():
            try:
                run = subprocess.run([sys.executable, __file__, "--system", system,
                                      "--repeats", str(args.repeats)],
                                     env={**os.environ, **env}, capture_output=True,
                                     text=True, timeout=1800)
            except subprocess.TimeoutExpired as e:  # (its ranks die with their controller)
                print(json.dumps({"bench": "group_start", "system": system,
                                  "repeats": args.repeats,
                                  "skipped": f"timed out after {e.timeout} s", **context()}),
                      flush=True)
                continue
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            if run.returncode != 0 or not lines:
                lines = [json.dumps({"bench": "group_start", "system": system,
                                     "repeats": args.repeats,
                                     "skipped": run.stderr.strip()[-500:], **context()})]
            print("\n".join(lines), flush=True)
        return
    if args.system == "ray":
        results = bench_ray(args.repeats)
    else:
        results = asyncio.run(bench_asyncrl(args.system, args.repeats))
    for r in results:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
