"""Hybrid-engine benchmark: time of a train -> generate -> train switch on a 2-rank FSDP2
(or DeepSpeed ZeRO-3) group, beside in the same run a gloo all_gather of the same weights
across the same ranks (the floor of moving sharded weights into a full copy). Target on CPU:
switch <= 1.5x. On a GPU (one rank where there is one GPU), target <= 3x a device copy of
the weights ("memcpy"), with the optimizer's state kept (offload_optimizer=False) or
offloaded (the default); the offloaded line also times a plain round trip of that state to
pinned host memory, "host_round_trip_s", and its switch against the copy plus that,
"ratio_with_host_round_trip" (no target: the floor of what offloading moves).

One JSON line per model (on a GPU two: "optimizer": "offloaded" | "kept"): {"bench":
"hybrid_switch", "params": ..., "switch_s": ..., "baseline": "all_gather" | "memcpy",
"baseline_s": ..., "ratio": switch_s / baseline_s, "target_met": ...}. Run:
`.venv/bin/python benchmarks/hybrid_switch.py [--presets tiny-llama llama-100m]
[--backend fsdp2|zero3] [--repeat 5] [--ranks N] [--free-engine]`. `--ranks 1 --free-engine`
on a CPU host times the GPU's path there: one rank, its engine's weights freed while
training, against a copy of them (the per-tensor work a GPU switch does; on CPU a
model-sized free costs page faults, so tiny models only).
Driver code stays behind __main__ (the ranks import this file to find SwitchBench).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from machine import describe, describe_gpu, version

import asyncrl
from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.fsdp import TrainConfig
from asyncrl.hybrid.models import ModelConfig
from asyncrl.hybrid.roles import make_backend


class SwitchBench(asyncrl.Worker):
    def __init__(self, preset: str, backend: str = "fsdp2", free_engine: bool = False):
        if free_engine:  # as on a GPU (this rank's process only)
            HybridEngine._frees_memory = lambda self: True  # type: ignore[method-assign]
        cfg = ModelConfig(preset=preset)
        self.backend = make_backend(self, backend, cfg, TrainConfig())
        self.hybrid = HybridEngine(self.backend, cfg)
        # counted on the trainer: the engine's weights are freed while training (GPU); a
        # DTensor's numel is the whole parameter's, ZeRO-3's partitions carry ds_numel
        self.params = sum(getattr(p, "ds_numel", p.numel())
                          for p in self.backend.model.parameters())

    @asyncrl.register
    def switch(self, repeat: int, offload_optimizer: bool = True) -> dict:
        if not self.backend.opt.state:  # one step first: the optimizer state the switch
            self.hybrid.to_generate()  # moves off the GPU exists
            rollout = self.hybrid.generate([[1, 5, 6], [1, 7, 8]], [0, 1])
            self.hybrid.to_train()
            self.backend.train_step(rollout)
        self.hybrid.offload_optimizer = offload_optimizer
        times = []
        # one rank: no barrier (a gloo barrier of one costs about what a tiny switch does)
        barrier = dist.barrier if self.world_size > 1 else (lambda: None)
        for _ in range(repeat + 1):  # the first also warms the allocator
            barrier()
            t0 = time.perf_counter()
            self.hybrid.to_generate()
            self.hybrid.to_train()
            if torch.cuda.is_available():  # the barrier goes over gloo: it waits for no kernel
                torch.cuda.synchronize()
            barrier()
            times.append(time.perf_counter() - t0)
        return {"params": self.params, "switch_s": statistics.median(times[1:])}

    @asyncrl.register
    def which_gpu(self) -> dict | None:
        """The GPU this rank measures on (asked of a rank, whose CUDA is up: the driver's
        would be a context of its own on the GPU measured)."""
        return describe_gpu()

    @asyncrl.register
    def device_copy(self, repeat: int) -> float:
        """The GPU baseline: copying the full weights once on the device."""
        self.hybrid.to_generate()  # the engine's weights exist (freed while training)
        src = [p.detach() for p in self.hybrid.engine.model.parameters()]
        dst = [torch.empty_like(p) for p in src]
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        times = []
        for _ in range(repeat + 1):
            sync()
            t0 = time.perf_counter()
            torch._foreach_copy_(dst, src)  # in a few kernels, as the switch copies: a
            sync()  # loop of copy_() would time ~110 launches, not the bytes
            times.append(time.perf_counter() - t0)
        self.hybrid.to_train()
        return statistics.median(times[1:])

    @asyncrl.register
    def host_round_trip(self, repeat: int) -> float:
        """The floor of offloading the optimizer: its state's bytes (and ZeRO's fp32 masters)
        to pinned host memory and back, as plain copies."""
        state = [v for st in self.backend.opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim()]
        if hasattr(self.backend, "_masters"):  # ZeRO: its offloading switch moves them too
            state += [t for t in self.backend._masters() if t.is_cuda]
        times = []
        for _ in range(repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host = [v.to("cpu", non_blocking=True) for v in state]
            torch.cuda.synchronize()
            back = [h.to("cuda", non_blocking=True) for h in host]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del host, back
        return statistics.median(times[1:])

    @asyncrl.register
    def all_gather(self, repeat: int) -> float:
        local = torch.cat([_local(p) for p in self.backend.model.parameters()]).detach()
        return gather_floor(local, repeat)


def gather_floor(local: torch.Tensor, repeat: int) -> float:
    """The median time of an all_gather of every rank's `local` into one tensor. FSDP2's
    shards are uneven where a dimension does not divide by the ranks (3 ranks: 43, 43 and 42
    rows of a 128-row weight) and all_gather_into_tensor needs equal ones: each is padded to
    the largest, as FSDP2 pads its own gather's."""
    size = torch.tensor([local.numel()])
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    local = torch.nn.functional.pad(local, (0, int(size) - local.numel()))
    out = torch.empty(local.numel() * dist.get_world_size(), dtype=local.dtype)
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _local(p: torch.Tensor) -> torch.Tensor:
    """A rank's shard of a parameter: FSDP2's DTensor's, ZeRO-3's partition, else whole."""
    if hasattr(p, "to_local"):
        return p.to_local().reshape(-1)
    return getattr(p, "ds_tensor", p).reshape(-1)


