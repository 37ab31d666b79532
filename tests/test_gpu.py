"""GPU paths: CUDA IPC between ranks on one host, GPU tensors staged through host memory
when IPC cannot be used, a 1-rank CuPy/NCCL communicator, the hybrid switch (FSDP2, ZeRO-2/3)
and weight sync. Skipped where there is no GPU; run them with
scripts/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import importlib.util
import math
import os
import time
import warnings
from typing import Any, NoReturn

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import Dispatch, TensorBatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def lacking(reason: str) -> NoReturn:
    """Skip for a missing GPU-side dependency; fail instead where scripts/gpu_check.sh asks
    (ASYNCRL_REQUIRE_GPU_DEPS=1): a skip there would pass a device run that tested nothing."""
    if os.environ.get("ASYNCRL_REQUIRE_GPU_DEPS") == "1":
        pytest.fail(f"required on the GPU machine: {reason}")
    pytest.skip(reason)


class GpuProducer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, batch: TensorBatch) -> TensorBatch:
        i = batch["i"].cuda()
        return TensorBatch({"i": i, "h": (i[:, None] * 10 + torch.arange(4, device="cuda"))
                            .to(torch.bfloat16), "cpu": batch["i"] * 2,
                            "none": torch.zeros(len(i), 0, device="cuda"),  # no bytes
                            "name": [f"r{k}" for k in batch["i"].tolist()]})


    @asyncrl.register
    def rows_seen(self, batch: TensorBatch) -> list:  # its own rows, and its peer's
        return [batch["i"].tolist(), batch["h"].float().cpu().tolist(), batch["h"].is_cuda]


class GpuConsumer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def check(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"i": batch["i"].cpu(), "h": batch["h"].float().cpu(),
                            "cpu": batch["cpu"], "name": batch["name"],
                            "none": batch["none"].cpu(),
                            "on_gpu": [bool(batch["i"].is_cuda and batch["h"].is_cuda)] * len(
                                batch)})


def _expect(out: TensorBatch, n: int) -> None:
    i = torch.arange(n)
    assert out["i"].tolist() == i.tolist()
    assert out["h"].tolist() == (i[:, None] * 10 + torch.arange(4)).float().tolist()
    assert out["cpu"].tolist() == (i * 2).tolist()
    assert out["name"] == [f"r{k}" for k in range(n)]
    assert out["none"].shape == (n, 0)
    assert all(out["on_gpu"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_gpu_rows_between_groups(transport):
    async def main():
        # two producer ranks on the one GPU a device machine has; the consumer on the same
        # GPUs, where CUDA IPC can open the producers' memory
        share = [asyncrl.share_gpus(2)] if torch.cuda.device_count() < 2 else []
        async with asyncrl.Controller(transport=transport) as ctl:
            prod = await ctl.spawn(GpuProducer, nprocs=2, name="gprod", place=share)
            cons = await ctl.spawn(GpuConsumer, nprocs=1, name="gcons",
                                   place=[asyncrl.colocate_with(prod), *share])
            pids = group_pids(prod) + group_pids(cons)
            made = prod.make(TensorBatch({"i": torch.arange(9)}))
            out = await cons.check(made)
            _expect(out, 9)
            h = (torch.arange(9)[:, None] * 10 + torch.arange(4)).float().tolist()
            # the producer's own ranks: their own rows from their store (CUDA refuses to
            # open a process's own IPC handles), their peer's by IPC (or host staging)
            for seen in await prod.rows_seen(made):
                assert seen == [list(range(9)), h, True]
            assert ctl.payload_bytes == 0
            return pids
    assert_gone(run(main(), timeout=300))


if torch.cuda.is_available():  # module level (ranks import it by path); GPU machines only
    from asyncrl.hybrid.roles import Policy

    class MeasuredPolicy(Policy):
        """A hybrid Policy on the GPU that reports device memory around its switch."""

        def __init__(self):
            super().__init__({"preset": "llama-100m"}, {"lr": 1e-4}, {"max_new_tokens": 4})

        @asyncrl.register
        def switch(self) -> dict:
            hybrid, mem = self.hybrid, torch.cuda.memory_allocated
            hybrid.to_generate()
            params = list(hybrid.engine.model.parameters())
            engine = sum(p.numel() * p.element_size() for p in params)
            biggest = max(p.numel() * p.element_size() for p in params)
            rollout = hybrid.generate([[1, 5, 6], [1, 7, 8]], [0, 1])
            hybrid.to_train()
            self.backend.train_step(rollout)  # the optimizer now holds state on the GPU
            torch.cuda.synchronize()
            training = mem()
            # what the switch itself allocates, once the optimizer state left (its first
            # step, done here by hand): the engine's weights, the gather buffers, and one
            # gathered parameter; never a second full copy
            hybrid._move_optimizer("cpu")
            torch.cuda.synchronize()
            base = mem()
            torch.cuda.reset_peak_memory_stats()
            hybrid.to_generate()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            bound = engine + hybrid.buffer_bytes + biggest
            devices = sorted({v.device.type for st in self.backend.opt.state.values()
                              for v in st.values() if isinstance(v, torch.Tensor) and v.dim()})
            hybrid.to_train()
            torch.cuda.synchronize()
            back = mem() - training
            hybrid.offload_optimizer = False  # Policy(offload_optimizer=False): it stays
            hybrid.to_generate()
            kept = sorted({v.device.type for st in self.backend.opt.state.values()
                           for v in st.values() if isinstance(v, torch.Tensor) and v.dim()})
            hybrid.to_train()
            return {"peak": peak, "bound": bound, "engine": engine, "state": devices,
                    "freed": training - base, "back": back, "kept": kept}


    class MeasuredZeroPolicy(Policy):
        """A ZeRO-2 hybrid Policy on the GPU: device memory and where the fp32 masters are,
        in training and while generating."""

        def __init__(self, backend: str = "zero2"):
            super().__init__({"preset": "llama-100m"}, {"lr": 1e-4}, {"max_new_tokens": 4},
                             backend=backend)

        @asyncrl.register
        def switch(self) -> dict:
            hybrid, mem = self.hybrid, torch.cuda.memory_allocated
            hybrid.to_generate()
            rollout = hybrid.generate([[1, 5, 6], [1, 7, 8]], [0, 1])
            hybrid.to_train()
            self.backend.train_step(rollout)  # Adam's moments now exist on the GPU
            torch.cuda.synchronize()
            training = mem()
            hybrid.to_generate()
            torch.cuda.synchronize()
            generating = mem()
            masters_while = sorted({t.device.type for t in self.backend._masters()})
            engine = sum(p.numel() * p.element_size() for p in hybrid.engine.model.parameters())
            hybrid.to_train()
            torch.cuda.synchronize()
            # (ZeRO-3 empties its partitioned parameters: their real size is ds_numel)
            params = sum(getattr(p, "ds_numel", p.numel())
                         for p in self.backend.model.parameters())
            return {"params": params, "training": training, "generating": generating,
                    "engine": engine, "masters_while": masters_while,
                    "masters_after": sorted({t.device.type for t in self.backend._masters()}),
                    "offloaded": hybrid.offloaded_bytes, "back": mem() - training,
                    "loss": self.backend.train_step(rollout)["loss"]}


def switch_report(policy: type, name: str, *args: Any) -> dict:
    """What one switch of a 1-rank `policy` group measured (its processes gone after)."""
    async def main():
        async with asyncrl.Controller(construct_timeout=600) as ctl:
            group = await ctl.spawn(policy, *args, nprocs=1, name=name)
            pids = group_pids(group)
            return (await group.switch())[0], pids
    report, pids = run(main(), timeout=600)
    assert_gone(pids)
    return report


def test_hybrid_switch_on_gpu_frees_optimizer_state_and_bounds_peak_memory():
    report = switch_report(MeasuredPolicy, "gpolicy")
    assert report["state"] == ["cpu"]  # optimizer state left the GPU while generating
    assert report["freed"] > report["engine"], report  # Adam's two moments, at least
    # (the bound is not compared with the engine: a bf16 engine is half its fp32 buffers)
    assert report["engine"] <= report["peak"] <= report["bound"], report
    assert abs(report["back"]) <= 1 << 20, report  # training again: the engine's memory freed
    assert report["kept"] == ["cuda"], report  # offload_optimizer=False: no move


@pytest.mark.parametrize("backend", ["zero2", "zero3"])
def test_zero_hybrid_switch_on_gpu_sends_masters_and_optimizer_state_to_the_host(backend):
    """ZeRO-2 and 3 (the deepspeed wheel carried to the GPU machine, see
    scripts/gpu_wheels.sh): while generating, the fp32 masters (4 bytes a parameter) and
    Adam's moments (8) are on the host; the engine's weights are on the GPU; back in training
    all returns (ZeRO-3's masters through pinned host copies made once, since session 27)."""
    if importlib.util.find_spec("deepspeed") is None:
        lacking("deepspeed (carry its source: bash scripts/gpu_wheels.sh)")
    report = switch_report(MeasuredZeroPolicy, f"zpolicy-{backend}", backend)
    assert report["masters_while"] == ["cpu"] and report["masters_after"] == ["cuda"], report
    assert abs(report["offloaded"] - 4 * report["params"]) <= 4 << 20, report
    # before session 15 only Adam's moments left: 8 - 4 = 4 bytes a parameter freed
    freed = report["training"] - report["generating"]
    assert freed >= 0.9 * 12 * report["params"] - report["engine"], report
    assert abs(report["back"]) <= 8 << 20, report
    assert math.isfinite(report["loss"]), report  # the step after the round trip


def test_nccl_one_rank_communicator_through_cupy():
    """The real cupy.cuda.nccl calls asyncrl/comm/nccl.py makes, on the one GPU a device
    machine has: a 1-rank communicator from a unique id made as rank 0 makes it, a send to
    itself and a receive in one NCCL group on the link's own stream, and the bounded wait.
    The link's stream is not the default stream: work queued on the default stream after
    the transfer finishes while the link is still busy."""
    with warnings.catch_warnings():  # CuPy may warn on import (CUDA path, preloads): the
        warnings.simplefilter("ignore")  # suite turns warnings into errors
        try:
            import cupy.cuda.nccl as cupy_nccl
        except ImportError as e:
            lacking(f"cupy.cuda.nccl does not import: {e}")
    if not getattr(cupy_nccl, "available", True):  # CuPy imports it without libnccl
        lacking("cupy.cuda.nccl has no NCCL library (install nvidia-nccl-cu12 or -cu13)")
    from asyncrl.comm import nccl

    nccl.join("self->self", nccl.new_unique_id(), 1, 0, {"self": 0})
    end = nccl.link("self->self")
    assert end.stream is not None and end.stream != torch.cuda.current_stream()
    src = (torch.arange(4096, device="cuda", dtype=torch.float32) * 3).to(torch.bfloat16)
    dst = torch.empty_like(src)
    backend = nccl.backend()

    def post() -> None:  # a rank's send to itself goes in one group with its receive
        backend.groupStart()
        end.stream.wait_stream(torch.cuda.current_stream())
        flat_src = src.view(torch.uint8)
        end.comm.send(flat_src.data_ptr(), flat_src.numel(), backend.NCCL_UINT8, 0,
                      end.stream.cuda_stream)
        nccl.receive("self->self", end, [(("self", 0), dst)])
        backend.groupEnd()

    # the first transfer: NCCL connects a pair of ranks lazily, on their first send and
    # receive, and the host waits for that (seen on an H200 with NCCL 2.28: a link still
    # asleep had finished by the time the default stream's work after it returned)
    post()
    nccl.finish("self->self", end, 30)
    assert torch.equal(dst, src)
    dst.zero_()
    # the kernels and memory used below, loaded and allocated now: a lazy kernel load or a
    # cudaMalloc while the link sleeps could wait for the whole device
    torch.ones(1 << 20, device="cuda").sum().item()
    ones = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(end.stream):
        torch.cuda._sleep(10_000_000_000)  # the link busy ~5 s: no host stall outlasts it
    t0 = time.perf_counter()
    post()
    posted = time.perf_counter() - t0
    later = ones.sum()  # default stream, queued after it
    assert later.item() == 1 << 20  # done while the link's stream still sleeps
    assert not end.stream.query(), f"the host waited {posted:.3f} s to post the transfer"
    nccl.finish("self->self", end, 30)
    assert torch.equal(dst, src)
    nccl.forget("self->self")
    assert not nccl.has("self->self")


def test_weight_sync_on_one_gpu_goes_in_flat_buckets_and_lands_whole():
    """A trainer's weights to a rollout group on the same GPU (CUDA IPC): the pack is flat
    buckets (asyncrl/hybrid/weight_sync.py), and after the sync the rollout's own log-probs
    of what it generates are the trainer's (before it, another seed's model: far apart)."""
    from asyncrl.hybrid.roles import Policy, Rollout

    async def main():
        async with asyncrl.Controller() as ctl:
            # the trainer in fp32, as the engine is: a bf16 one (the GPU default) differed by
            # 1.6e-3 after the sync on the H200, its compute and not its weights
            trainer = await ctl.spawn(Policy, {"preset": "tiny-llama", "seed": 1},
                                      {"bf16": False}, nprocs=1, name="gtrainer")
            rollout = await ctl.spawn(Rollout, {"preset": "tiny-llama", "seed": 2},
                                      {"max_new_tokens": 6}, nprocs=1, name="grollout",
                                      place=[asyncrl.colocate_with(trainer)])
            pids = group_pids(trainer) + group_pids(rollout)
            prompts = TensorBatch({"prompt": [[1, 5, 6], [1, 7, 8]], "seed": [0, 1]})

            async def gap() -> float:  # the rollout's log-probs against the trainer's
                made = rollout.generate(prompts)
                mine = (await trainer.logprobs(made))["logprobs"]
                out = await made
                return float(((mine - out["logprobs"]).abs() * out["response_mask"]).max())

            assert await gap() > 1e-2
            pack = trainer.sync_pack()
            synced = await rollout.load_weights(pack)
            layout = await pack  # the driver's own look at it (not counted as payload)
            assert sorted(layout.keys()) == ["flat.0"], layout.keys()
            assert synced["sync/bytes"] == layout.meta["nbytes"] > 0
            assert await gap() < 1e-3
            assert ctl.payload_bytes == 0
            return pids
    assert_gone(run(main(), timeout=300))


def test_a_model_build_leaves_the_cuda_generators_where_they_were():
    """torch.manual_seed inside fork_rng(devices=[]) re-seeded every CUDA generator and did
    not restore it: each build (trainer, engine, reference) reset a rank's CUDA randomness to
    the model's seed, the same on every rank."""
    from asyncrl.hybrid.models import ModelConfig, build_model

    torch.cuda.manual_seed(123)
    torch.rand(1, device="cuda")  # a draw: the generator has moved on from its seed
    before = torch.cuda.get_rng_state()
    build_model(ModelConfig(preset="tiny-llama", seed=7))
    assert torch.equal(torch.cuda.get_rng_state(), before)
