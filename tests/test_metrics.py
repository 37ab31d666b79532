"""What a launched run records besides its steps (asyncrl/controller/launch.py, trackers.py):
the numbers of its metrics rows, trackers that fail, and its run directory. No processes."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
import time

import numpy as np
import pytest
import torch

import asyncrl
from asyncrl.controller import logs
from asyncrl.controller.launch import (
    Metrics,
    default_run_dir,
    scalars,
    write_last_spans,
    write_spans,
)
from asyncrl.controller.timeline import Event, Timeline, draw
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

    w, said = Wandb.__new__(Wandb), []  # as made by a run that started well
    w.run, w.logged, w._said_through, w.say = DeadService(), -1, -1, said.append
    w.log(0, {"loss": 1.0})
    assert w.run is None and "no more rows go to wandb" in said[0] and "failed too" in said[1]

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


def test_every_node_has_its_time_one_that_called_no_group_too(tmp_path):
    """time/<node>_s came from a node's group calls only: a node that called none (a reward
    computed on the controller) had none in its rows, which the README gives every node."""
    tl = Timeline()
    tl.node("score", 0, 1.0, 1.25)  # no group call: its own time
    tl.node("train", 0, 1.0, 3.0)
    tl.add(Event("policy", "train", 0, 1.5, 2.5))  # its group call's time, as before
    tl.node("step", 0, 1.0, 1.1)  # a node named "step" leaves the step's time as it is
    Metrics(tmp_path, 1, tl, trackers=[])(0, {}, 3.0)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["time/score_s"] == 0.25 and row["time/train_s"] == 1.0
    assert row["time/step_s"] == 3.0


def test_overlapping_spans_of_one_row_go_on_lanes_that_perfetto_keeps(tmp_path):
    """Every span of a row shared one thread: pipelined nodes (step 1's rollout beside step
    0's train) and concurrent calls on one group overlapped without nesting, which Perfetto
    drops and chrome://tracing draws on top of each other. Each thread's spans now nest or
    are disjoint, and every lane still carries its row's name (a resume reads it back)."""
    tl = Timeline(tmp_path)
    tl.node("rollout", 0, 1.0, 2.0)
    tl.node("train", 0, 1.5, 3.0)  # overlaps rollout 0
    tl.node("rollout", 1, 2.5, 3.5)  # overlaps train 0, after rollout 0: its lane again
    for n, (a, b) in enumerate([(1.0, 1.8), (1.2, 1.4), (1.3, 2.0), (1.9, 2.2)]):
        tl.add(Event("policy", f"call{n}", 0, a, b))  # concurrent calls on one group
    tl.write(tl.take())
    names, spans = perfetto_lanes(tmp_path)
    assert sorted(names.values()) == ["controller"] * 2 + ["policy"] * 3
    assert len(spans) == 7 and Timeline(tmp_path).resume(0) == 6  # (step 1's cut)


def perfetto_lanes(run_dir) -> tuple[dict[int, str], list[dict]]:
    """timeline.json's thread names and spans, checked as Perfetto reads them: each thread's
    spans nest or are disjoint, and each carries its row's name (a resume reads it back)."""
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [e for e in trace if e["ph"] == "X"]
    by_tid: dict[int, list[dict]] = {}
    for e in spans:
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, lane in by_tid.items():
        open_ends: list[float] = []  # the spans enclosing the one at hand
        for e in sorted(lane, key=lambda e: (e["ts"], -e["dur"])):
            open_ends = [end for end in open_ends if end > e["ts"]]
            assert all(e["ts"] + e["dur"] <= end for end in open_ends), (tid, e)
            open_ends.append(e["ts"] + e["dur"])
    assert all(names[e["tid"]] == e["cat"] for e in spans)
    return names, spans


def step_events(t: int, at: float) -> list[Event]:
    """A pipelined step's 10 events from `at`: its train overlaps the next step's rollout,
    its rollout calls overlap each other."""
    return [Event("controller", "rollout", t, at, at + 1.0),
            Event("controller", "train", t, at + 0.9, at + 2.5),
            *(Event("rollout", "rollout", t, at + 0.1 * k, at + 0.6 + 0.1 * k) for k in range(4)),
            Event("reward", "score", t, at + 0.7, at + 0.9),
            Event("ref", "ref", t, at + 1.0, at + 1.4),
            Event("trainer", "train", t, at + 1.0, at + 2.4),
            Event("trainer", "sync", t, at + 2.4, at + 2.45)]


def run_steps(tl: Timeline, metrics: Metrics, steps: range, every: int, at: float) -> None:
    """Steps as `asyncrl launch` runs them: each reported, then at a checkpoint its spans
    written (launch's save: take on the loop, write on a thread), memory holding only the
    steps not written yet."""
    written = steps.start - 1
    for t in steps:
        for e in step_events(t, at + 2.0 * (t - steps.start)):
            tl.add(e)
        metrics(t, {}, 2.0)
        if (t + 1) % every == 0:
            tl.write(tl.take(t))
            written = t
        assert len(tl.events) == 10 * (t - written)  # never the steps already written


def test_bench_gives_each_node_its_busy_and_its_idle_time_a_step(tmp_path):
    """Issue 7: `asyncrl bench` gives per node and per group busy and idle time; per node
    it gave busy only. Steps start every 2 s: rollout is busy 0.9 s a step, train 1.4 s."""
    from asyncrl.controller.bench import analyse, report
    tl = Timeline(tmp_path)
    metrics = Metrics(tmp_path, 3, tl, trackers=[])
    metrics.console = False
    run_steps(tl, metrics, range(3), 3, 0.0)
    f = analyse(tmp_path, {"rollout": [], "score": ["rollout"], "train": ["score"]})
    assert f["period_s"] == pytest.approx(2.0)
    assert f["nodes"]["rollout"] == pytest.approx({"busy_s_per_step": 0.9, "idle_s_per_step": 1.1})
    assert f["nodes"]["train"]["idle_s_per_step"] == pytest.approx(0.6)
    assert "  rollout                900.0        1100.0" in report(f)


def test_a_long_run_holds_only_its_unwritten_steps_and_its_trace_keeps_every_span(tmp_path):
    """Every event of a run stayed in memory (~200 B each; hundreds of MB over days) and the
    whole trace was built from them again at each checkpoint, the work growing with the run.
    Now a checkpoint appends its steps' spans to timeline.jsonl and drops them: timeline.json,
    streamed from it, still holds every span, on lanes Perfetto keeps."""
    tl = Timeline(tmp_path)
    metrics = Metrics(tmp_path, 5000, tl, trackers=[])
    metrics.console = False
    run_steps(tl, metrics, range(5000), 500, 0.0)
    tl.write(tl.take())  # (the run's end: nothing left)
    names, spans = perfetto_lanes(tmp_path)
    assert len(spans) == 50_000 and len({(e["name"], e["cat"], e["args"]["step"], e["ts"])
                                         for e in spans}) == 50_000
    assert sorted(names.values()).count("rollout") == 4  # lanes reused, not new per write
    assert len(names) == 9 and sorted(e["ts"] for e in spans)[0] == 0.0
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[4999])
    assert row["time/busy/trainer_s"] == pytest.approx(1.45)  # each step's own events


