"""Checkpoints and `asyncrl launch --resume`: a run stopped and resumed writes the same metrics
as one that ran straight through. (Wrong resumes, and the messages that say the fix, are in
test_bad_input.py.)

This file is also the flow those runs launch (`asyncrl launch tests/test_checkpoint.py`):

    prompts (PromptSource) ──▶ draw (sampler: its RNG only) ──▶ learn (learner x2: weights,
    offset (a plain range) ──▶ jitter (the controller's RNG)       counter, RNG)
    draw of step t follows learn of step t-2 (max_staleness=1): steps overlap
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import cli

import asyncrl
from asyncrl.actors.worker import construct
from asyncrl.controller import checkpoint, saved_inputs
from asyncrl.controller.inputs import Inputs
from asyncrl.controller.recovery import Recovery
from asyncrl.errors import CheckpointError, RemoteError
from asyncrl.rl.data import PromptSource

# -- the flow -------------------------------------------------------------------------------
random.seed(1234)  # the controller's RNG, which `jitter` draws from: the same in every run


def _split_all(layout, args, kwargs):
    return asyncrl.Split({r: (args, kwargs) for r in range(layout.world_size)},
                         list(range(layout.world_size)))


def _by_rank_keys(layout, results, state):  # {"w0": .., "w1": ..}: numbers metrics can log
    return {f"{k}{r}": v for r, out in sorted(results.items()) for k, v in out.items()}


EVERY_RANK = asyncrl.register_protocol("ckpt_every_rank", split=_split_all,
                                       collect=_by_rank_keys)


class Learner(asyncrl.Worker):
    """Weights that move each step with draws from torch, `random` and numpy."""

    def __init__(self, seed: int):
        torch.manual_seed(seed + self.rank)
        random.seed(seed + self.rank)
        np.random.seed(seed + self.rank)
        self.w = torch.zeros(4)
        self.updates = 0

    @asyncrl.register(dispatch=EVERY_RANK)
    def update(self, xs: list, draw: float) -> dict:
        x = torch.tensor(xs, dtype=torch.float32).mean()
        noise = torch.randn(4) * 0.1 + random.random() + float(np.random.rand())
        self.w = 0.9 * self.w + 0.01 * x + draw + noise
        self.updates += 1
        return {"w": float(self.w.sum()), "updates": self.updates}

    def save_state(self, folder):
        torch.save({"w": self.w, "updates": self.updates}, folder / f"learner{self.rank}.pt")

    def load_state(self, folder):
        state = torch.load(folder / f"learner{self.rank}.pt")
        self.w, self.updates = state["w"], state["updates"]


class Sampler(asyncrl.Worker):
    """No state of its own: the base class's checkpoint (its RNG) is all it needs."""

    def __init__(self):
        torch.manual_seed(7)

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def sample(self, xs: list) -> float:
        return float(torch.rand(()) + len(xs))


learner = asyncrl.group(Learner, 11, nprocs=2, name="learner")
sampler = asyncrl.group(Sampler, nprocs=1, name="sampler")


@asyncrl.node
def jitter(prompts, offset):
    xs = prompts["x"]
    return {"draw": random.random() + offset,
            "prompts/order": float(sum((i + 1) * x for i, x in enumerate(xs)))}


@asyncrl.node(follows="learn")
def draw(prompts):
    return sampler.sample(prompts["x"])


@asyncrl.node
def learn(prompts, draw):
    return learner.update(prompts["x"], draw)


# 7 records in batches of 3: an epoch is 3 steps, and each epoch has its own order
prompts = PromptSource([{"x": i} for i in range(7)], batch_size=3, seed=5, epochs=None)
flow = asyncrl.DataFlow(nodes=[jitter, draw, learn], max_staleness=1,
                        inputs={"prompts": prompts, "offset": range(100, 200)})


# -- helpers ----------------------------------------------------------------------------------
def launch(*args: str) -> subprocess.CompletedProcess:
    out = cli("launch", *args, timeout=240)
    assert out.returncode == 0, out.stderr
    return out


def rows(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in lines]


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys(), (a, b)
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-4), (a["step"], k, a[k], b[k])


THIS = "tests/test_checkpoint.py"


