"""Load: 100,000 futures created, passed to another group and dropped.

A DP2 producer group makes a small TensorBatch per call; each future is passed straight to a
DP1 consumer's call (the rows go worker to worker) and dropped once the consumer answered;
calls run pipelined, `--window` in flight. Afterwards every object store must be empty; the
controller's memory growth and the ranks' are reported:

    {"bench": "load", "futures": N, "window": W, "objects_left": 0,
     "controller_rss_growth_mib": ...,
     "rank_rss_growth_mib": ..., "pass_and_drop_per_s": ...}

Run: `.venv/bin/python benchmarks/load.py [--futures 100000] [--window 256]`. Driver code
stays behind __main__ (the ranks import this file to find the workers).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

import torch
import zmq
from machine import describe, version

import asyncrl
from asyncrl import TensorBatch


class Producer(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, index: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": index["i"].float() * 2})


class Consumer(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def total(self, batch: TensorBatch) -> float:
        return float(batch["x"].sum())


async def load(futures: int, window: int) -> dict:
    import psutil

    me = psutil.Process()
    async with asyncrl.Controller(echo_logs=False) as ctl:
        producer = await ctl.spawn(Producer, nprocs=2, name="producer")
        consumer = await ctl.spawn(Consumer, nprocs=1, name="consumer")
        ranks = [psutil.Process(p) for g in (producer, consumer) for p in g.pids.values()]
        index = TensorBatch({"i": torch.arange(64)})
        expect = float(torch.arange(64).sum() * 2)

        async def burst(n: int) -> None:
            pending = [consumer.total(producer.make(index)) for _ in range(n)]
            for got in await asyncio.gather(*pending):
                assert sum(got) == expect, got

        for _ in range(4):  # warm-up: pools, allocators and sockets reach their steady state
            await burst(window)
        gc.collect()
        start_ctl, start_ranks = me.memory_info().rss, sum(r.memory_info().rss for r in ranks)
        t0 = time.perf_counter()
        done = 0
        while done < futures:
            n = min(window, futures - done)
            await burst(n)
            done += n
        elapsed = time.perf_counter() - t0
        gc.collect()
        deadline = time.monotonic() + 10  # store sizes arrive with heartbeats: poll them
        while time.monotonic() < deadline:  # noqa: ASYNC110 - no event to await
            if not any(o for g in (producer, consumer) for o, _ in g.store_stats.values()):
                break
            await asyncio.sleep(0.1)
        left = sum(o for g in (producer, consumer) for o, _ in g.store_stats.values())
        return {"bench": "load", "futures": futures, "window": window, "objects_left": left,
                "controller_rss_growth_mib": round((me.memory_info().rss - start_ctl) / 2**20, 2),
                "rank_rss_growth_mib": round(
                    (sum(r.memory_info().rss for r in ranks) - start_ranks) / 2**20, 2),
                "pass_and_drop_per_s": round(futures / elapsed, 1),
                "controller_payload_bytes": ctl.payload_bytes,
                **describe(torch=torch.__version__, pyzmq=zmq.__version__,
                           libzmq=zmq.zmq_version(), msgspec=version("msgspec"),
                           asyncrl=asyncrl.__version__)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--futures", type=int, default=100_000)
    p.add_argument("--window", type=int, default=256)
    args = p.parse_args()
    print(json.dumps(asyncrl.run(load(args.futures, args.window))), flush=True)


if __name__ == "__main__":
    main()