def test_a_resume_cuts_the_steps_after_its_checkpoint_and_goes_on_after_them(tmp_path):
    first = Timeline(tmp_path)
    metrics = Metrics(tmp_path, 6, first, trackers=[])
    metrics.console = False
    run_steps(first, metrics, range(6), 3, 100.0)  # checkpoints after steps 2 and 5: the
    with open(tmp_path / "timeline.jsonl", "ab") as f:  # second's save killed, mid-line
        f.write(b'{"name": "train", "cat": "trainer", "ph": "X", "pid": 1, "tid": 7, "ts"')
    before = perfetto_lanes(tmp_path)[1]
    resumed = Timeline(tmp_path)
    assert resumed.resume(2) == 30
    lines = (tmp_path / "timeline.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"ph": "X"' in line]) == 30
    assert all(json.loads(line).get("args", {}).get("step", 0) <= 2 for line in lines)
    metrics = Metrics(tmp_path, 6, resumed, first_step=3, trackers=[])
    metrics.console = False
    run_steps(resumed, metrics, range(3, 6), 3, resumed.origin + 0.5)
    names, spans = perfetto_lanes(tmp_path)
    kept = [e for e in before if e["args"]["step"] <= 2]
    assert [e for e in spans if e["args"]["step"] <= 2] == kept  # as they were written
    last = max(e["ts"] + e["dur"] for e in kept)
    new = [e for e in spans if e["args"]["step"] > 2]
    assert len(new) == 30 and min(e["ts"] for e in new) == pytest.approx(last + 1.5e6)
    assert len(names) == 9  # the resumed run's spans on the lanes of the run's rows


def test_a_rewind_drops_the_later_steps_in_memory_and_in_timeline_jsonl(tmp_path):
    tl = Timeline(tmp_path)
    metrics = Metrics(tmp_path, 9, tl, trackers=[])
    metrics.console = False
    run_steps(tl, metrics, range(3), 3, 0.0)  # checkpoint after step 2
    written = (tmp_path / "timeline.jsonl").read_bytes()
    run_steps(tl, metrics, range(3, 8), 3, 6.0)  # step 5's save failed after its spans
    metrics.rewind(2)  # back to step 2's checkpoint: steps 3.. run again
    assert tl.events == [] and (tmp_path / "timeline.jsonl").read_bytes() == written
    run_steps(tl, metrics, range(3, 9), 3, 20.0)
    tl.write(tl.take())
    spans = perfetto_lanes(tmp_path)[1]
    assert sorted({e["args"]["step"] for e in spans}) == list(range(9)) and len(spans) == 90
    assert min(e["ts"] for e in spans if e["args"]["step"] == 3) == 20e6  # the run again


def test_a_rewind_whose_cut_fails_midway_leaves_timeline_jsonl_as_it_was(tmp_path, monkeypatch):
    """A rewind cut timeline.jsonl in place: truncated, then the kept lines written back; a
    disk filling (or a kill) in between lost the lines it kept. Now the cut replaces the file
    whole: one failing midway leaves it as it was."""
    import errno
    import os

    from asyncrl.controller import timeline

    tl = Timeline(tmp_path)
    metrics = Metrics(tmp_path, 9, tl, trackers=[])
    metrics.console = False
    run_steps(tl, metrics, range(6), 3, 0.0)  # checkpoints after steps 2 and 5
    written = (tmp_path / "timeline.jsonl").read_bytes()

    class Filling:  # a file on a disk with room for 100 more bytes
        def __init__(self, f):
            self.f, self.room = f, 100

        def write(self, data):
            self.f.write(data[:self.room])
            self.room -= min(self.room, len(data))
            if not self.room:
                raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __iter__(self):
            return iter(self.f)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(timeline, "open", lambda *a, **k: Filling(open(*a, **k)), raising=False)
    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Filling(fdopen(*a, **k)))
    with pytest.raises(OSError, match="No space"):
        tl.drop_after(4)  # keeps steps 3 and 4 of the last write, drops step 5
    monkeypatch.undo()
    assert (tmp_path / "timeline.jsonl").read_bytes() == written
    tl.drop_after(4)  # room again: the cut as it should be
    steps = [json.loads(line).get("args", {}).get("step", 0)
             for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert max(steps) == 4 and steps.count(3) == steps.count(4) == 10
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_asyncrl_timeline_rebuilds_the_trace_of_a_run_killed_as_it_wrote_it(tmp_path):
    import argparse

    from asyncrl.cli import timeline

    tl = Timeline(tmp_path)
    for e in step_events(0, 0.0):
        tl.add(e)
    tl.write(tl.take())
    (tmp_path / "timeline.json").unlink()  # killed between timeline.jsonl and its trace
    assert timeline(argparse.Namespace(run_dir=str(tmp_path), out=None)) == 0
    assert len(perfetto_lanes(tmp_path)[1]) == 10
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_of_an_earlier_asyncrl_resumes_with_its_timeline_json(tmp_path):
    """Before timeline.jsonl, a run wrote its whole trace at each checkpoint: a resume takes
    its spans from there."""
    tl = Timeline(tmp_path)
    for t in range(2):
        for e in step_events(t, 2.0 * t):
            tl.add(e)
    tl.write(tl.take())
    (tmp_path / "timeline.jsonl").unlink()
    assert Timeline(tmp_path).resume(0) == 10
    assert len(perfetto_lanes(tmp_path)[1]) == 20  # (rebuilt at the next write)


def test_timeline_trace_and_png(tmp_path):
    tl = Timeline(tmp_path)
    tl.node("rollout", 0, 1.0, 1.2)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))
    tl.write(tl.take())
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert [(e["cat"], e["ts"], e["dur"]) for e in spans] == [
        ("controller", 0.0, 200000.0), ("policy", 0.0, 500000.0)]
    png = draw(tmp_path / "timeline.json", tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_resumed_run_keeps_the_earlier_steps_in_its_timeline(tmp_path):
    first = Timeline(tmp_path)
    for t in range(3):
        first.add(Event("policy", "rollout", t, 100.0 + t, 100.5 + t))
    first.write(first.take())
    resumed = Timeline(tmp_path)  # resumed after step 1's checkpoint: step 2 runs again
    assert resumed.resume(1) == 2
    resumed.add(Event("policy", "rollout", 2, resumed.origin + 0.1, resumed.origin + 0.6))
    resumed.write(resumed.take())
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    spans = sorted((e["args"]["step"], e["ts"], e["dur"]) for e in trace if e["ph"] == "X")
    assert [s for s, *_ in spans] == [0, 1, 2] and all(d == 500000.0 for *_, d in spans)
    assert spans[1][1] - spans[0][1] == 1e6  # their spacing kept, and before the new step
    assert spans[2][1] > spans[1][1] + spans[1][2]


def test_spans_a_failed_write_took_are_written_by_the_next(tmp_path, monkeypatch):
    """take() removed a checkpoint's spans from memory before the write, which a full disk
    failed: they were gone for good (the save's retry found nothing to write)."""
    import asyncrl.controller.timeline as timeline_module

    tl = Timeline(tmp_path)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))
    real = timeline_module._append

    def full(path, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(timeline_module, "_append", full)
    taken = tl.take(0)
    with pytest.raises(OSError):
        tl.write(taken)
    tl.put_back(taken)  # as launch's save does when its write fails
    tl.add(Event("policy", "train", 1, 1.6, 1.9))
    monkeypatch.setattr(timeline_module, "_append", real)
    tl.write(tl.take(1))
    assert written_spans(tmp_path) == [(0, "rollout"), (1, "train")]
    # the failed write's lane had been taken all the same, its "thread_name" line not
    # written: the next span went on a lane no line named (`asyncrl timeline`'s KeyError: 0)
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace if e["ph"] == "X"} <= {e["tid"] for e in trace
                                                            if e["ph"] == "M"}


