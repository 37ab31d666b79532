"""Resuming a flow's inputs from a checkpoint: those without state_dict() are skipped to
their position, and what they give there is checked against the checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import asyncrl
from asyncrl.actors.worker import rng_state, set_rng_state
from asyncrl.controller import checkpoint
from asyncrl.controller.inputs import Inputs
from asyncrl.errors import CheckpointError
from asyncrl.rl.data import PromptSource


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


class _Counting:
    """A restorable source whose state is a bare int (valid JSON, as meta.json keeps it)."""

    def __init__(self) -> None:
        self.at, self.loaded = 0, []

    def __iter__(self):
        while True:
            self.at += 1
            yield self.at - 1

    def state_dict(self) -> int:
        return self.at

    def load_state_dict(self, state: int) -> None:
        self.loaded.append(state)
        self.at = state


def test_a_source_whose_state_is_an_int_resumes():
    """check() and resume_at() asked `"consumed" in state` of every source's state: an int
    state was a TypeError; a source without load_state_dict given one is refused in words."""
    first = Inputs({"n": _Counting()})
    first.reset()
    first.next(), first.next()
    saved = json.loads(json.dumps(first.positions()))
    assert saved == {"n": 2}
    resumed = Inputs({"n": _Counting()})
    resumed.reset()
    resumed.check(saved)
    resumed.resume_at(2, saved)
    assert resumed.sources["n"].loaded == [2]
    assert resumed.next() == {"n": 2}
    plain = Inputs({"n": [0, 1, 2]})
    plain.reset()
    for refused in (plain.check, lambda saved: plain.resume_at(2, saved)):
        with pytest.raises(CheckpointError, match=r"input 'n' was saved as 2, a position "
                                                  r"for a source with load_state_dict\(\)"):
            refused(saved)



@pytest.mark.parametrize("own_generator", [False, True], ids=["global_rng", "generator"])
def test_a_rewind_reads_a_shuffled_dataloader_in_its_first_order(tmp_path, own_generator):
    """A rewind opened the inputs again with the global RNG (or the DataLoader's generator=)
    moved on: its skip drew another shuffle, some items came twice and others never, and a
    later checkpoint's digests refused a resume in a fresh process. With generator=, a
    rewind to step 0 (no checkpoint) changed the order too."""
    def opened() -> Inputs:
        torch.manual_seed(0)  # (the flow file's import)
        gen = torch.Generator().manual_seed(7) if own_generator else None
        feed = Inputs({"batch": DataLoader(range(40), batch_size=4, shuffle=True,
                                           generator=gen)})
        feed.reset()  # (flow.open)
        return feed

    def steps(feed: Inputs, upto: int, save: int | None = None) -> list[list[int]]:
        read: list[list[int]] = []
        while len(read) < upto and (values := feed.next()) is not None:
            read.append(values["batch"].tolist())
            torch.rand(3)  # (the step's nodes draw random numbers)
            if save is not None and feed.consumed["batch"] == save + 1:  # a checkpoint
                saved[save] = json.loads(json.dumps(checkpoint.positions(feed)))
                (tmp_path / str(save)).mkdir()
                torch.save(rng_state(), tmp_path / str(save) / "controller_rng.pt")
        return read

    def restore(feed: Inputs, step: int, rewind: bool) -> None:
        flow = SimpleNamespace(groups=[], resume_at=feed.resume_at)
        meta = {"step": step, "inputs": saved[step]}
        assert asyncio.run(checkpoint.restore(flow, tmp_path / str(step), meta, rewind)) \
            == step + 1

    saved: dict[int, dict] = {}
    feed = opened()
    origin, origin_rng = feed.positions(), rng_state()
    first = steps(feed, 4, save=1)  # steps 0..3, then a failure: back to step 1's checkpoint
    feed.reset()  # (Recovery.rewind: flow._reset_sources, then the restore)
    restore(feed, 1, rewind=True)
    again = first[:2] + steps(feed, 10, save=5)
    assert sorted(i for batch in again for i in batch) == list(range(40))  # each once
    assert again[2:4] == first[2:4]
    fresh = opened()  # a resume in a fresh process, from a checkpoint the rewind wrote
    restore(fresh, 5, rewind=False)
    assert steps(fresh, 10) == again[6:]
    feed.reset()  # a rewind before any checkpoint: from the start, as the run began
    feed.resume_at(0, origin, rewind=True)
    set_rng_state(origin_rng)
    assert steps(feed, 10) == again


def test_a_resume_with_renamed_or_other_kinds_of_inputs_is_refused_before_any_group_starts(
        tmp_path):
    """Only the inputs the checkpoint saved a position for were checked: one renamed or
    added since, or a list that became a PromptSource (or the reverse), was refused by
    resume_at, after every group started and loaded its weights."""
    @asyncrl.node
    def take(prompts=None, train_prompts=None, more=None):  # (any of them: a flow of each)
        return prompts

    def flow_of(**inputs) -> asyncrl.DataFlow:
        return asyncrl.DataFlow(nodes=[take], groups=[], inputs=inputs)

    def source() -> PromptSource:
        return PromptSource([{"x": i} for i in range(7)], batch_size=3, seed=5)
    folder = tmp_path / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    for prompts, other, why in (
            (["a", "b", "c"], {"train_prompts": ["a", "b", "c"]},
             r"the checkpoint saved no position for input 'train_prompts' \(it has "
             r"\['prompts'\]\)"),
            (["a", "b", "c"], {"prompts": ["a", "b", "c"], "more": ["d", "e"]},
             "no position for input 'more'"),
            (["a", "b", "c"], {"prompts": source()}, "input 'prompts' was saved as .*'consumed'"
             ": 2.*, the count of items read from a source without load_state_dict"),
            (source(), {"prompts": ["a", "b", "c"]}, "input 'prompts' was saved as .*'epoch'.*"
             ", a position for a source with load_state_dict")):
        saved = flow_of(prompts=prompts)  # two steps taken
        saved.feed.reset()
        saved.feed.next(), saved.feed.next()
        (folder / "meta.json").write_text(json.dumps({
            "step": 1, "flow": checkpoint.identity(saved), "sizes": {},
            "inputs": saved.positions()}))
        assert checkpoint.resumable(tmp_path, flow_of(prompts=prompts, n=3))[0] == folder
        with pytest.raises(CheckpointError, match=why):
            checkpoint.resumable(tmp_path, flow_of(**other))


def test_a_rewind_past_a_list_item_a_node_changed_in_place_says_so(caplog):
    """A list gives the same objects again after a rewind: one its node changed in place
    differs from its digest, and the warning said its order changes each time it is read
    (use a list), of a list."""
    items = [{"v": i} for i in range(4)]
    feed = Inputs({"x": items})
    feed.reset()
    for _ in range(2):
        feed.next()["x"]["v"] += 100  # (the node's change, in place)
    saved = json.loads(json.dumps(feed.positions()))  # the checkpoint after step 1
    feed.reset()  # (Recovery.rewind)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        feed.resume_at(2, saved, rewind=True)
    assert "input 'x' gives another item at position 2 than before the rewind, though it " \
           "is a list: a node likely changed that item in place" in caplog.text
    assert "copy the item in the node" in caplog.text and "order" not in caplog.text
    assert feed.next() == {"x": {"v": 2}}
