"""A weight sync's pack failing on rank 0 (the gathers' failures: test_hybrid.py)."""

from __future__ import annotations

import weakref

import pytest
import torch

from asyncrl.hybrid import weight_sync
from asyncrl.hybrid.weight_sync import SyncSource


def test_a_failed_pack_frees_its_buckets_then_reads_the_rest_of_the_weights(monkeypatch):
    """A pack failing in a flat bucket (out of memory) left the rest of the weights' gathers
    (collectives its peers run) to its caller's clean-up, inside the except block: the
    traceback kept the pack's buckets, and the next large gather ran out of memory again.
    The pack reads them itself now, its buckets freed first."""
    monkeypatch.setattr(weight_sync, "FLAT_BYTES", 64)  # a parameter a bucket
    closed: list[weakref.ref] = []

    class Flaky(weight_sync._Flattener):
        def _close(self, kind):  # the first bucket made, no room for the second
            if closed:
                raise torch.OutOfMemoryError("no room for the second bucket")
            super()._close(kind)
            closed.append(weakref.ref(self.columns["flat.0"]))

    monkeypatch.setattr(weight_sync, "_Flattener", Flaky)
    freed: list[bool] = []

    def gathered():
        for i in range(6):  # 16 floats, 64 bytes each
            if i == 3:  # read after the failure (parameter 2 closing the second bucket)
                freed.append(closed[0]() is None)
            yield f"p{i}", torch.full((16,), float(i))

    with pytest.raises(torch.OutOfMemoryError, match="no room for the second bucket"):
        SyncSource().pack(gathered(), version=0, flat=True)
    assert freed == [True]


def test_a_failed_small_weights_gather_still_runs_the_other_dtypes_gathers(monkeypatch):
    """The small weights are gathered a plan per dtype (a bf16 LoRA model's fp32 adapters
    beside its bf16 norm): past one plan's failure on a rank, `failed or attempt(...)` ran
    none of the next plans' all_gathers there, and its peers waited in them."""
    ran = []

    class OnePlanFails:
        def reserve(self, plan):
            pass

        def run(self, plan):
            ran.append(plan)
            if len(ran) == 1:
                raise RuntimeError("the copy of the first plan failed on this rank")

        def free(self):
            pass

    monkeypatch.setattr(weight_sync, "Gatherer", OnePlanFails)
    monkeypatch.setattr(weight_sync, "row_sharded", lambda p: True)
    monkeypatch.setattr(weight_sync, "plan_gather", lambda pairs, size: [list(pairs)])
    named = [("a", torch.zeros(4)), ("b", torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(RuntimeError, match="first plan failed"):
        list(weight_sync.gathered(named, 1 << 20))
    assert len(ran) == 2