def test_spans_whose_trace_rebuild_failed_are_not_written_again(tmp_path, monkeypatch):
    """A checkpoint's spans appended, timeline.json's rebuild failing (a full disk): they
    were put back all the same, and the next write appended them a second time."""
    import asyncrl.controller.timeline as timeline_module

    real, failures = timeline_module.build_trace, [OSError(28, "No space left on device")]

    def full_once(run_dir):
        if failures:
            raise failures.pop()
        return real(run_dir)
    monkeypatch.setattr(timeline_module, "build_trace", full_once)
    tl = Timeline(tmp_path)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))

    async def main():
        with pytest.raises(OSError, match="No space"):
            await write_spans(tl, 0)
        await last_write(tl)
    asyncio.run(main())
    assert written_spans(tmp_path) == [(0, "rollout"), (1, "train")]


async def last_write(tl: Timeline) -> None:
    """A step's span added, then the run's last write, as launch's end does."""
    tl.add(Event("policy", "train", 1, 1.6, 1.9))
    await asyncio.to_thread(tl.write, tl.take())


def written_spans(run_dir) -> list[tuple[int, str]]:
    """(step, name) of every span in the run's timeline.json."""
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    return sorted((e["args"]["step"], e["name"]) for e in trace if e["ph"] == "X")


