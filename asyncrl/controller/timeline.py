"""Where time went: every node execution, and every group call it made, start to end.

Written as a Chrome trace (`timeline.json`, opens in Perfetto or chrome://tracing) and drawn
as a Gantt chart PNG by `asyncrl timeline RUN_DIR` (matplotlib)."""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.controller.logs import replace_json

CONTROLLER_ROW = "controller"
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
    def __init__(self) -> None:
        self._by_step: dict[int, list[Event]] = {}  # a step's events without a scan of all
        self.origin = time.perf_counter()

    @property
    def events(self) -> list[Event]:
        """Every event, step by step."""
        return [e for events in self._by_step.values() for e in events]

    def add(self, event: Event) -> None:
        self._by_step.setdefault(event.step, []).append(event)

    def of_step(self, step: int) -> list[Event]:
        return self._by_step.get(step, [])

    def drop_after(self, step: int) -> None:
        """Forget the events of the steps after `step` (they run again)."""
        self._by_step = {t: es for t, es in self._by_step.items() if t <= step}

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

    def chrome_trace(self, spans: list[Event] | None = None) -> dict[str, Any]:
        """The trace of `spans` (default: every event; events are frozen, so a list taken
        on the loop can be made into a trace on another thread). A row's spans that overlap
        (pipelined nodes, concurrent calls) go on lanes of their own, each a thread named
        after the row: one thread's spans must nest, or Perfetto drops them."""
        spans = self.events if spans is None else spans
        by_row: dict[str, list[Event]] = {CONTROLLER_ROW: []}
        for e in sorted(spans, key=lambda e: e.start):
            by_row.setdefault(e.row, []).append(e)
        origin = min((e.start for e in spans), default=self.origin)  # the first event
        events: list[dict[str, Any]] = []
        first_tid = 0
        for row in [CONTROLLER_ROW] + sorted(by_row.keys() - {CONTROLLER_ROW}):
            lane_ends: list[float] = []  # where each lane's last span ends
            for e in by_row[row]:
                ts = round((e.start - origin) * 1e6, 1)
                dur = round((e.end - e.start) * 1e6, 1)
                # the first lane free by then (compared as written: Perfetto reads these)
                lane = next((i for i, end in enumerate(lane_ends) if end <= ts),
                            len(lane_ends))
                if lane == len(lane_ends):
                    lane_ends.append(ts + dur)
                else:
                    lane_ends[lane] = ts + dur
                events.append({"name": e.name, "cat": e.row, "ph": "X", "pid": 1,
                               "tid": first_tid + lane, "ts": ts, "dur": dur,
                               "args": {"step": e.step}})
            events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": first_tid + i,
                        "args": {"name": row}} for i in range(max(1, len(lane_ends)))]
            first_tid += max(1, len(lane_ends))
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: Path) -> None:
        replace_json(path, self.chrome_trace())  # a kill mid-write leaves the previous one

    def resume(self, path: Path, upto: int) -> int:
        """Take the events of steps <= `upto` from a resumed run's trace, placed a second
        before this timeline's own (each process has its own clock); how many."""
        try:
            trace = json.loads(path.read_text())["traceEvents"]
            rows = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
            spans = [e for e in trace if e["ph"] == "X" and e["args"]["step"] <= upto]
        except (OSError, ValueError, KeyError, TypeError):  # none, or cut short: only the
            return 0  # trace's earlier steps are lost
        if not spans:
            return 0
        shift = self.origin - 1.0 - max(e["ts"] + e["dur"] for e in spans) / 1e6
        for e in spans:
            start = e["ts"] / 1e6 + shift
            self.add(Event(rows[e["tid"]], e["name"], e["args"]["step"], start,
                           start + e["dur"] / 1e6))
        return len(spans)




def draw(trace_path: Path, png_path: Path) -> Path:
    """A Gantt chart of a Chrome trace written by `Timeline.write`: one row per group
    (more where its calls overlap).
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
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{trace_path} is not a trace asyncrl wrote (cut short when the "
                         f"run was killed?): {type(err).__name__}: {err}") from None
    if not spans:
        raise ValueError(f"{trace_path} holds no node executions: nothing to draw")
    names = sorted({e["name"] for e in spans})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(rows)))
    for e in spans:
        ax.barh(e["tid"], e["ms"][1], left=e["ms"][0], height=0.6,
                color=colors[e["name"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(list(rows), [rows[t] for t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("asyncrl timeline: node executions per group")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names],
              labels=names, loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