async def bench(presets: list[str], repeat: int, backend: str, ranks: int | None,
                free_engine: bool) -> None:
    async with asyncrl.Controller(construct_timeout=900) as ctl:
        for preset in presets:
            if ranks is None:
                ranks = 1 if torch.cuda.device_count() == 1 else 2  # one GPU: one rank
            group = await ctl.spawn(SwitchBench, preset, backend, free_engine, nprocs=ranks,
                                    name=f"switch-{preset}")
            gpu = torch.cuda.is_available()
            where = {"gpu": (await group.which_gpu())[0]} if gpu else {}
            copied = gpu or ranks == 1  # nothing to gather: the floor is a copy
            copy = (await (group.device_copy(repeat) if copied else
                           group.all_gather(repeat)))[0]
            # on a GPU, also with the optimizer's state kept there (Policy(offload_optimizer=
            # False)); the default offload's floor adds that state's bytes to the host and back
            # (on CPU the optimizer's state never moves: "kept" is what a freed engine times)
            modes = (True, False) if gpu else (False,) if free_engine else (True,)
            for offload in modes:
                switch = (await group.switch(repeat, offload))[0]
                # offloaded on a GPU: Adam's state to the host and back, beside the baseline
                # (not in it: baseline_s is the issue's, the copy or the all_gather alone)
                trip: dict[str, float] = {}
                if gpu and offload:
                    rt = (await group.host_round_trip(repeat))[0]
                    trip = {"host_round_trip_s": round(rt, 6), "ratio_with_host_round_trip":
                            round(switch["switch_s"] / (copy + rt), 2)}
                limit = 3.0 if copied else 1.5
                print(json.dumps({
                    "bench": "hybrid_switch", "preset": preset, "backend": backend,
                    "params": switch["params"], "ranks": ranks, "repeat": repeat,
                    # (on CPU the state is on the host either way: nothing moves)
                    "optimizer": ("offloaded" if offload else "kept") if gpu else "on host",
                    "switch_s": round(switch["switch_s"], 6),
                    "baseline": "memcpy" if copied else "all_gather",
                    "baseline_s": round(copy, 6),
                    "free_engine": free_engine or gpu,
                    "ratio": round(switch["switch_s"] / copy, 2),
                    "target_met": switch["switch_s"] <= limit * copy, **trip,
                    "torch": torch.__version__,  # (beside versions: where older lines had it)
                    **describe(torch=torch.__version__, deepspeed=version("deepspeed"),
                               transformers=version("transformers"),
                               asyncrl=asyncrl.__version__), **where}), flush=True)
            await ctl.close_group(group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny-llama", "llama-100m"])
    p.add_argument("--backend", choices=("fsdp2", "zero3"), default="fsdp2")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--ranks", type=int, default=None, help="default: 1 on one GPU, else 2")
    p.add_argument("--free-engine", action="store_true",
                   help="free the engine's weights while training, as on a GPU")
    args = p.parse_args()
    asyncrl.run(bench(args.presets, args.repeat, args.backend, args.ranks, args.free_engine))


if __name__ == "__main__":
    main()