def first_append_held(monkeypatch, full: bool = False
                      ) -> tuple[threading.Event, threading.Event]:
    """timeline.jsonl's first append held on its thread (`began` set) until `go` is set,
    then made, or failing as on a full disk (`full`); the later ones made at once."""
    import asyncrl.controller.timeline as timeline_module

    real, began, go = timeline_module._append, threading.Event(), threading.Event()

    def held(path, data):
        if not began.is_set():
            began.set()
            go.wait(60)
            if full:
                raise OSError(28, "No space left on device")
        return real(path, data)
    monkeypatch.setattr(timeline_module, "_append", held)
    return began, go


def test_spans_whose_write_was_cancelled_are_written_once(tmp_path, monkeypatch):
    """A checkpoint cancelled (Ctrl-C) while its spans were written on a thread put them
    back, and the thread wrote them all the same: the run's last write wrote them again."""
    began, go = first_append_held(monkeypatch)
    tl = Timeline(tmp_path)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))

    async def main():
        writing = asyncio.create_task(write_spans(tl, 0))
        await asyncio.to_thread(began.wait, 60)
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        go.set()
        await last_write(tl)  # (after the thread's: the timeline's lock)
    asyncio.run(main())
    assert written_spans(tmp_path) == [(0, "rollout"), (1, "train")]


