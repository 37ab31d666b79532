"""Where time went: every node execution, and every group call it made, start to end.

    events of step t (in memory) ──checkpoint after t──▶ timeline.jsonl (appended: one Chrome
                                                         "X" span a line, on its lane)
                                                  └────▶ timeline.json (rebuilt from it,
                                                         streamed: the trace Perfetto opens)

Memory holds only the steps not written yet; a resume or a rewind cuts the later steps' lines
from timeline.jsonl. timeline.json opens in Perfetto or chrome://tracing; `asyncrl timeline
RUN_DIR` draws it as a Gantt chart PNG (matplotlib)."""

from __future__ import annotations

import contextvars
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asyncrl.controller.logs import append_whole, replace_file

CONTROLLER_ROW = "controller"
SPANS_FILE, TRACE_FILE = "timeline.jsonl", "timeline.json"  # in the run directory
MARKS = 16  # write offsets remembered for a rewind (it goes back to a recent checkpoint)
CHUNK = 1 << 20  # bytes read at a time when timeline.jsonl is streamed
# (node, step) of the node running in this task: group calls are attributed to it
current_node: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "asyncrl_current_node", default=None)
# the groups the node running in this task called (recovery re-runs a node only when none of
# them keeps state: a re-run repeats every call)
called_groups: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "asyncrl_called_groups", default=None)


@dataclass(frozen=True)
class Event:
    row: str  # a group, or the controller for the node functions themselves
    name: str  # the node
    step: int
    start: float  # perf_counter seconds
    end: float


