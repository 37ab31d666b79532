"""LoRA benchmark: what adapters save, measured beside full fine-tuning, and our LoRA layer
beside peft's on the same model in the same run.

    train_step   one process: forward + backward + AdamW step of a ~100M Llama (batch x
                 tokens), full fine-tuning, asyncrl's LoRA and peft's LoRA (same rank, alpha
                 and layers): seconds, trained parameters, optimizer state bytes
                 (target: asyncrl's step within 1.1x of peft's)
    switch       a 2-rank FSDP2 hybrid engine, train -> generate -> train, after the first
                 switch (LoRA: the frozen model is gathered once, the adapters after)
    weight_sync  a 2-rank trainer -> a rollout rank: sync_pack + load_weights, bytes moved

One JSON line per result: {"bench": "lora", "what": ..., "system": "full" | "asyncrl" |
"peft", ...}. Run: `.venv/bin/python benchmarks/lora.py [--preset llama-100m] [--rank 16]`.
Driver code stays behind __main__ (the ranks import this file to find SwitchBench).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from machine import describe, version

import asyncrl
from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig
from asyncrl.hybrid.models import ModelConfig, build_model


def context() -> dict[str, Any]:
    return describe(torch=torch.__version__, transformers=version("transformers"),
                    peft=version("peft"), pyzmq=version("pyzmq"), asyncrl=asyncrl.__version__)


def model_cfg(preset: str, lora: dict[str, Any] | None) -> dict[str, Any]:
    return {"preset": preset, "lora": lora}


def median_step(model: torch.nn.Module, batch: int, tokens: int, repeat: int
                ) -> tuple[float, int]:
    """The median seconds of a training step, and the optimizer state's bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(3, 1000, (batch, tokens))
    times = []
    for _ in range(repeat + 1):  # the first also makes the optimizer state
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim())
    return statistics.median(times[1:]), state


def train_steps(preset: str, lora: dict[str, Any], batch: int, tokens: int, repeat: int) -> None:
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(2)
    full = build_model(ModelConfig(preset=preset)).train()
    ours = build_model(ModelConfig(preset=preset, lora=lora)).train()
    theirs = get_peft_model(build_model(ModelConfig(preset=preset)),
                            LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                       target_modules="all-linear")).train()
    systems = {"full": full, "asyncrl": ours, "peft": theirs}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in systems}
    # two rounds in opposite orders (full, asyncrl, peft; then peft, asyncrl, full): what the
    # order does to the allocator and the caches falls on both sides; each one's faster round
    for order in (list(systems), list(systems)[::-1]):
        for system in order:
            runs[system].append(median_step(systems[system], batch, tokens, repeat))
    results = {}
    for system, model in systems.items():
        step, state = min(runs[system])
        results[system] = step
        print(json.dumps({
            "bench": "lora", "what": "train_step", "system": system, "preset": preset,
            "rank": None if system == "full" else lora["rank"], "batch": batch,
            "tokens": tokens, "repeat": repeat, "rounds": len(runs[system]),
            "step_s": round(step, 4),
            "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "optimizer_bytes": state, **context()}), flush=True)
    print(json.dumps({"bench": "lora", "what": "train_step_vs_peft",
                      "ratio": round(results["asyncrl"] / results["peft"], 3),
                      "target_met": results["asyncrl"] <= 1.1 * results["peft"],
                      "repeat": repeat, "rounds": 2, **context()}), flush=True)
    del full, ours, theirs


class SwitchBench(asyncrl.Worker):
    def __init__(self, cfg: dict[str, Any]):
        model = ModelConfig(**cfg)
        self.backend = FSDPBackend(model, TrainConfig(), self.device_mesh)
        self.hybrid = HybridEngine(self.backend, model)

    @asyncrl.register
    def switch(self, repeat: int) -> dict:
        self.hybrid.to_generate()  # the first switch (a LoRA model's frozen weights too)
        rollout = self.hybrid.generate([[1, 5, 6], [1, 7, 8]], [0, 1])
        self.hybrid.to_train()
        self.backend.train_step(rollout)  # the optimizer state exists
        times = []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            self.hybrid.to_generate()
            self.hybrid.to_train()
            if torch.cuda.is_available():  # the barrier goes over gloo: it waits for no kernel
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return {"switch_s": statistics.median(times),
                "gathered_bytes": self.hybrid.peak_gather_bytes}


async def switches(ctl: Any, preset: str, lora: dict[str, Any], repeat: int) -> None:
    for system, cfg in (("full", model_cfg(preset, None)), ("asyncrl", model_cfg(preset, lora))):
        group = await ctl.spawn(SwitchBench, cfg, nprocs=2, name=f"switch-{system}")
        out = (await group.switch(repeat))[0]
        print(json.dumps({"bench": "lora", "what": "switch", "system": system,
                          "preset": preset, "ranks": 2, "repeat": repeat,
                          "switch_s": round(out["switch_s"], 4),
                          "peak_gather_bytes": out["gathered_bytes"], **context()}), flush=True)
        await ctl.close_group(group)


async def weight_syncs(ctl: Any, preset: str, lora: dict[str, Any], repeat: int) -> None:
    from asyncrl.hybrid.roles import Policy, Rollout

    prompts = asyncrl.TensorBatch({"prompt": [[1, 5 + i, 9] for i in range(4)],
                                   "seed": list(range(4))})
    for system, cfg in (("full", model_cfg(preset, None)), ("asyncrl", model_cfg(preset, lora))):
        trainer = await ctl.spawn(Policy, cfg, {"micro_batch_size": 4}, hybrid=False,
                                  nprocs=2, name=f"trainer-{system}")
        rollout = await ctl.spawn(Rollout, cfg, {"max_new_tokens": 4}, name=f"rollout-{system}")
        await trainer.train_step(await rollout.generate(prompts))
        times, syncs = [], []
        for _ in range(repeat + 1):  # the first maps the transfer's pooled segments
            t0 = time.perf_counter()
            syncs.append(await rollout.load_weights(trainer.sync_pack()))
            times.append(time.perf_counter() - t0)
        synced = syncs[-1]
        pack, load = (round(statistics.median(s[key] for s in syncs[1:]), 4)  # as sync_s
                      for key in ("sync/pack_s", "sync/load_s"))
        print(json.dumps({"bench": "lora", "what": "weight_sync", "system": system,
                          "preset": preset, "ranks": 2, "repeat": repeat,
                          "sync_s": round(statistics.median(times[1:]), 4),
                          "pack_s": pack,  # gathering, on rank 0
                          "load_s": load,
                          "bytes": int(synced["sync/bytes"]),
                          "tensors": int(synced["sync/tensors"]), **context()}), flush=True)
        await ctl.close_group(trainer)
        await ctl.close_group(rollout)


async def groups(preset: str, lora: dict[str, Any], repeat: int) -> None:
    async with asyncrl.Controller(construct_timeout=900) as ctl:
        await switches(ctl, preset, lora, repeat)
        await weight_syncs(ctl, preset, lora, repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-100m")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    lora = {"rank": args.rank, "alpha": 2 * args.rank}
    train_steps(args.preset, lora, args.batch, args.tokens, args.repeat)
    asyncrl.run(groups(args.preset, lora, args.repeat))


if __name__ == "__main__":
    main()