def test_spans_of_a_checkpoint_write_that_fails_as_the_run_ends_are_written_last(
        tmp_path, monkeypatch):
    """The run's last write took what memory held while a checkpoint's write still ran;
    that write failed (a full disk) and put its spans back after the take: never written."""
    began, go = first_append_held(monkeypatch, full=True)
    tl = Timeline(tmp_path)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))

    async def main():
        writing = asyncio.create_task(write_spans(tl, 0))
        await asyncio.to_thread(began.wait, 60)
        tl.add(Event("policy", "train", 1, 1.6, 1.9))
        go.set()
        await write_last_spans(tl)
        with pytest.raises(OSError, match="No space"):
            await writing
    asyncio.run(main())
    assert written_spans(tmp_path) == [(0, "rollout"), (1, "train")]


def test_spans_whose_write_waited_for_a_busy_thread_pool_when_cancelled_are_written_once(
        tmp_path):
    """A cancel while the write's job still waited for a thread of the busy default pool
    cancelled the job: the spans were neither written nor put back."""
    from concurrent.futures import ThreadPoolExecutor

    go = threading.Event()
    tl = Timeline(tmp_path)
    tl.add(Event("policy", "rollout", 0, 1.0, 1.5))

    async def main():
        queued, second = [], asyncio.Event()

        class Pool(ThreadPoolExecutor):
            def submit(self, fn, /, *args, **kwargs):  # (on the loop's thread)
                queued.append(fn)
                if len(queued) == 2:
                    second.set()
                return super().submit(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(Pool(1))
        busy = loop.run_in_executor(None, go.wait, 60)  # the pool's one thread, taken
        writing = asyncio.create_task(write_spans(tl, 0))
        await second.wait()  # the write's job waits in the pool's queue
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        go.set()
        await busy
        await last_write(tl)  # (after the first's: one thread, in order)
    asyncio.run(main())
    assert written_spans(tmp_path) == [(0, "rollout"), (1, "train")]


def test_a_short_metrics_write_leaves_no_half_row(tmp_path, monkeypatch):
    """A row was one os.write, its count unread: a nearly full disk took part of it, and
    the next row went on at its end, on its line ({"step": 1{"step": 2, ...}): unreadable
    (a resume's cut dropped both). A write cut short is taken back; a short count, finished."""
    path = tmp_path / "metrics.jsonl"
    logs.append_line(path, json.dumps({"step": 0}))
    real_write = os.write

    def full_after_10_bytes(fd: int, data: bytes) -> int:
        real_write(fd, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(logs.os, "write", full_after_10_bytes)
    with pytest.raises(OSError, match="No space left"):
        logs.append_line(path, json.dumps({"step": 1, "loss": 0.5}))
    monkeypatch.setattr(logs.os, "write", lambda fd, data: real_write(fd, data[:10]))
    logs.append_line(path, json.dumps({"step": 2, "loss": 0.25}))  # written 10 bytes a time
    monkeypatch.undo()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]


class Controller(asyncrl.Worker):
    """A worker class whose groups are named "controller" unless spawn() names them."""


def test_a_group_named_controller_is_refused_before_it_starts(tmp_path, monkeypatch):
    """"controller" is the timeline's row of the flow's node functions: a group of that name
    had its calls left out of time/<node>_s, time/busy/controller_s and `asyncrl bench`."""
    from helpers import run

    monkeypatch.setenv("ASYNCRL_FORK_AGENTS", "0")  # (no warm agent server: no process)

    async def main():
        async with asyncrl.Controller(run_dir=tmp_path, echo_logs=False) as ctl:
            for name in ("controller", None):  # (None: the class's name, in lower case)
                with pytest.raises(ValueError, match="group name 'controller' is the "
                                   "timeline's row of the flow's node functions .*choose "
                                   "another name"):
                    await ctl.spawn(Controller, name=name)
            assert ctl.groups == {}
    run(main())