def union_length(spans: list[tuple[float, float]]) -> float:
    """The time covered by at least one of the spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class Timeline:
    """The events of the steps not written yet; with a `run_dir`, `write` appends finished
    steps to its timeline.jsonl (taken from memory by `take`) and rebuilds timeline.json."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self._by_step: dict[int, list[Event]] = {}  # a step's events without a scan of all
        self.origin = time.perf_counter()
        self.run_dir = run_dir
        # a checkpoint's write on a thread may still run when the run's last one starts
        self._lock = threading.Lock()
        self._lanes: dict[str, list[int]] = {}  # a row's lanes: their tids, in order
        self._ends: dict[int, float] = {}  # where each tid's last span ends (us, as written)
        self._zero: float | None = None  # the perf_counter time written as ts `_base`
        self._base = 0.0
        # (offset, highest step of the lines before it) after each write: a rewind cuts the
        # file from the last one at or before its step, not from its start
        self._marks: list[tuple[int, int]] = [(0, -1)]

    @property
    def events(self) -> list[Event]:
        """Every event not written yet, step by step."""
        return [e for events in self._by_step.values() for e in events]

    def add(self, event: Event) -> None:
        self._by_step.setdefault(event.step, []).append(event)

    def of_step(self, step: int) -> list[Event]:
        return self._by_step.get(step, [])

    def take(self, upto: int | None = None) -> list[Event]:
        """Take the events of steps <= `upto` (None: all) out of memory, for `write` (on the
        loop: events are added there; frozen, so a thread can write them)."""
        steps = sorted(t for t in self._by_step if upto is None or t <= upto)
        return [e for t in steps for e in self._by_step.pop(t)]

    def put_back(self, events: list[Event]) -> None:
        """Events `take` gave that could not be written (on the loop): the next write has
        them, before the events added meanwhile."""
        for e in reversed(events):
            self._by_step.setdefault(e.step, []).insert(0, e)

    def drop_after(self, step: int) -> None:
        """Forget the events of the steps after `step` (they run again), in memory and in
        timeline.jsonl (timeline.json follows at the next write)."""
        self.forget_after(step)
        self.cut_after(step)

    def forget_after(self, step: int) -> None:
        """Forget the in-memory events of the steps after `step` (on the loop: events are
        added there)."""
        self._by_step = {t: es for t, es in self._by_step.items() if t <= step}

    def cut_after(self, step: int) -> None:
        """Cut the lines of the steps after `step` from timeline.jsonl (a copy of the file's
        latest writes: a thread's work, not the loop's)."""
        if self.run_dir is None:
            return
        with self._lock:
            i = max((i for i, (_, top) in enumerate(self._marks) if top <= step), default=0)
            size = _cut(self.run_dir / SPANS_FILE, self._marks[i][0], step)
            self._marks = self._marks[:i + 1] + [(size, step)]

    def node(self, name: str, step: int, start: float, end: float) -> None:
        self.add(Event(CONTROLLER_ROW, name, step, start, end))

    def call(self, group: str, node: tuple[str, int] | None, future: Any) -> None:
        """Record a group call made by a node: the time its ranks spent on it (their own
        measure, pulls included), ending when its result arrived; not the time it waited for
        its inputs or for the group's earlier calls."""
        if node is None:
            return
        start = time.perf_counter()

        def done(_: Any) -> None:
            end = time.perf_counter()
            busy = getattr(future, "busy_s", None)
            began = max(start, end - busy) if busy else start
            self.add(Event(group, node[0], node[1], began, end))

        future._fut.add_done_callback(done)

    def write(self, events: list[Event]) -> None:
        """Append `events` (from `take`) to timeline.jsonl, on disk before timeline.json is
        rebuilt from it: the work grows with `events`, and the rebuild's reading and writing
        with the file, in fixed memory."""
        self.append(events)
        self.rebuild()

    def append(self, events: list[Event]) -> None:
        """`write`'s first half: `events` in timeline.jsonl, whole or not at all."""
        run_dir = self._run_dir()
        with self._lock:
            lanes = {row: tids[:] for row, tids in self._lanes.items()}
            ends, zero = dict(self._ends), self._zero
            if zero is None and events:  # the first event written is at 0
                zero = min(e.start for e in events)
            size = _append(run_dir / SPANS_FILE, self._lines(events, zero, lanes, ends))
            # on disk: the lanes they took are the file's (where the append failed, none is:
            # the next write opens them again, each with its "thread_name" line)
            self._lanes, self._ends, self._zero = lanes, ends, zero
            top = max([self._marks[-1][1], *(e.step for e in events)])
            self._marks = self._marks[:1] + [*self._marks[1:], (size, top)][-MARKS:]

    def rebuild(self) -> None:
        """`write`'s second half: timeline.json from timeline.jsonl. A failure leaves the
        spans written (a retry would repeat them): the next write, or `asyncrl timeline`,
        rebuilds it."""
        run_dir = self._run_dir()
        with self._lock:  # (one at a time: the last to replace timeline.json read the
            build_trace(run_dir)  # file last)

    def _run_dir(self) -> Path:
        if self.run_dir is None:
            raise ValueError("this Timeline has no run directory to write to: make it as "
                             "Timeline(run_dir)")
        return self.run_dir

    def _lines(self, events: list[Event], zero: float | None, lanes: dict[str, list[int]],
               ends: dict[int, float]) -> bytes:
        """`events` as Chrome trace lines on the run's clock (`zero` written as ts `_base`),
        each on the first lane of its row free by then (one thread's spans must nest, or
        Perfetto drops them), a new lane named by a "thread_name" line as it appears; the
        lanes taken are marked in `lanes` and `ends`."""
        lines: list[dict[str, Any]] = []
        for e in sorted(events, key=lambda e: (e.row != CONTROLLER_ROW, e.row, e.start)):
            ts = round((e.start - (zero or 0.0)) * 1e6 + self._base, 1)
            dur = round((e.end - e.start) * 1e6, 1)
            tid = _lane(lanes.setdefault(e.row, []), ends, e.row, ts, lines)
            ends[tid] = ts + dur
            lines.append({"name": e.name, "cat": e.row, "ph": "X", "pid": 1, "tid": tid,
                          "ts": ts, "dur": dur, "args": {"step": e.step}})
        return "".join(json.dumps(line) + "\n" for line in lines).encode()

    def resume(self, upto: int) -> int:
        """Go on from a resumed run's timeline.jsonl: its lines of steps after `upto` cut
        (they run again), this timeline's clock placed a second after its last span, new lanes
        after its own; how many spans it keeps. Streamed: on a thread, for a long run's."""
        if self.run_dir is None:
            return 0
        path = self.run_dir / SPANS_FILE
        if not path.exists():
            _from_trace(self.run_dir)  # a run of an earlier asyncrl wrote timeline.json only
        if not path.exists():
            return 0
        cut, kept, last, at = None, 0, float("-inf"), 0
        with open(path, "rb") as f:
            for line in f:
                e = _parse(line)
                if e is None or e["ph"] == "X" and e["args"]["step"] > upto:
                    cut = at if cut is None else cut  # (one cut short by a kill: cut too)
                elif e["ph"] == "M":
                    self._lanes.setdefault(e["args"]["name"], []).append(e["tid"])
                    self._ends[e["tid"]] = float("-inf")
                else:
                    kept, last = kept + 1, max(last, e["ts"] + e["dur"])
                at += len(line)
        size = at if cut is None else _cut(path, cut, upto)
        self._marks = [(0, -1), (size, upto)]
        if kept:  # (each process has its own clock)
            self._zero, self._base = self.origin, last + 1e6
        return kept


def _lane(lanes: list[int], ends: dict[int, float], row: str, ts: float,
          lines: list[dict[str, Any]]) -> int:
    """The tid of the first of `row`'s `lanes` free at `ts` (compared as written: Perfetto
    reads these), or of a new one, named in `lines`."""
    tid = next((t for t in lanes if ends[t] <= ts), None)
    if tid is None:
        tid = max(ends, default=-1) + 1
        lanes.append(tid)
        lines.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                      "args": {"name": row}})
    return tid