def bare_flow() -> asyncrl.DataFlow:
    """One node over a list, and no groups: nothing starts."""
    @asyncrl.node
    def take(x):
        return x
    return asyncrl.DataFlow(nodes=[take], groups=[], inputs={"x": [1, 2]})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six steps without a stop: the metrics every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight")
    launch(THIS, "--steps", "6", "--run-dir", str(run_dir))
    return run_dir


# -- checkpoint folders (no processes) ------------------------------------------------------
def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for name, meta in [("step_000002", True), ("step_000010", True), ("step_000011", False),
                       ("step_000012.tmp", True), ("step_000013.tmp", False)]:
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text("{}")
    assert checkpoint.latest(tmp_path) == root / "step_000010"  # by number, not by name
    assert checkpoint.complete(tmp_path) == [root / "step_000002", root / "step_000010"]
    assert checkpoint.latest(tmp_path / "nowhere") is None


def test_sync_tree_puts_every_file_and_folder_of_a_checkpoint_on_disk(tmp_path, monkeypatch):
    """What meta.json vouches for is fsynced before it is written: each file (torch.save and
    save_state write without syncing) and each folder (their names)."""
    from asyncrl.actors.worker import sync_dir, sync_tree

    for rel in ("actor/rng_rank0.pt", "actor/train/model.pt", "reward/rng_rank0.pt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    os.mkfifo(tmp_path / "actor" / "pipe")  # not a regular file: left alone (it would block)
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(
        f"/proc/self/fd/{fd}")), real(fd)))
    sync_tree(tmp_path)
    every = {str(p) for p in [tmp_path, *tmp_path.rglob("*")] if not p.is_fifo()}
    assert set(synced) == every and len(synced) == len(every) == 7
    # a folder's fsync refused (some shared file systems): the rename stands; an I/O error
    # was taken for that too, and the checkpoint said complete
    for code, passes in ((errno.EINVAL, True), (errno.EIO, False)):
        def refused(fd, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(os, "fsync", refused)
        if passes:
            sync_dir(tmp_path)
        else:
            with pytest.raises(OSError, match="Input/output error"):
                sync_dir(tmp_path)


# -- stop and resume (real groups) ----------------------------------------------------------
def test_stopped_after_three_steps_and_resumed_matches_a_straight_run(straight, tmp_path):
    want = rows(straight)
    assert [r["step"] for r in want] == list(range(6))
    assert {"jitter/draw", "prompts/order", "learn/w0", "learn/w1", "draw"} <= set(want[0])
    assert len({r["learn/w0"] for r in want} | {r["learn/w1"] for r in want}) == 12  # it moves
    run_dir = tmp_path / "run"
    launch(THIS, "--steps", "3", "--run-dir", str(run_dir))
    assert checkpoint.latest(run_dir).name == "step_000002"  # the end of a run checkpoints
    out = launch(THIS, "--steps", "6", "--run-dir", str(run_dir), "--resume")
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000002'}" in out.stdout
    assert "groups sampler define no save_state: they resume as built" in out.stdout
    assert_same(rows(run_dir), want)
    # resumed again with nothing left: said, and the run left as it is (to the run's own
    # --steps: without one, it went on until an input ran out)
    out = launch(THIS, "--run-dir", str(run_dir), "--resume")
    assert "resuming with the run's --steps 6" in out.stderr
    assert "nothing to run: steps 0..5 are done" in out.stdout
    assert "pass --steps N above 6 to go on" in out.stdout
    assert_same(rows(run_dir), want)


def test_the_hints_to_go_on_name_a_flows_steps_setting(monkeypatch):
    """The examples size their prompts' epochs by their steps= setting: told to pass
    --steps N above the last step, a user of `make demo` met an input run out instead."""
    from asyncrl.controller import declare, launch

    monkeypatch.setattr(declare, "settings", {"lr": 0.1})
    assert launch._steps_setting() == ""
    monkeypatch.setattr(declare, "settings", {"steps": 60})
    assert launch._steps_setting() == "; this flow has a steps setting (60), which may size " \
        "its inputs (the examples' epochs): give steps=N with --steps N"


def test_resume_after_a_crash_continues_from_the_newest_complete_checkpoint(straight,
                                                                            tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # an earlier run's restart counts (its other files removed to start
    (run_dir / "restarts.json").write_text('{"learner": 3}')  # afresh) are not this run's
    launch(THIS, "--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "0",
           "--run-dir", str(run_dir))
    root = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.complete(run_dir)] == [
        f"step_00000{t}" for t in range(5)]
    # a crash while step 4 was being saved: its folder has no meta.json and keeps .tmp,
    # and metrics.jsonl already has step 4's row
    (root / "step_000004" / "meta.json").unlink()
    (root / "step_000004").rename(root / "step_000004.tmp")
    out = launch(THIS, "--steps", "6", "--run-dir", str(run_dir), "--resume")
    assert "resuming from" in out.stdout and "step_000003" in out.stdout
    assert "dropped 1 metrics rows" in out.stdout
    assert "restarts so far" not in out.stdout + out.stderr
    assert_same(rows(run_dir), rows(straight))
    # checkpointed as the run did (every step, all kept: it had none but the last, 3 kept);
    # the stray .tmp is gone
    assert "resuming with the run's --checkpoint-every 1, --keep-checkpoints 0" in out.stderr
    assert sorted(p.name for p in root.iterdir()) == [f"step_00000{t}" for t in range(6)]
    # damaged (a disk's fault, a hand's edit): said with the way out, not a traceback
    rng = next((root / "step_000005").glob("*/rng_rank0.pt"))
    rng.write_bytes(rng.read_bytes()[:100])
    out = cli("launch", THIS, "--run-dir", str(run_dir), "--resume", "--steps", "7")
    assert out.returncode == 2 and "loading " in out.stderr and \
        "move step_000005 out of" in out.stderr, out.stderr[-3000:]
    (root / "step_000005" / "meta.json").write_text('{"step": 5, "flo')
    out = cli("launch", THIS, "--run-dir", str(run_dir), "--resume", "--steps", "7")
    assert out.returncode == 1 and "meta.json cannot be read" in out.stderr and \
        "move step_000005 out of" in out.stderr and "Traceback" not in out.stderr


def test_an_input_position_that_is_not_json_is_refused_naming_the_input():
    """A data source whose state_dict() holds a tensor (torchdata's loaders keep generator
    state so) failed the run's first checkpoint after every group had saved: json.dumps of
    meta.json, with no word of which input. Now checked first (and when a launch opens)."""
    for state in ({"consumed": 3}, {"best": float("nan")}, {"ema": [1.0, float("nan")]}):
        saved = checkpoint.positions(SimpleNamespace(positions=lambda s=state: {"prompts": s}))
        assert repr(saved) == repr({"prompts": state})  # (NaN != NaN: refused, a save failed)
    odd = SimpleNamespace(positions=lambda: {"prompts": {"consumed": 3},
                                             "loader": {"generator": torch.zeros(2)}})
    with pytest.raises(CheckpointError, match=r"input 'loader': its state_dict\(\) cannot go "
                                              r"into a checkpoint's meta.json .*\.tolist\(\)"):
        checkpoint.positions(odd)
    # nor one JSON gives back changed: {"pos": {0: 3}} was resumed as {"pos": {"0": 3}} (a
    # source's shards restarted at 0, silently; a rewind before any checkpoint had it right)
    for state, shown, at in (({"pos": {0: 3}}, "{0: 3}} as {'pos': {'0': 3}}", "has the key 0"),
                             ({"pos": (2, 3)}, "(2, 3)} as {'pos': [2, 3]}", "is a tuple")):
        with pytest.raises(CheckpointError, match=re.escape(
                f"input 'shards': its state_dict() comes back from a checkpoint's meta.json "
                f"changed ({{'pos': {shown}): JSON keeps dict keys as strings and tuples as "
                f"lists (state_dict()['pos'] {at})")):
            checkpoint.positions(SimpleNamespace(positions=lambda s=state: {"shards": s}))


class Rotated:
    """Prompts in an order that differs between two instances (as a set of strings does
    between two processes, or a shuffle without a fixed seed between two runs)."""

    def __init__(self, turn: int):
        self.turn = turn

    def __iter__(self):
        items = ["a", "b", "c", "d", "e"]
        return iter(items[self.turn:] + items[:self.turn])


def test_a_resumed_input_that_gives_other_items_is_refused_naming_it(caplog):
    """An input without state_dict() is resumed by skipping the items it gave: where its
    order changed, some prompts were repeated, others never seen: now a digest is checked."""
    def opened(turn: int) -> Inputs:
        feed = Inputs({"prompts": Rotated(turn), "batch": asyncrl.TensorBatch({"x": [1]})})
        feed.reset()
        return feed
    first = opened(0)
    assert [first.next()["prompts"] for _ in range(2)] == ["a", "b"]
    saved = json.loads(json.dumps(first.positions()))  # as meta.json keeps it
    assert saved["prompts"]["consumed"] == 2 and "batch" not in saved  # (a constant)
    same = opened(0)
    same.resume_at(2, saved)
    assert same.next()["prompts"] == "c"
    with pytest.raises(CheckpointError, match=r"input 'prompts' gave another item at position "
                                              r"2 .*\(a PromptSource\)"):
        opened(1).resume_at(2, saved)
    # a rewind within the run (its groups respawned already): said, and the run goes on
    rewound = opened(1)
    rewound.resume_at(2, saved, rewind=True)
    assert "input 'prompts' gives another item at position 2 than before the rewind" in \
        caplog.text and rewound.next()["prompts"] == "d"
    no_digest = {"prompts": {"consumed": 2}}  # a checkpoint of before session 27: skipped
    older = opened(1)
    older.resume_at(2, no_digest)
    assert older.next()["prompts"] == "d"


def test_a_run_dir_is_one_launchs_while_it_runs(tmp_path):
    """Two launches in one run directory (a double submission, a requeue while the old
    controller still shuts down) removed each other's half-written checkpoints."""
    from asyncrl.controller.launch import hold_run_dir

    run_dir = tmp_path / "run"
    held = hold_run_dir(run_dir)
    with pytest.raises(CheckpointError, match=rf"{run_dir} is in use by another launch .*"
                                              rf"choose another --run-dir"):
        hold_run_dir(run_dir)
    os.close(held)  # the launch ended: the next one takes it
    os.close(hold_run_dir(run_dir))
    assert os.listdir(run_dir) == [".lock"]  # the lock is held on RUN_DIR/.lock alone


def test_a_resume_goes_on_with_the_runs_restarts(tmp_path):
    """The restart budget is the run's (a crash recurring at each resume spent a fresh one
    each time): counted as they happen (restarts.json), or the checkpoint's if newer."""
    recovery = Recovery(SimpleNamespace(_ctl=None, groups=[SimpleNamespace(name="actor"),
                                                SimpleNamespace(name="reward")]))
    recovery.log_path = tmp_path / "recoveries.jsonl"
    recovery.resume_counts({"actor": 2, "gone": 1})
    assert recovery.restarts == {"actor": 2, "reward": 0}  # a group no longer there: -
    # restarts after the checkpoint: the run failed, its budget spent, after it
    (tmp_path / "restarts.json").write_text(json.dumps({"actor": 3, "reward": 1}))
    recovery.resume_counts({"actor": 2})
    assert recovery.restarts == {"actor": 3, "reward": 1}


def test_an_old_checkpoint_that_cannot_be_removed_yet_does_not_end_the_run(
        tmp_path, monkeypatch, capsys):
    """A pruned checkpoint a reader still held (NFS's busy .nfs* files) was a warning at its
    save, but the next save's removal of it raised: the run, and each resume, failed."""
    flow = SimpleNamespace(_ctl=None, positions=dict, nodes={}, groups=[], launch_options={},
                           recovery=SimpleNamespace(restarts={}))
    real_rmtree = shutil.rmtree

    def busy(path, *a, **k):
        if str(path).endswith(".discarded"):
            raise OSError(16, "Device or resource busy", str(path))
        real_rmtree(path, *a, **k)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", busy)
    root = tmp_path / "checkpoints"
    for step in range(3):
        asyncio.run(checkpoint.save(flow, tmp_path, step, keep=1))
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_000002"]
    assert "could not remove" in capsys.readouterr().err
    (root / "step_000003.tmp").mkdir()  # a save of step 3 that died, its folder held too
    asyncio.run(checkpoint.save(flow, tmp_path, 3, keep=1))
    assert checkpoint.latest(tmp_path) == root / "step_000003"
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)  # the readers are gone
    asyncio.run(checkpoint.save(flow, tmp_path, 4, keep=1))
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]


