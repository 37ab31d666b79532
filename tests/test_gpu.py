"""GPU paths of the data plane: CUDA IPC between ranks on one host, and GPU tensors staged
through host memory when IPC cannot be used. Skipped where there is no GPU; run them with
scripts/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import Dispatch, TensorBatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class GpuProducer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def make(self, batch: TensorBatch) -> TensorBatch:
        i = batch["i"].cuda()
        return TensorBatch({"i": i, "h": (i[:, None] * 10 + torch.arange(4, device="cuda"))
                            .to(torch.bfloat16), "cpu": batch["i"] * 2,
                            "name": [f"r{k}" for k in batch["i"].tolist()]})


class GpuConsumer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.DP)
    def check(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"i": batch["i"].cpu(), "h": batch["h"].float().cpu(),
                            "cpu": batch["cpu"], "name": batch["name"],
                            "on_gpu": [bool(batch["i"].is_cuda and batch["h"].is_cuda)] * len(
                                batch)})


def _expect(out: TensorBatch, n: int) -> None:
    i = torch.arange(n)
    assert out["i"].tolist() == i.tolist()
    assert out["h"].tolist() == (i[:, None] * 10 + torch.arange(4)).float().tolist()
    assert out["cpu"].tolist() == (i * 2).tolist()
    assert out["name"] == [f"r{k}" for k in range(n)]
    assert all(out["on_gpu"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_gpu_rows_between_groups(transport):
    async def main():
        async with asyncrl.Controller(transport=transport) as ctl:
            prod = await ctl.spawn(GpuProducer, nprocs=2, name="gprod")
            cons = await ctl.spawn(GpuConsumer, nprocs=1, name="gcons")
            pids = group_pids(prod) + group_pids(cons)
            out = await cons.check(prod.make(TensorBatch({"i": torch.arange(9)})))
            _expect(out, 9)
            assert ctl.payload_bytes == 0
            return pids
    assert_gone(run(main(), timeout=300))
