"""Data-plane benchmark: a TensorBatch already produced on one group, handed to another group
whose ranks read every byte (a sum), in GiB/s — side by side in one run with Ray and with a
single-thread copy of the same bytes between two already-allocated buffers.

    asyncrl  producer DP2 -> consumer DP2 / DP1: the consumer's ranks pull their rows from
             the producer's ranks (shared memory on one host), the controller carries none;
             then the same over ZeroMQ TCP (transport="tcp"), for reference
    ray      two actors return the tensors; the ObjectRefs go to one or two actors that sum
             (torch tensors, as the issue defines the peer; and numpy arrays, which Ray
             reads from its store without a copy: their copy into the store is made when
             the actor returns, before the timing starts; reported, no target)
    memcpy   torch copy_ of the same bytes, one thread, both buffers warm, on the huge pages
             the ranks ask for (the issue's baseline, measured first); and again right before
             asyncrl's run with as many threads as ranks copy at once in its hand-offs (its
             two producers), each thread copying its share: a second baseline, reported
             beside the first (no target)

Then dp2 -> dp1 again with the producing call inside the timing (layout "dp2->dp1+produce",
asyncrl and both Ray variants): every system's copies counted, wherever it makes them.
Then a lifetime check: 10,000 calls whose results are passed on and dropped; the object
stores must end empty and the ranks' memory flat.

One JSON line per result on stdout, {"bench": "data_plane", "system", "layout", "gib_per_s",
...}, each (system, layout) once a run (the 2-thread copy is layout "copy-2threads"); the
lifetime check and the ratios are lines of their own bench, "data_plane_lifetimes" and
"data_plane_summary", which a reader of the issue's lines cannot take for a result. A line
with "skipped" says what did not run and has no figures. Run: `make bench-data` or
`.venv/bin/python benchmarks/data_plane.py [--mib 256] [--repeat 5] [--quick]`.
The ranks import this file to find the worker classes: driver code stays behind __main__.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
from machine import describe, describe_gpu, version
from quick import add_counts, fill_counts

try:
    import psutil
except ImportError:  # the lifetime check says it skipped, after the rest
    psutil = None

import asyncrl
from asyncrl import Dispatch, TensorBatch
from asyncrl.actors.rank_fork import RANK_ENV_DEFAULTS

ROW = 1024  # float32 values per row: 4 KiB rows
PRODUCERS = 2  # the source's ranks: each copies its rows into the consumer's segment


class Source(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, index: TensorBatch, device: str = "cpu") -> TensorBatch:
        return TensorBatch({"x": torch.ones(len(index), ROW, device=device)})

    @asyncrl.register(dispatch=Dispatch.DP)
    def small(self, index: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": torch.ones(len(index), 16)})


class Sink(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def total(self, batch: TensorBatch) -> float:
        x = batch["x"]  # a CUDA float32 sum of 2^28 ones can round; on CPUs (cascade
        # summation) it is exact, and a float64 sum there is 20x slower than the read
        return float(x.sum(dtype=torch.float64) if x.is_cuda else x.sum())


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def context(args: argparse.Namespace) -> dict[str, Any]:
    """The machine and versions, and how each figure was taken: `repeat` timed runs (their
    median) after one untimed, torch's huge pages on or off (see main())."""
    return {**describe(**{d: version(d) for d in ("torch", "ray", "pyzmq", "asyncrl")}),
            "repeat": args.repeat, "warmup": 1,
            "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE")}


