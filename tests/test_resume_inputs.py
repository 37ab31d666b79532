"""Resuming a flow's inputs from a checkpoint: those without state_dict() are skipped to
their position, and what they give there is checked against the checkpoint."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from asyncrl.actors.worker import rng_state
from asyncrl.controller import checkpoint
from asyncrl.controller.inputs import Inputs
from asyncrl.errors import CheckpointError


def test_a_dataloader_shuffled_by_the_flow_files_manual_seed_resumes(tmp_path):
    """A DataLoader(shuffle=True) seeded only by the flow file's torch.manual_seed draws its
    shuffle's seed from the global RNG at its first item: the restore set the checkpoint's
    RNG state before skipping to the position, the skip drew another seed (another order),
    and every such resume was refused by the item's digest."""
    def opened(seed: int) -> Inputs:
        torch.manual_seed(seed)  # (the flow file's import)
        feed = Inputs({"batch": DataLoader(torch.arange(40), batch_size=4, shuffle=True)})
        feed.reset()  # (flow.open)
        return feed

    first = opened(0)
    for _ in range(3):  # steps 0..2, whose nodes draw random numbers too
        first.next()
        torch.rand(5)
    saved = json.loads(json.dumps(checkpoint.positions(first)))  # as meta.json keeps it
    folder = tmp_path / "step_000002"
    folder.mkdir()
    torch.save(rng_state(), folder / "controller_rng.pt")
    at_checkpoint = torch.get_rng_state()
    wanted = first.next()["batch"]

    def restored(seed: int) -> Inputs:
        feed = opened(seed)
        flow = SimpleNamespace(groups=[], resume_at=feed.resume_at)
        assert asyncio.run(checkpoint.restore(flow, folder, {"step": 2, "inputs": saved})) == 3
        return feed

    resumed = restored(0)
    assert torch.equal(torch.get_rng_state(), at_checkpoint)  # (then as at the checkpoint)
    assert torch.equal(resumed.next()["batch"], wanted)
    # another seed: another order, refused with the way to a fixed one
    with pytest.raises(CheckpointError, match=r"gave another item at position 3 .*"
                                              r"generator=torch\.Generator\(\)\.manual_seed"):
        restored(1)
