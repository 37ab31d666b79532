"""`asyncrl bench flow.py`: where a pipeline's time goes, from its run's timeline.

    per node   time its group calls kept a group busy (worker-side, per step), and idle:
               the step period less that (never below 0: its calls may span steps)
    per group  busy time, idle time and utilisation over the run
    critical   the chain of dependent nodes with the most busy time per step
    step       wall time / steps; period: the time between steps' starts (the tail of the
               last overlapped step left out)
    overlap    step time / the busiest group's time per step: 1.0 means the step takes
               exactly as long as its busiest group (everything else hidden behind it)
    tokens/s   metrics' perf/tokens over the run's wall time

Busy spans come from the workers (how long each call ran on the ranks, its pulls included),
not from when the controller sent it, so a call waiting for its inputs is not counted busy.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from asyncrl.controller.timeline import CONTROLLER_ROW
from asyncrl.controller.timeline import union_length as _union


def analyse(run_dir: Path, deps: dict[str, list[str]], warmup: int = 0) -> dict[str, Any]:
    """The figures above from RUN_DIR/timeline.json and metrics.jsonl; `deps` maps each
    node to the nodes it reads within a step. The first `warmup` steps are left out."""
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [(rows[e["tid"]], e["name"], e["args"]["step"], e["ts"] / 1e6,
              (e["ts"] + e["dur"]) / 1e6) for e in trace
             if e["ph"] == "X" and e["args"]["step"] >= warmup]
    calls = [s for s in spans if s[0] != CONTROLLER_ROW]
    if not calls:
        after = f" after the first {warmup} step(s)" if warmup else ""
        raise ValueError(f"{run_dir}/timeline.json has no group calls{after}: nothing to "
                         f"analyse")
    metrics = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if r["step"] >= warmup]
    steps = sorted({s[2] for s in calls})
    start, end = min(s[3] for s in spans), max(s[4] for s in spans)
    wall = end - start
    per_step_s = wall / len(steps)
    # overlapped steps (max_staleness >= 1) end with the last one's tail, which wall / steps
    # spreads over every step: the period between steps' starts leaves it out
    began: dict[int, float] = {}
    for _, _, step, a, _ in calls:
        began[step] = min(a, began.get(step, a))
    period_s = (began[steps[-1]] - began[steps[0]]) / (len(steps) - 1) if len(steps) > 1 \
        else wall

    by_group: dict[str, list[tuple[float, float]]] = defaultdict(list)
    node_step: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    group_step: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for group, node, step, a, b in calls:
        by_group[group].append((a, b))
        node_step[(node, step)].append((a, b))
        group_step[(group, step)].append((a, b))
    groups = {g: {"busy_s": _union(s), "idle_s": wall - _union(s),
                  "utilisation": _union(s) / wall if wall else 0.0}
              for g, s in sorted(by_group.items())}
    nodes = sorted({n for n, _ in node_step})
    node_busy = {n: sum(_union(node_step[(n, t)]) for t in steps if (n, t) in node_step)
                 / len(steps) for n in nodes}

    # critical path: the heaviest chain of dependencies, nodes weighted by busy time per step
    best: dict[str, tuple[float, list[str]]] = {}

    def heaviest(n: str) -> tuple[float, list[str]]:
        if n not in best:
            before = [heaviest(d) for d in deps.get(n, []) if d in deps]
            w, path = max(before, default=(0.0, []))
            best[n] = (w + node_busy.get(n, 0.0), [*path, n])
        return best[n]

    critical_s, critical = max((heaviest(n) for n in deps), default=(0.0, []))
    busiest = max(sum(_union(group_step[(g, t)]) for t in steps if (g, t) in group_step)
                  / len(steps) for g in by_group)
    tokens = sum(r.get("perf/tokens") or 0.0 for r in metrics)
    return {"steps": len(steps), "wall_s": wall, "step_s": per_step_s, "period_s": period_s,
            "nodes": {n: {"busy_s_per_step": node_busy[n],
                          "idle_s_per_step": max(period_s - node_busy[n], 0.0)}
                      for n in nodes},
            "groups": groups, "critical_path": critical,
            "critical_path_s": critical_s, "busiest_group_s_per_step": busiest,
            "overlap_efficiency": per_step_s / busiest if busiest else float("nan"),
            "tokens_per_s": tokens / wall if wall else 0.0}


def report(figures: dict[str, Any]) -> str:
    f = figures
    lines = [f"{f['steps']} steps in {f['wall_s']:.2f} s: {f['step_s'] * 1e3:.1f} ms a step "
             f"({f['period_s'] * 1e3:.1f} ms from one step's start to the next's), "
             f"{f['tokens_per_s']:.0f} tokens/s", "",
             "node              busy ms/step  idle ms/step"]
    for n, v in f["nodes"].items():
        lines.append(f"  {n:<16}{v['busy_s_per_step'] * 1e3:>12.1f}"
                     f"{v['idle_s_per_step'] * 1e3:>14.1f}")
    lines += ["", "group             busy s    idle s   utilisation"]
    for g, v in f["groups"].items():
        lines.append(f"  {g:<16}{v['busy_s']:>7.2f}{v['idle_s']:>10.2f}"
                     f"{v['utilisation'] * 100:>12.0f} %")
    lines += ["", f"critical path: {' -> '.join(f['critical_path'])} "
                  f"({f['critical_path_s'] * 1e3:.1f} ms of busy time a step)",
              f"overlap efficiency: {f['overlap_efficiency']:.2f} (step time / busiest group's "
              f"time a step, {f['busiest_group_s_per_step'] * 1e3:.1f} ms; 1.00 is perfect)"]
    return "\n".join(lines)