def gib_per_s(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {"gib_per_s": round(nbytes / statistics.median(seconds) / 2**30, 3),
            "gib_per_s_best": round(nbytes / min(seconds) / 2**30, 3)}


# -- memcpy --------------------------------------------------------------------------------
def bench_memcpy(nbytes: int, repeat: int, ctx: dict[str, Any], threads: int = 1
                 ) -> dict[str, Any]:
    """A copy of `nbytes` between two warm buffers by `threads` threads at once, each copying
    a contiguous share of one thread's torch `copy_` (which lets go of the GIL)."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.zeros(nbytes // 4)
    dst.copy_(src)  # both buffers warm
    pairs = list(zip(dst.chunk(threads), src.chunk(threads), strict=True))
    times = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            if threads == 1:
                dst.copy_(src)
            else:
                list(pool.map(lambda pair: pair[0].copy_(pair[1]), pairs))
            times.append(time.perf_counter() - t0)
    # the baseline is one thread, "copy"; another count is a layout of its own
    layout = "copy" if threads == 1 else f"copy-{threads}threads"
    rec = {"bench": "data_plane", "system": "memcpy", "layout": layout, "threads": threads,
           "mib": nbytes >> 20, **gib_per_s(nbytes, times), **ctx}
    emit(rec)
    return rec


# -- GPU -----------------------------------------------------------------------------------
def bench_gpu(nbytes: int, repeat: int, ctx: dict[str, Any]) -> None:
    # which GPU (the driver's first: its copy below starts CUDA here anyway; the ranks are on
    # GPUs of the same host)
    ctx = {**ctx, "gpu": describe_gpu()}
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    emit({"bench": "data_plane", "system": "memcpy", "layout": "copy", "device": "cuda",
          "mib": nbytes >> 20, **gib_per_s(nbytes, times), **ctx})
    del src, dst
    asyncrl.run(_asyncrl(nbytes, repeat, 0, ctx, device="cuda"))


# -- ray -----------------------------------------------------------------------------------
def bench_ray(nbytes: int, repeat: int, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        emit({"bench": "data_plane", "system": "ray", "skipped": "ray is not installed", **ctx})
        return []

    @ray.remote(num_cpus=0)
    class RaySource:
        def make(self, rows: int) -> torch.Tensor:
            return torch.ones(rows, ROW)

        def make_numpy(self, rows: int) -> Any:  # Ray's zero-copy kind: read from its store
            return np.ones((rows, ROW), np.float32)

    @ray.remote(num_cpus=0)
    class RaySink:
        def total(self, *parts: Any) -> float:  # numpy's arrays summed by torch too (no
            # copy): numpy's float32 sum reads at about half torch's speed here
            return float(sum((torch.from_numpy(p) if isinstance(p, np.ndarray) else p).sum()
                             for p in parts))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=max(4 * nbytes, 1 << 30))
    out = []
    try:
        sources = [RaySource.remote() for _ in range(2)]
        sinks = [RaySink.remote() for _ in range(2)]
        rows = nbytes // (ROW * 4) // 2
        # torch tensors (pickled: the sink copies them out of the store) and numpy arrays
        # (Ray's zero-copy reads from its store): its usual and its fastest hand-off
        for system, make in (("ray", "make"), ("ray-numpy", "make_numpy")):
            refs = [getattr(s, make).remote(rows) for s in sources]
            ray.wait(refs, num_returns=2)  # already produced
            for layout in ("dp2->dp2", "dp2->dp1"):
                times = []
                for _ in range(repeat + 1):
                    t0 = time.perf_counter()
                    if layout == "dp2->dp2":
                        ray.get([k.total.remote(r) for k, r in zip(sinks, refs, strict=True)])
                    else:
                        ray.get(sinks[0].total.remote(*refs))
                    times.append(time.perf_counter() - t0)
                rec = {"bench": "data_plane", "system": system, "layout": layout,
                       "mib": nbytes >> 20, **gib_per_s(nbytes, times[1:]), **ctx}
                emit(rec)
                out.append(rec)
            del refs
            out.append(_timed(lambda make=make: ray.get(sinks[0].total.remote(
                *[getattr(s, make).remote(rows) for s in sources])), system, nbytes, repeat, ctx))
    finally:
        ray.shutdown()
    return out


def _timed(hand_off: Any, system: str, nbytes: int, repeat: int,
           ctx: dict[str, Any]) -> dict[str, Any]:
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        hand_off()
        times.append(time.perf_counter() - t0)
    return _produced_too(system, nbytes, times, ctx)


def _produced_too(system: str, nbytes: int, times: list[float],
                  ctx: dict[str, Any]) -> dict[str, Any]:
    """dp2 -> dp1 with the producing call inside the timing: where each system makes its
    copies (Ray's numpy arrays into its store as the actor returns, asyncrl's rows into the
    consumer's segment on the pull), all of them counted: a layout of its own, not the
    issue's dp2->dp1 (its batch already produced)."""
    rec = {"bench": "data_plane", "system": system, "layout": "dp2->dp1+produce",
           "timed": "produce+hand-off", "mib": nbytes >> 20,
           **gib_per_s(nbytes, times[1:]), **ctx}
    emit(rec)
    return rec


# -- asyncrl -------------------------------------------------------------------------------
async def _asyncrl(nbytes: int, repeat: int, calls: int, ctx: dict[str, Any],
                   transport: str = "auto", device: str = "cpu") -> list[dict]:
    out = []
    # on GPUs: the sinks on the source's GPUs (CUDA IPC opens memory of a GPU the consumer
    # sees), two ranks per GPU where there are fewer than two
    share = [asyncrl.share_gpus(2)] if device == "cuda" and torch.cuda.device_count() < 2 \
        else []
    async with asyncrl.Controller(transport=transport) as ctl:
        source = await ctl.spawn(Source, nprocs=PRODUCERS, name="source", place=share)
        near = [asyncrl.colocate_with(source), *share] if device == "cuda" else []
        sinks = {"dp2->dp2": await ctl.spawn(Sink, nprocs=2, name="sink2", place=near),
                 "dp2->dp1": await ctl.spawn(Sink, nprocs=1, name="sink1", place=near)}
        rows = nbytes // (ROW * 4)
        produced = source.make(TensorBatch({"i": torch.arange(rows)}), device)
        await produced._fut  # already produced: its data stays on the source's ranks
        for layout, sink in sinks.items():
            times = []
            for _ in range(repeat + 1):  # the first pull also fills the consumer's pool
                t0 = time.perf_counter()
                total = await sink.total(produced)
                times.append(time.perf_counter() - t0)
                assert sum(total) == rows * ROW, total
            rec = {"bench": "data_plane", "layout": layout,
                   "system": "asyncrl" if transport == "auto" else f"asyncrl-{transport}",
                   "transport": ("cuda_ipc" if device == "cuda" else "shm")
                   if transport == "auto" else transport, "device": device,
                   "mib": nbytes >> 20, **gib_per_s(nbytes, times[1:]),
                   "controller_payload_bytes": ctl.payload_bytes, **ctx}
            emit(rec)
            out.append(rec)
        del produced
        if transport == "auto" and device == "cpu":
            index = TensorBatch({"i": torch.arange(rows)})
            times = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                await sinks["dp2->dp1"].total(source.make(index))
                times.append(time.perf_counter() - t0)
            out.append(_produced_too("asyncrl", nbytes, times, ctx))
        if calls:
            out.append(await _lifetimes(ctl, source, sinks["dp2->dp1"], calls, ctx))
    return out


async def _lifetimes(ctl: asyncrl.Controller, source: Any, sink: Any, calls: int,
                     ctx: dict[str, Any]) -> dict[str, Any]:
    if psutil is None:
        rec = {"bench": "data_plane_lifetimes", "check": "lifetimes",
               "skipped": "psutil is not installed", **ctx}
        emit(rec)
        return rec
    procs = [psutil.Process(p) for g in (source, sink) for p in g.pids.values()]

    def rss() -> int:
        return sum(p.memory_info().rss for p in procs)

    index = TensorBatch({"i": torch.arange(64)})
    for _ in range(200):  # warm-up: pools and allocators reach their steady state
        await sink.total(source.small(index))
    gc.collect()
    start = rss()
    t0 = time.perf_counter()
    for _ in range(calls):
        await sink.total(source.small(index))
    elapsed = time.perf_counter() - t0
    gc.collect()
    deadline = time.monotonic() + 10  # store sizes arrive with heartbeats
    while time.monotonic() < deadline and any(
            o for g in (source, sink) for o, _ in g.store_stats.values()):
        await asyncio_sleep(0.1)
    left = sum(o for g in (source, sink) for o, _ in g.store_stats.values())
    rec = {"bench": "data_plane_lifetimes", "system": "asyncrl", "check": "lifetimes",
           "calls": calls, "objects_left": left,
           "rank_rss_growth_mib": round((rss() - start) / 2**20, 2),
           "pass_and_drop_per_s": round(calls / elapsed, 1), **ctx}
    emit(rec)
    return rec


async def asyncio_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


# the sizes' defaults, and --quick's (which fill only the sizes not given)
FULL = {"mib": 256, "repeat": 5, "calls": 10_000}
QUICK = {"mib": 32, "repeat": 2, "calls": 500}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_counts(p, {"mib": "size of the batch (MiB)", "repeat": "timed hand-offs per layout",
                   "calls": "calls for the lifetime check"}, FULL, QUICK, "sizes")
    p.add_argument("--gpu", action="store_true",
                   help="only the GPU hand-offs (CUDA IPC on one host) and a device copy")
    args = p.parse_args(argv)
    fill_counts(args, FULL, QUICK)
    return args


def main() -> None:
    args = parse()
    nbytes = args.mib << 20
    # the huge pages asyncrl's ranks ask for (RANK_ENV_DEFAULTS), here too before anything is
    # allocated: torch reads THP_MEM_ALLOC_ENABLE once, at its first CPU allocation (not on
    # import), so the memcpy baselines below copy under the ranks' setting (the memcpy
    # figures benchmarks/README.md quotes ran without it); Ray's workers inherit it, which
    # makes Ray's torch hand-off faster too (1.7 against 1.1 GiB/s dp2->dp2 here; numpy's
    # arrays take them anyway)
    os.environ.update({**RANK_ENV_DEFAULTS, **os.environ})
    ctx = context(args)
    if args.gpu:
        bench_gpu(nbytes, args.repeat, ctx)
        return
    copy = bench_memcpy(nbytes, args.repeat, ctx)
    ray_runs = bench_ray(nbytes, args.repeat, ctx)
    # the peer: actors returning torch tensors; numpy arrays reported beside it
    ray_recs = {r["layout"]: r for r in ray_runs if r["system"] == "ray" and "timed" not in r}
    numpy_recs = {r["layout"]: r for r in ray_runs
                  if r["system"] == "ray-numpy" and "timed" not in r}
    # the like for like of asyncrl's hand-offs, in which its two producers copy at once,
    # measured right before them (the one-thread copy above is the baseline)
    copy_n = bench_memcpy(nbytes, args.repeat, ctx, threads=PRODUCERS)
    ours = asyncrl.run(_asyncrl(nbytes, args.repeat, args.calls, ctx))
    asyncrl.run(_asyncrl(nbytes, args.repeat, 0, ctx, transport="tcp"))  # for reference
    summary: dict[str, Any] = {"bench": "data_plane_summary", "summary": True}
    for rec in ours:
        layout = rec.get("layout")
        if layout is None or "timed" in rec:
            continue
        vs_ray = rec["gib_per_s"] / ray_recs[layout]["gib_per_s"] if layout in ray_recs \
            else None
        vs_copy = rec["gib_per_s"] / copy["gib_per_s"]
        summary[layout] = {
            "over_ray": None if vs_ray is None else round(vs_ray, 2),
            "over_ray_numpy": round(rec["gib_per_s"] / numpy_recs[layout]["gib_per_s"], 2)
            if layout in numpy_recs else None,  # no target: its copy is made at production
            "over_ray_met": None if vs_ray is None else vs_ray >= 3,
            "over_memcpy": round(vs_copy, 2), "over_memcpy_met": vs_copy >= 0.4,
            # no target: against a copy by as many threads as its producers
            f"over_memcpy_{PRODUCERS}_threads": round(rec["gib_per_s"] / copy_n["gib_per_s"],
                                                      2)}
    emit({**summary, **ctx})


if __name__ == "__main__":
    main()