def _parse(line: bytes) -> dict[str, Any] | None:
    """A line of timeline.jsonl; None for one cut short by a kill (or not asyncrl's)."""
    try:
        e = dict(json.loads(line)) if line.endswith(b"\n") else {}
        int(e["tid"])
        if e["ph"] == "X":
            int(e["args"]["step"]), float(e["ts"]) + float(e["dur"])
        elif e["ph"] != "M" or not isinstance(e["args"]["name"], str):
            return None
        return e
    except (ValueError, KeyError, TypeError):
        return None


def _append(path: Path, data: bytes) -> int:
    """Append `data` to `path`, on disk when this returns; the file's new size; a write that
    fails is undone (`append_whole`)."""
    return append_whole(path, data, sync=True)


def _keeps(line: bytes, upto: int) -> bool:
    e = _parse(line)
    return e is not None and (e["ph"] == "M" or e["args"]["step"] <= upto)


def _cut(path: Path, offset: int, upto: int) -> int:
    """Drop the lines of steps after `upto` from `path`, from byte `offset` on (the lines
    before it are copied as they are, unparsed: a rewind's or a resume's cut reads only the
    latest writes'); its new size. The file is replaced whole: a kill mid-cut leaves it as
    it was (cut in place, it lost the kept lines after `offset`). Memory stays flat."""
    if not path.exists():
        return 0

    def write(out: IO[bytes]) -> None:
        with open(path, "rb") as f:
            left = offset
            while left and (chunk := f.read(min(CHUNK, left))):
                out.write(chunk)
                left -= len(chunk)
            for line in f:
                if _keeps(line, upto):
                    out.write(line)

    replace_file(path, write)
    return path.stat().st_size


def _copy_lines(src: IO[bytes], out: IO[bytes]) -> None:
    """`src`'s whole lines, separated by commas (a last one cut short by a kill left out),
    a chunk at a time."""
    sep, rest = b"", b""
    while chunk := src.read(CHUNK):
        chunk = rest + chunk
        whole = chunk.rfind(b"\n") + 1
        body, rest = chunk[:whole], chunk[whole:]
        if body:
            out.write(sep + body[:-1].replace(b"\n", b",\n") + b"\n")
            sep = b","


def build_trace(run_dir: Path) -> Path:
    """RUN_DIR/timeline.json, the Chrome trace of timeline.jsonl's lines, streamed; replaced
    whole (a temporary file of its own, on disk before the rename): a kill mid-write leaves
    the previous one, and a checkpoint's build still running beside the run's last one
    does not mix with it."""
    path = run_dir / TRACE_FILE
    replace_file(path, lambda out: _write_trace(run_dir / SPANS_FILE, out))
    return path


def _write_trace(spans: Path, out: IO[bytes]) -> None:
    out.write(b'{"traceEvents": [\n')
    if spans.exists():
        with open(spans, "rb") as f:
            _copy_lines(f, out)
    out.write(b'], "displayTimeUnit": "ms"}\n')


def _from_trace(run_dir: Path) -> None:
    """timeline.jsonl from the timeline.json of a run that an earlier asyncrl wrote (its
    whole trace at each checkpoint), read once; none, or one cut short: nothing."""
    try:
        trace = json.loads((run_dir / TRACE_FILE).read_text())["traceEvents"]
        lines = "".join(json.dumps(e) + "\n" for e in trace if e["ph"] in ("M", "X"))
    except (OSError, ValueError, KeyError, TypeError):
        return
    replace_file(run_dir / SPANS_FILE, lambda out: out.write(lines.encode()))


def draw(trace_path: Path, png_path: Path) -> Path:
    """A Gantt chart of a Chrome trace written by `build_trace`: one row per group (more
    where its calls overlap; a row's lanes together, in the order they were opened).
    ValueError names what is wrong with the trace; ImportError, how to get matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a timeline needs matplotlib: pip install matplotlib (or "
                          "asyncrl's `viz` extra); timeline.json opens in Perfetto "
                          "(ui.perfetto.dev) without it") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:  # (its events' fields read here too: a trace of another tool fails as one)
        trace = json.loads(trace_path.read_text())["traceEvents"]
        rows = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
        spans = [{**e, "name": str(e["name"]), "ms": (float(e["ts"]) / 1e3,
                                                     float(e["dur"]) / 1e3)}
                 for e in trace if e["ph"] == "X"]
        order = sorted(rows, key=lambda t: (rows[t] != CONTROLLER_ROW, str(rows[t]), t))
        y = {t: i for i, t in enumerate(order)}
        lanes = [y[e["tid"]] for e in spans]  # (a span on a lane no line names: not ours)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{trace_path} is not a trace asyncrl wrote (cut short when the "
                         f"run was killed?): {type(err).__name__}: {err}") from None
    if not spans:
        raise ValueError(f"{trace_path} holds no node executions: nothing to draw")
    names = sorted({e["name"] for e in spans})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(rows)))
    for e, lane in zip(spans, lanes, strict=True):
        ax.barh(lane, e["ms"][1], left=e["ms"][0], height=0.6,
                color=colors[e["name"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(order)), [rows[t] for t in order])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("asyncrl timeline: node executions per group")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names],
              labels=names, loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