def test_a_checkpoint_of_the_other_backend_is_named_as_such(tmp_path):
    """An FSDP2 checkpoint given to a ZeRO group (or the reverse), or one of the other ZeRO
    stage, failed as a damaged one would (move it aside, said): the backend is named now.
    (The files as DeepSpeed names them: ZeRO-3 keeps its model states per rank.)"""
    from asyncrl.hybrid.ckpt_kind import ZERO_TAG, check_written_by

    fsdp, zero2, zero3, empty = (tmp_path / n for n in ("fsdp", "zero2", "zero3", "empty"))
    for folder in (fsdp, zero2, zero3, empty):
        folder.mkdir()
    (fsdp / ".metadata").write_bytes(b"")
    for folder, files in ((zero2, ["mp_rank_00_model_states.pt",
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
                          (zero3, ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                   "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])):
        (folder / ZERO_TAG).mkdir()
        for name in files:
            (folder / ZERO_TAG / name).write_bytes(b"")
    for folder, theirs, backend in ((fsdp, "fsdp2", "zero3"), (zero2, "zero2", "fsdp2"),
                                    (zero2, "zero2", "zero3"), (zero3, "zero3", "zero2")):
        with pytest.raises(ValueError, match=f"{folder.name} was written with backend="
                           f"'{theirs}'; this group trains with backend='{backend}': resume"):
            check_written_by(folder, backend)
    for folder, backend in ((fsdp, "fsdp2"), (zero2, "zero2"), (zero3, "zero3"),
                            (empty, "fsdp2"), (empty, "zero2")):
        check_written_by(folder, backend)  # (a missing one is the load's own error)


class OnlySaves(Rotated):
    """A source with state_dict() and no load_state_dict()."""

    def state_dict(self):
        return {"somewhere": 1}


def test_a_source_that_cannot_go_back_is_counted_not_saved_by_its_state_dict():
    """Its state_dict() was saved, and every --resume refused it (it has no
    load_state_dict): found only at the resume. It is counted as other sources are."""
    feed = Inputs({"prompts": OnlySaves(0)})
    feed.reset()
    assert [feed.next()["prompts"] for _ in range(2)] == ["a", "b"]
    saved = json.loads(json.dumps(feed.positions()))
    assert saved["prompts"]["consumed"] == 2
    again = Inputs({"prompts": OnlySaves(0)})
    again.reset()
    again.resume_at(2, saved)
    assert again.next()["prompts"] == "c"


def test_a_resume_with_other_prompts_is_refused_before_any_group_starts(tmp_path):
    """A PromptSource of other data, seed or shuffle, or a list now shorter or in another
    order, was refused only by restore, after every group started and loaded its weights."""
    @asyncrl.node
    def take(prompts):
        return prompts

    def flow_of(prompts) -> asyncrl.DataFlow:
        return asyncrl.DataFlow(nodes=[take], groups=[], inputs={"prompts": prompts})

    def source(seed: int) -> PromptSource:
        return PromptSource([{"x": i} for i in range(7)], batch_size=3, seed=seed)
    folder = tmp_path / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    for prompts, others in ((source(5), [(source(6), "': this position was saved for other "
                                                     "prompts .*seed 5 there, 6 here")]),
                            (["a", "b", "c"], [(["a"], "' ended after 1 items"),
                                               (["b", "a", "c"], "' gave another item at")])):
        saved = flow_of(prompts)  # two steps taken
        saved.feed.reset()
        saved.feed.next(), saved.feed.next()
        (folder / "meta.json").write_text(json.dumps({
            "step": 1, "flow": checkpoint.identity(saved), "sizes": {},
            "inputs": saved.positions()}))
        assert checkpoint.resumable(tmp_path, flow_of(prompts))[0] == folder
        for other, why in others:
            with pytest.raises(CheckpointError, match=f"input 'prompts{why}"):
                checkpoint.resumable(tmp_path, flow_of(other))


def test_a_checkpoint_another_user_could_have_written_is_not_resumed(tmp_path, monkeypatch):
    """A checkpoint is read with pickle (torch's distributed checkpoints, DeepSpeed's): one
    in a folder every user can write was resumed, running whatever was planted there."""
    flow = bare_flow()
    folder = tmp_path / "run" / "checkpoints" / "step_000000"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({
        "step": 0, "flow": checkpoint.identity(flow), "inputs": {"x": {"consumed": 0}}}))
    assert checkpoint.resumable(tmp_path / "run", flow)[0] == folder
    (folder / "g").mkdir()  # a group's folder and a rank's file in it (DCP reads it with
    (folder / "g" / ".metadata").write_bytes(b"")  # pickle), and meta.json (its settings)
    for where in (tmp_path / "run", folder.parent, folder, *sorted(folder.rglob("*"))):
        where.chmod(0o666 if where.is_file() else 0o777)  # (an umask-0 run's own: told how)
        with pytest.raises(CheckpointError, match=f"--resume: {where} is writable by every "
                           f"user; a checkpoint is loaded with pickle.*`chmod -R o-w "
                           f"{folder if folder in (where, *where.parents) else where}` if you"):
            checkpoint.resumable(tmp_path / "run", flow)
        where.chmod(0o775)  # (a group's shared project folder: resumed)
    assert checkpoint.resumable(tmp_path / "run", flow)[0] == folder
    folder.chmod(0o777)  # a mode that says so falsely (a FUSE mount), told: resumed
    monkeypatch.setenv("ASYNCRL_TRUST_RUN_DIR", "1")
    assert checkpoint.resumable(tmp_path / "run", flow)[0] == folder


def test_an_empty_or_garbled_controller_rng_file_is_a_checkpoint_error_naming_it(tmp_path):
    """A damaged controller_rng.pt (empty where fsync is not honoured, garbage) raised
    EOFError or UnpicklingError as a bare traceback, not the checkpoint's error and fix."""
    flow = bare_flow()
    folder = tmp_path / "checkpoints" / "step_000000"
    folder.mkdir(parents=True)
    for damaged in (b"", b"not a torch file at all"):
        (folder / "controller_rng.pt").write_bytes(damaged)
        with pytest.raises(CheckpointError, match=f"(?s)loading {folder} failed: "
                                                  f"(EOFError|UnpicklingError).*move"):
            asyncio.run(checkpoint.restore(flow, folder, {"step": 0}))


def test_a_peers_death_while_a_checkpoint_loads_is_not_taken_for_a_damaged_checkpoint(
        tmp_path):
    """A rank whose peer died in load_state reports its broken collective (a RemoteError)
    before the supervisor declares the death: the load was taken for a damaged checkpoint,
    and the way out said to move a good checkpoint aside. It waits for the death now."""
    broken = RemoteError("learner", 1, "load_checkpoint", "RuntimeError",
                         "Connection closed by peer", "")

    async def main(dies: bool):
        handle = SimpleNamespace(dead=None)

        async def load_checkpoint(path):
            if dies:  # declared a moment after the peer's error came
                asyncio.get_running_loop().call_later(0.3, setattr, handle, "dead", "died")
            raise broken

        handle.load_checkpoint = load_checkpoint
        spec = SimpleNamespace(name="learner", handle=handle)
        flow = SimpleNamespace(groups=[spec], _ctl=SimpleNamespace(
            heartbeat_timeout=1.0, heartbeat_interval=0.2))
        flow.recovery = Recovery(flow)
        await checkpoint.restore(flow, tmp_path, {"step": 0})

    with pytest.raises(RemoteError, match="Connection closed by peer"):
        asyncio.run(main(dies=True))  # the death's: a rewind's to recover from
    with pytest.raises(CheckpointError, match=f"(?s)loading {tmp_path} failed: RemoteError.*"
                                              f"move"):
        asyncio.run(main(dies=False))  # no death behind it: the checkpoint's


def test_a_run_under_umask_0_resumes_from_its_own_checkpoints(tmp_path, monkeypatch):
    """Under umask 0 (some containers) a run's folders were writable by every user (refused
    by --resume; a mount refusing chmod failed every save); the first checkpoint's folder
    was not fsynced in the run directory (nor meta.json's name in it)."""
    from asyncrl.actors import worker

    done = []  # and what the folder's fsync vouches for (meta.json's name: it is written last)
    monkeypatch.setattr(checkpoint, "sync_dir", lambda p: (
        done.append(("sync", p, (p / "meta.json").exists())), worker.sync_dir(p)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b, replace=os.replace: (
        done.append(("replace", a, b)), replace(a, b)))
    flow = bare_flow()
    flow.feed.reset()
    rank = construct(asyncrl.Worker, [], {}, {"group_name": "g", "rank": 0})  # its files too
    handle = SimpleNamespace(save_checkpoint=lambda p: asyncio.to_thread(rank.save_checkpoint, p))
    flow.groups = [SimpleNamespace(name="g", nprocs=1, worker_cls=asyncrl.Worker, handle=handle)]
    old = os.umask(0)
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir(checkpoint.PRIVATE_DIR)  # (as asyncrl launch makes it)
        saved = asyncio.run(checkpoint.save(flow, run_dir, 0))
    finally:
        os.umask(old)
    assert ("sync", run_dir, False) in done  # the checkpoints folder's entry, at the first save
    tmp = saved.with_name("step_000000.tmp")  # all synced, meta.json's name too, then renamed
    assert done.index(("sync", tmp, True)) < done.index(("replace", tmp, saved))
    assert checkpoint.resumable(run_dir, flow)[0] == saved
    for where in (run_dir / "checkpoints", saved):
        assert where.stat().st_mode & 0o777 == 0o775  # (a group's write kept, not others')
    assert sorted(p.name for p in saved.rglob("*") if not p.stat().st_mode & 0o002) == [
        "controller_rng.pt", "g", "meta.json", "rng_rank0.pt"]  # (none: every user's)
    def refused(*args):  # a mount that shows 0777 and refuses a chmod (vfat, exfat): every
        raise PermissionError(1, "Operation not permitted")  # save failed
    (saved / "meta.json").chmod(0o666)
    monkeypatch.setattr(checkpoint.os, "chmod", refused)
    checkpoint._unshared(saved)


def test_a_run_dir_given_as_its_checkpoints_folder_is_named_not_removed(tmp_path):
    """--resume --run-dir RUN/checkpoints (or one of its checkpoints) found none in
    RUN/checkpoints/checkpoints and said to remove the folder given: the checkpoints."""
    run_dir, stray = tmp_path / "run", tmp_path / "step_000004"  # (one moved out of its run)
    folder = run_dir / "checkpoints" / "step_000004"
    for made in (folder, stray):
        made.mkdir(parents=True)
        (made / "meta.json").write_text('{"step": 4}')
    back = f"resume with --run-dir {run_dir}"
    for given, fix in ((folder.parent, back), (folder, back),
                       (stray, "move it into RUN/checkpoints/ and resume with --run-dir RUN")):
        with pytest.raises(CheckpointError, match=re.escape(f"--resume: {given} is ") + ".*; " +
                           re.escape(f"--run-dir is the run's folder (the one holding "
                                     f"checkpoints/): {fix}") + "$"):
            checkpoint.resumable(given, flow)


def test_saved_node_inputs_are_written_whole_and_a_cut_file_is_named(tmp_path, monkeypatch):
    """--save-inputs wrote each file in place: a launch killed mid-write left it cut short,
    and `asyncrl run --node` failed with msgspec's DecodeError, naming no file."""
    path = tmp_path / "step3" / "score.msgpack"
    asyncio.run(saved_inputs.save_node_inputs(path.parent, "score", {"x": [1, 2]}))
    monkeypatch.setattr(os, "fsync", lambda fd: 1 / 0)  # killed before it is whole
    with pytest.raises(ZeroDivisionError):
        asyncio.run(saved_inputs.save_node_inputs(path.parent, "score", {"x": [3]}))
    assert saved_inputs.load_inputs(path) == ({"x": [1, 2]}, {})  # the one before, whole
    assert os.listdir(path.parent) == ["score.msgpack"]
    path.write_bytes(path.read_bytes()[:-3])  # cut short (written before this was fixed)
    with pytest.raises(ValueError, match=re.escape(f"{path} cannot be read as a node's inputs")
                       + r" \(.*\); save them again with `asyncrl launch FLOW --save-inputs`"):
        saved_inputs.load_inputs(path)
