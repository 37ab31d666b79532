"""What a launched run records besides its steps (asyncrl/controller/launch.py, trackers.py):
the numbers of its metrics rows, trackers that fail, and its run directory. No processes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from asyncrl.controller.launch import Metrics, default_run_dir, scalars
from asyncrl.controller.timeline import Event, Timeline
from asyncrl.controller.trackers import Wandb


def test_metrics_take_numpy_scalars_and_one_element_tensors():
    """A worker's `{"loss": loss.detach()}` arrives as a tensor, a mean on the controller
    may be a numpy float32: both are numbers of the row (they were dropped without a word);
    flags and tensors of several values are not."""
    got = scalars("train", {"loss": torch.tensor(1.5), "mean": np.float32(0.5),
                            "n": np.int64(3), "w": torch.ones(1, 1, dtype=torch.bfloat16),
                            "a": np.array(2.5), "flag": np.bool_(True),
                            "mask": torch.tensor(True), "vec": torch.ones(3),
                            "name": np.array("policy"), "z": torch.tensor(1 + 2j),
                            "obj": np.array([None], dtype=object)})
    assert got == {"train/loss": 1.5, "train/mean": 0.5, "train/n": 3.0, "train/w": 1.0,
                   "train/a": 2.5}


def test_a_tracker_failing_mid_run_or_at_its_close_neither_ends_nor_hides_the_run(tmp_path,
                                                                                  capsys):
    """A wandb service that died fails the run's log and its finish: said, and the training
    goes on. A tracker failing to close after the run failed is said, not raised in place of
    the run's own error; after a run that went well it is raised."""
    class DeadService:
        def log(self, row, step):
            raise BrokenPipeError("the wandb service is gone")

        def finish(self, exit_code):
            raise BrokenPipeError("the wandb service is gone")

    w = Wandb.__new__(Wandb)  # as made by a run that started well
    w.run, w.logged, w._said_through = DeadService(), -1, -1
    w.log(0, {"loss": 1.0})
    err = capsys.readouterr().err
    assert w.run is None and "no more rows go to wandb" in err and "failed too" in err

    class FullDisk:
        def close(self, failed):
            raise OSError("no space left on device")

    Metrics(tmp_path, 1, Timeline(), trackers=[FullDisk()]).close(failed=True)
    assert "closing the FullDisk tracker failed too: OSError: no space left on device" in \
        capsys.readouterr().err
    with pytest.raises(OSError, match="no space left"):
        Metrics(tmp_path, 1, Timeline(), trackers=[FullDisk()]).close()


def test_runs_started_in_the_same_second_get_run_directories_of_their_own(tmp_path,
                                                                          monkeypatch):
    """The directory is made when chosen: two runs choosing at once (a sweep started in one
    go) cannot both take the same one and write into each other's metrics."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261204-120000")
    first, second = default_run_dir(), default_run_dir()
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "20261204-120000-1"


def test_tensorboard_that_fails_is_said_and_turned_off_not_the_run(tmp_path, capsys):
    """A writer that could not start was turned off without a word; a failure while logging
    ended the run (wandb's is said, and only wandb stops)."""
    from asyncrl.controller.trackers import TensorBoard

    pytest.importorskip("tensorboard")
    (tmp_path / "tensorboard").write_text("a file where its folder goes")
    board = TensorBoard(tmp_path)
    board.log(0, {"loss": 1.0})
    board.log(1, {"loss": 2.0})
    said = capsys.readouterr().err
    assert said.count("tensorboard: could not start its writer") == 1
    assert "metrics.jsonl has them all" in said

    class Broken:
        def add_scalar(self, *args):
            raise OSError(28, "No space left on device")
    board = TensorBoard(tmp_path / "other")
    board.writer = Broken()
    board.log(2, {"loss": 3.0})  # said, not raised
    board.log(3, {"loss": 4.0})
    assert capsys.readouterr().err.count("logging step 2 failed (OSError") == 1
    assert board.writer is None


def test_a_console_gone_or_a_node_named_step_neither_ends_nor_renumbers_the_run(
        tmp_path, monkeypatch):
    """The progress line to a closed pipe (`asyncrl launch ... | head`) raised out of
    on_step and ended the run; a node named "step" returning a number overwrote the row's
    step, and a rewind then kept rows it should have dropped."""
    import io
    import json
    import sys

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", ClosedPipe())
    metrics = Metrics(tmp_path, 4, Timeline(), trackers=[])
    metrics(0, {"step": 0.25, "train": {"loss": 1.0}}, 1.0)
    metrics(1, {"step": 0.5, "train": {"loss": 0.5}}, 1.0)
    assert not metrics.console  # given up on after the first failure
    metrics.rewind(0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "time/step_s": 1.0, "train/loss": 1.0}]


def test_tensorboard_failing_to_close_for_a_rewind_is_turned_off_not_the_run(tmp_path,
                                                                             capsys):
    from asyncrl.controller.trackers import TensorBoard

    class Full:
        def close(self):
            raise OSError(28, "No space left on device")
    board = TensorBoard(tmp_path)
    board.writer = Full()
    board.rewind(3)  # (it raised out of on_rewind, ending a run that had just recovered)
    assert board.writer is None
    assert "closing its writer for a rewind failed (OSError" in capsys.readouterr().err


def test_overlapping_spans_of_one_row_go_on_lanes_that_perfetto_keeps(tmp_path):
    """Every span of a row shared one thread: pipelined nodes (step 1's rollout beside step
    0's train) and concurrent calls on one group overlapped without nesting, which Perfetto
    drops and chrome://tracing draws on top of each other. Each thread's spans now nest or
    are disjoint, and every lane still carries its row's name (a resume reads it back)."""
    tl = Timeline()
    tl.node("rollout", 0, 1.0, 2.0)
    tl.node("train", 0, 1.5, 3.0)  # overlaps rollout 0
    tl.node("rollout", 1, 2.5, 3.5)  # overlaps train 0, after rollout 0: its lane again
    for n, (a, b) in enumerate([(1.0, 1.8), (1.2, 1.4), (1.3, 2.0), (1.9, 2.2)]):
        tl.add(Event("policy", f"call{n}", 0, a, b))  # concurrent calls on one group
    tl.write(tmp_path / "timeline.json")
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [e for e in trace if e["ph"] == "X"]
    for tid in names:
        open_ends: list[float] = []  # the spans enclosing the one at hand
        for e in sorted((e for e in spans if e["tid"] == tid), key=lambda e: e["ts"]):
            open_ends = [end for end in open_ends if end > e["ts"]]
            assert all(e["ts"] + e["dur"] <= end for end in open_ends), (tid, e)
            open_ends.append(e["ts"] + e["dur"])
    assert all(names[e["tid"]] == e["cat"] for e in spans)
    assert sorted(names.values()) == ["controller"] * 2 + ["policy"] * 3
    resumed = Timeline()
    assert resumed.resume(tmp_path / "timeline.json", 0) == 6
    assert sorted((e.row, e.name) for e in resumed.events) == sorted(
        (e.row, e.name) for e in tl.events if e.step == 0)
