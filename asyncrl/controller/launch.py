"""Running a flow file as `asyncrl launch` does: place, spawn, (resume,) run with a progress
line, write metrics.jsonl, checkpoints and timeline.json into the run directory, shut down.

    run_dir/  logs/<group>.log   metrics.jsonl   timeline.jsonl, timeline.json (timeline.py)
              .lock (held while a launch runs there)
              inputs/step<t>/<node>.msgpack   checkpoints/step_<t>/   (see checkpoint.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import math
import numbers
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.actors.worker import sync_file
from asyncrl.controller import checkpoint, declare
from asyncrl.controller.controller import Controller
from asyncrl.controller.declare import OVERRIDES_ENV
from asyncrl.controller.flow import DataFlow
from asyncrl.controller.logs import append_line, say
from asyncrl.controller.recovery import RESTARTS_FILE
from asyncrl.controller.runner import Terminated
from asyncrl.controller.saved_inputs import load_inputs  # noqa: F401 - (cli imports it here)
from asyncrl.controller.timeline import CONTROLLER_ROW, SPANS_FILE, Timeline, union_length
from asyncrl.controller.trackers import WANDB_STATE, TensorBoard, Wandb
from asyncrl.errors import CheckpointError

OVERRIDES_FILE = "overrides.json"  # in RUN_DIR/inputs: the run's key=value overrides
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)  # metrics


def default_run_dir() -> Path:
    """runs/<date-time>, made here: a run started in the same second takes a suffix, also
    when both chose at once (a sweep's runs started together)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir(checkpoint.PRIVATE_DIR)
            return path
        except FileExistsError:
            path, n = base.with_name(f"{base.name}-{n}"), n + 1


def scalars(prefix: str, value: Any) -> dict[str, float]:
    """The numbers in a node's result, flattened: {"train/loss": 0.5, ...}; a key that holds
    a "/" is already a full metric name ("reward/mean") and is kept as it is."""
    if isinstance(value, bool | np.bool_):
        return {}
    if isinstance(value, numbers.Real):  # numpy's scalars too; NaN and inf: a diverging loss
        return {prefix: float(value)}  # must show (as null in metrics.jsonl, with no NaN)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iuf" or \
            isinstance(value, torch.Tensor) and value.numel() == 1 and \
            (value.dtype.is_floating_point or value.dtype in INT_DTYPES):  # loss.detach()
        return {prefix: float(value.item())}
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for k, v in value.items():
            out.update(scalars(k if "/" in str(k) else f"{prefix}/{k}", v))
        return out
    return {}


OWN_KEYS = ("step", "time/step_s")  # a row's keys no node's value may overwrite


class Metrics:
    """metrics.jsonl (one object per step), the trackers (TensorBoard when installed, wandb
    when asked for: asyncrl/controller/trackers.py), a progress line.

    A row: {"step": t, "time/step_s": ..., "time/<node>_s": ..., then each node's numbers};
    a node's time spans its group calls (first start to last end), or its function's run
    where it called no group.
    A node returning {"loss": x} gives "<node>/loss"; a key with a "/" ({"actor/kl": x}) is
    written as it is. With "perf/tokens" in the row, "perf/tokens_per_s" is added (tokens
    over the step's seconds). Per group: "time/busy/<group>_s", the time its ranks spent on
    the step's calls, and "time/idle/<group>_s", the rest of the step's time."""

    def __init__(self, run_dir: Path, steps: int | None, timeline: Timeline,
                 first_step: int = 0, trackers: list[Any] | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.steps, self.timeline = steps, timeline
        self.trackers = [TensorBoard(run_dir, first_step)] if trackers is None else trackers
        self.console = True  # the progress line goes to stderr while it can
        # or to the controller's console, once it runs: a thread of its own writes it (a
        # paused console must not stop the controller's loop)
        self.say: Callable[[str], None] | None = None

    def __call__(self, step: int, values: dict[str, Any], seconds: float) -> None:
        row: dict[str, Any] = {"step": step, "time/step_s": round(seconds, 4)}
        for node, value in values.items():  # (a node named "step" does not renumber rows)
            row.update({k: v for k, v in scalars(node, value).items() if k not in OWN_KEYS})
        if "perf/tokens" in row and seconds > 0:
            row["perf/tokens_per_s"] = row["perf/tokens"] / seconds
        spans: dict[str, list[float]] = {}  # a node's group calls, first start to last end
        own: dict[str, list[float]] = {}  # the node function's: for one that called none
        busy: dict[str, list[tuple[float, float]]] = {}
        for e in self.timeline.of_step(step):
            s = (own if e.row == CONTROLLER_ROW else spans).setdefault(e.name, [e.start, e.end])
            s[0], s[1] = min(s[0], e.start), max(s[1], e.end)
            if e.row != CONTROLLER_ROW:
                busy.setdefault(e.row, []).append((e.start, e.end))
        row.update({f"time/{n}_s": round(b - a, 4) for n, (a, b) in (own | spans).items()
                    if f"time/{n}_s" not in OWN_KEYS})  # (a node named "step": the step's)
        for group, group_spans in sorted(busy.items()):
            used = union_length(group_spans)
            row[f"time/busy/{group}_s"] = round(used, 4)
            row[f"time/idle/{group}_s"] = round(max(0.0, seconds - used), 4)
        append_line(self.path, json.dumps({
            k: v if not isinstance(v, float) or math.isfinite(v) else None
            for k, v in row.items()}))
        values = {k: v for k, v in row.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(step, values)
        total = f"/{self.steps}" if self.steps else ""
        bar = ""
        if self.steps:
            done = min(20, (step + 1) * 20 // self.steps)
            bar = f"[{'#' * done}{'.' * (20 - done)}] "
        keys = [k for k in row if k != "step" and not k.startswith("time/")]
        keys.sort(key=lambda k: not k.startswith("reward/"))  # what a user watches first
        shown = "  ".join(f"{k}={row[k]:.4g}" for k in keys)[:120]
        line = f"{bar}step {step + 1}{total}  {seconds:.2f}s  {shown}"
        if self.say is not None:
            self.say(line + "\n")
        elif self.console:  # gone (a closed pipe, a hung-up terminal): the run goes on
            try:
                print(line, file=sys.stderr, flush=True)
            except OSError:
                self.console = False

    def rewind(self, step: int) -> None:
        """Steps after `step` run again (a recovery went back to a checkpoint): their rows,
        timeline events and TensorBoard scalars go."""
        self.timeline.forget_after(step)
        self._drop_written_after(step)

    async def rewind_off_loop(self, step: int) -> None:
        """`rewind`, its files rewritten on a thread (a long run's metrics.jsonl took
        seconds: no heartbeats meanwhile, and the ranks exited); no step runs meanwhile."""
        self.timeline.forget_after(step)  # (on the loop: events are added there)
        await asyncio.to_thread(self._drop_written_after, step)

    def _drop_written_after(self, step: int) -> None:
        drop_rows_after(self.path, step)
        self.timeline.cut_after(step)
        for tracker in self.trackers:  # (TensorBoard closes its writer: its files flushed)
            tracker.rewind(step)

    def flush(self) -> None:
        for tracker in self.trackers:
            tracker.flush()

    def close(self, failed: bool = False) -> None:
        """Close every tracker (`failed`: the run ended with an error), each in turn: one
        that fails to close keeps no other open. Its error is raised after the others
        closed, or only said when the run failed (the run's own error is the one to see)."""
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # noqa: BLE001 - said after the others closed
                errors.append((tracker, e))
        if errors and failed:
            for tracker, error in errors:
                print(f"closing the {type(tracker).__name__} tracker failed too: "
                      f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        elif errors:
            raise errors[0][1]


def _steps_setting() -> str:
    """A hint when the flow has a `steps` setting: the examples size their prompts' epochs
    by it, so --steps alone cannot take them further."""
    from asyncrl.controller import declare

    if "steps" not in declare.settings:
        return ""
    return (f"; this flow has a steps setting ({declare.settings['steps']}), which may size "
            f"its inputs (the examples' epochs): give steps=N with --steps N")


def drop_rows_after(path: Path, step: int) -> int:
    """Drop the rows of steps after `step` from metrics.jsonl (a resumed run writes them
    again), rewriting it atomically; the number dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (at := _step_of(line)) is not None and at <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:  # on disk before it replaces the rows (a power cut between)
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    """The step of a metrics row; None for a row cut short (a kill while it was written)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


async def launch_flow(flow: DataFlow, steps: int | None, run_dir: Path,
                      save_inputs: bool = False, **options: Any) -> Path:
    """Run `flow` up to step index `steps` (None: `flow.steps`) with its outputs in `run_dir`,
    checkpointing after its last step (and every `flow.checkpoint_every` steps). Options:
    `resume`: continue from the newest complete checkpoint in `run_dir`; else none there.
    `keep`: checkpoints kept; `checkpoints=False`: none written (`asyncrl bench`).
    `controller`: more Controller settings (heartbeat_interval=...). `wandb`: a Weights &
    Biases project the metrics go to as well. `cluster`, `host`: where groups run.
    Recoveries from dead groups are written to run_dir/recoveries.jsonl. The run directory
    is this launch's alone while it runs (a lock on RUN_DIR/.lock)."""
    run_dir = Path(run_dir)
    if options.get("resume") and not run_dir.is_dir():  # its own error, and no folder made
        checkpoint.resumable(run_dir, flow)
    lock = hold_run_dir(run_dir)
    try:
        return await _launch_flow(flow, steps, run_dir, save_inputs, **options)
    finally:
        os.close(lock)  # (the lock goes with the descriptor)


LOCK_FILE = checkpoint.LOCK_FILE


def hold_run_dir(run_dir: Path) -> int:
    """An exclusive lock on RUN_DIR/.lock (released as its descriptor closes or the process
    ends): two launches in one run directory remove each other's half-written checkpoints
    and interleave their metrics. A regular file opened for writing: NFS takes a lock on it
    to the server, one on a folder only to this host (a requeue on another node)."""
    fd = _open_run_dir(run_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"{run_dir} is in use by another launch (it holds a lock on "
                              f"{run_dir / LOCK_FILE}); wait for it to end, or choose another "
                              f"--run-dir") from None
    except OSError as e:  # a file system without locks (Lustre's noflock, NFS without
        print(f"asyncrl: cannot lock {run_dir} ({e}); going on unlocked: make sure no other "
              f"launch uses it", file=sys.stderr, flush=True)  # lockd): not this run's fault
    return fd


def _open_run_dir(run_dir: Path) -> int:
    """A descriptor of RUN_DIR/.lock, the folder and file made if need be; a folder that
    cannot be used (a file of that name, one this user cannot write) is the command line's
    mistake, said in a line: not an OSError's traceback."""
    try:
        run_dir.mkdir(checkpoint.PRIVATE_DIR, parents=True, exist_ok=True)
        # as the Controller refuses it, but before a fresh run's cleanup removes files in it
        if (unsafe := checkpoint.open_to_all(run_dir)) is not None:
            raise CheckpointError(unsafe)
        return os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                       os.O_CLOEXEC, checkpoint.PRIVATE_FILE)
    except OSError as e:
        why = "it is a file, not a folder" if run_dir.exists() and not run_dir.is_dir() \
            else f"{e.filename or run_dir}: {e.strerror or e}"
        raise CheckpointError(f"--run-dir {run_dir} cannot be used as the run's folder "
                              f"({why}); choose another --run-dir") from None


async def _launch_flow(flow: DataFlow, steps: int | None, run_dir: Path, save_inputs: bool,
                       *, resume: bool = False, keep: int | None = checkpoint.KEEP,
                       checkpoints: bool = True,
                       cluster: Any = None, host: str = "127.0.0.1",
                       controller: dict[str, Any] | None = None,
                       wandb: str | None = None) -> Path:
    steps = flow.steps if steps is None else steps
    resume_from: Path | None = None
    meta: dict[str, Any] = {}
    if resume:  # checked before anything is spawned
        resume_from, meta = checkpoint.resumable(run_dir, flow)
        if steps is not None and meta["step"] + 1 >= steps:  # a finished run: left as it is
            print(f"nothing to run: steps 0..{meta['step']} are done ({resume_from}); pass "
                  f"--steps N above {meta['step'] + 1} to go on{_steps_setting()}", flush=True)
            return run_dir
        dropped = drop_rows_after(run_dir / "metrics.jsonl", meta["step"])
        print(f"resuming from {resume_from} (steps 0..{meta['step']} done; dropped "
              f"{dropped} metrics rows written after it)", flush=True)
        fresh = [g.name for g in flow.groups if not g.stateful]
        if fresh:  # state a worker keeps without save_state is not in the checkpoint
            print(f"groups {', '.join(fresh)} define no save_state: they resume as built, "
                  f"with only their random number generators restored", flush=True)
    else:
        checkpoint.refuse_existing(run_dir)
    first_step = meta["step"] + 1 if resume_from is not None else 0
    trackers: list[Any] = [TensorBoard(run_dir, first_step)]
    if resume_from is None:  # an earlier run's wandb run, restart counts and spans are not
        for earlier in (WANDB_STATE, RESTARTS_FILE, SPANS_FILE):  # this one's
            (run_dir / earlier).unlink(missing_ok=True)
    if wandb is not None:  # started before any group: a refusal costs nothing
        config = {"asyncrl": {"steps": steps, "max_staleness": flow.max_staleness,
                              "groups": {g.name: g.nprocs for g in flow.groups}},
                  **declare.settings}  # the flow's settings, as config() gave them
        trackers.append(Wandb(run_dir, wandb, config,
                              resumed_after=meta["step"] if resume_from is not None else None))
    timeline = Timeline(run_dir)
    metrics = Metrics(run_dir, steps, timeline, first_step, trackers)

    async def save(step: int) -> None:
        # what a resume from this checkpoint keeps of the steps before it, on disk first
        # (a killed controller writes nothing at its end): the finished steps' spans taken
        # out of memory on the loop, appended to timeline.jsonl and timeline.json rebuilt
        # from it off the loop (the whole trace was built from every event of the run at
        # each checkpoint: ~2.7 s for 400k events, near a heartbeat timeout, on the loop)
        try:
            await write_spans(timeline, step)
        except OSError as e:  # the trace is not the checkpoint: its spans wait for the next
            say(flow._ctl, f"asyncrl: writing the timeline at step {step}'s checkpoint "
                           f"failed ({e}); its spans are written with the next")
        metrics.flush()
        with checkpoint.writing(flow, run_dir, step):  # its rows up to the checkpoint, on disk
            if (run_dir / "metrics.jsonl").exists():
                await asyncio.to_thread(sync_file, run_dir / "metrics.jsonl")
        await checkpoint.save(flow, run_dir, step, keep)

    async def restore() -> bool:  # after a death: the newest checkpoint, if there is one
        found = checkpoint.latest(run_dir)
        if found is None:
            return False
        await checkpoint.restore(flow, found, checkpoint.read_meta(found), rewind=True)
        return True

    failed = True
    try:
        async with Controller(run_dir=run_dir, cluster=cluster, host=host,
                              **(controller or {})) as ctl:
            ctl.timeline = timeline
            assert ctl.logs is not None  # (made as the controller starts)
            metrics.say = ctl.logs.console.write  # (in order with the ranks' lines)
            for tracker in trackers:  # (their notices too)
                tracker.say = ctl.logs.console.write
            if resume_from is not None:  # the steps before the resume stay in the trace
                await asyncio.to_thread(timeline.resume, meta["step"])
            flow.save_inputs = run_dir / "inputs" if save_inputs else None
            if flow.save_inputs is not None:  # `asyncrl run --node` builds the groups alike
                # (with no write for others, whatever the umask: it refuses settings others
                # could have written)
                flow.save_inputs.mkdir(checkpoint.PRIVATE_DIR, parents=True, exist_ok=True)
                checkpoint._write_synced(flow.save_inputs / OVERRIDES_FILE,
                                         os.environ.get(OVERRIDES_ENV, "{}"))
            flow.recovery.log_path = run_dir / "recoveries.jsonl"
            try:
                await flow.open(ctl)
                try:
                    if resume_from is not None:  # (a group dying as it loads: respawned)
                        flow.recovery.resume_counts(meta.get("restarts", {}))
                        await flow.recovery.restored(
                            lambda: checkpoint.restore(flow, resume_from, meta))
                    checkpoint.positions(flow)  # now, not at the first checkpoint (the end)
                    await flow.run(steps, on_step=metrics, restore=restore,
                                   checkpoint=save if checkpoints else None,
                                   on_rewind=metrics.rewind_off_loop, keep=False)
                    what = f"input {flow.ended!r}" if flow.ended in flow.feed.sources \
                        else f"the prompts node {flow.ended!r} draws"  # (DAPO's: its own)
                    if flow.ended is not None and resume_from is not None and \
                            flow.next_step == first_step:  # a resume of a run that ran out
                        print(f"nothing to run: {what} has no items left after "
                              f"steps 0..{meta['step']} ({resume_from}); give it more (a "
                              f"PromptSource's epochs=) to go on{_steps_setting()}",
                              file=sys.stderr, flush=True)
                    elif flow.ended is not None and steps is not None and \
                            flow.next_step < steps:
                        print(f"asyncrl: {what} ran out after "
                              f"{flow.next_step} steps, before the {steps} asked for (a "
                              f"PromptSource ends after its epochs: epochs=None goes on)"
                              f"{_steps_setting()}", file=sys.stderr, flush=True)
                finally:
                    await flow.close()
            finally:
                try:
                    await write_last_spans(timeline)
                except OSError as e:  # (a full disk): never in place of the run's own error
                    say(ctl, f"asyncrl: writing the run's last timeline spans failed ({e}); "
                             f"timeline.json lacks them")
        failed = False
    finally:
        metrics.close(failed)  # (wandb's service process with it)
    return run_dir


async def write_spans(timeline: Timeline, step: int) -> None:
    """The spans of the steps up to `step`, taken out of memory on the loop and written on a
    thread, once whenever a cancel comes: the write is a task of its own, shielded (a cancel
    while its job still waited for a thread of the busy default pool cancelled the job: the
    spans were neither written nor put back); put back for the next write only where their
    append failed (a full disk): not where timeline.json's rebuild did (written twice)."""
    events = timeline.take(step)

    async def write() -> None:
        try:
            await asyncio.to_thread(timeline.append, events)
        except Exception:
            timeline.put_back(events)
            raise
        await asyncio.to_thread(timeline.rebuild)

    writing = asyncio.ensure_future(write())
    _WRITES.add(writing)  # (a task the loop only holds weakly: kept until it ends)
    writing.add_done_callback(_ended_write)
    await asyncio.shield(writing)


_WRITES: set[asyncio.Future[None]] = set()


async def write_last_spans(timeline: Timeline) -> None:
    """The run's last write: the spans left in memory, once the writes still under way
    have ended (one that fails puts its spans back: taken now, they would be lost)."""
    try:  # (wait, not gather: a second Ctrl-C here must not cancel those shielded writes)
        if _WRITES:
            await asyncio.wait(list(_WRITES))
    finally:
        timeline.write(timeline.take())


def _ended_write(writing: asyncio.Future[None]) -> None:
    _WRITES.discard(writing)
    if not writing.cancelled():
        writing.exception()  # (a cancelled caller's: retrieved, not logged as never seen)


def resumed_overrides(run_dir: Path) -> dict[str, Any]:
    """The key=value settings of the run in `run_dir`, kept in its newest checkpoint; that
    checkpoint is checked to be this user's first: another user's settings would reach the
    flow file's import (and its meta.json be read) before `checkpoint.resumable` refused it."""
    newest = checkpoint.latest(run_dir)
    if newest is not None:
        checkpoint._own(newest)
    return checkpoint.checkpoint_overrides(run_dir)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated while in it (exit 143, as `launch` does with a flow), so the
    command's cleanup runs (export's removal of its half-written folder); a handler of the
    caller's own (a scheduler's) is kept, as run() keeps it."""
    def terminated(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    before = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def saved_overrides(inputs: Path) -> dict[str, Any]:
    """The key=value overrides of the run that saved `inputs` (RUN_DIR/inputs/...); they
    reach the flow file's import, so only where this user's: CheckpointError where another
    user wrote them, or could have (as --resume refuses another's checkpoint)."""
    for folder in inputs.resolve().parents:
        if folder.name == "inputs" and (file := folder / OVERRIDES_FILE).is_file():
            for where in (folder.parent, folder, file):
                whose = checkpoint.not_yours(where)
                if whose is not None and os.environ.get(checkpoint.TRUST_RUN_DIR) != "1":
                    fix = (f"`chmod o-w {where}` if you trust it"
                           if checkpoint._own_but_shared(where) else
                           f"copy {folder} into a run directory of yours (its "
                           f"{OVERRIDES_FILE} read first)")
                    raise CheckpointError(
                        f"{where} is {whose}; the run's settings in {file} would reach the "
                        f"flow file's import, so only those you saved, in folders only you "
                        f"(or your group) can write, are taken: {fix}, or set "
                        f"{checkpoint.TRUST_RUN_DIR}=1 where that is false (root on NFS, a "
                        f"FUSE mount)")
            return dict(json.loads(file.read_text()))
    return {}


async def run_one_node(flow: DataFlow, name: str, inputs: dict[str, Any],
                       futures: dict[str, list[list[Any]]] | None = None) -> Any:
    async with Controller():
        await flow.open()
        try:
            return await flow.run_node(name, inputs, futures)
        finally:
            await flow.close()
