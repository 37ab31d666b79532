"""Running a flow file as `asyncrl launch` does: place, spawn, run with a progress line,
write metrics.jsonl and timeline.json into the run directory, shut down.

    run_dir/  logs/<group>.log   metrics.jsonl   timeline.json   inputs/step<t>/<node>.msgpack
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.comm import codec
from asyncrl.controller.controller import Controller
from asyncrl.controller.flow import DataFlow
from asyncrl.controller.timeline import CONTROLLER_ROW, Timeline


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def scalars(prefix: str, value: Any) -> dict[str, float]:
    """The numbers in a node's result, flattened: {"train/loss": 0.5, ...}."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float) and math.isfinite(value):
        return {prefix: float(value)}
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for k, v in value.items():
            out.update(scalars(f"{prefix}/{k}", v))
        return out
    return {}


class Metrics:
    """metrics.jsonl (one object per step), TensorBoard when installed, a progress line."""

    def __init__(self, run_dir: Path, steps: int | None, timeline: Timeline):
        self.path = run_dir / "metrics.jsonl"
        self.steps, self.timeline = steps, timeline
        self.tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self.tb = None

    def __call__(self, step: int, values: dict[str, Any], seconds: float) -> None:
        row: dict[str, Any] = {"step": step, "time/step_s": round(seconds, 4)}
        for node, value in values.items():
            row.update(scalars(node, value))
        spans: dict[str, list[float]] = {}
        for e in self.timeline.events:
            if e.step == step and e.row != CONTROLLER_ROW:
                s = spans.setdefault(e.name, [e.start, e.end])
                s[0], s[1] = min(s[0], e.start), max(s[1], e.end)
        row.update({f"time/{n}_s": round(b - a, 4) for n, (a, b) in spans.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
        total = f"/{self.steps}" if self.steps else ""
        bar = ""
        if self.steps:
            done = min(20, (step + 1) * 20 // self.steps)
            bar = f"[{'#' * done}{'.' * (20 - done)}] "
        shown = "  ".join(f"{k}={v:.4g}" for k, v in row.items()
                          if k not in ("step",) and not k.startswith("time/"))[:120]
        print(f"{bar}step {step + 1}{total}  {seconds:.2f}s  {shown}", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


async def launch_flow(flow: DataFlow, steps: int | None, run_dir: Path,
                      save_inputs: bool = False) -> Path:
    """Run `flow` for `steps` steps with its outputs in `run_dir` (which must exist)."""
    async with Controller(run_dir=run_dir) as ctl:
        timeline = ctl.timeline = Timeline()
        metrics = Metrics(run_dir, steps, timeline)
        flow.save_inputs = run_dir / "inputs" if save_inputs else None
        try:
            await flow.run(steps, on_step=metrics)
        finally:
            metrics.close()
            timeline.write(run_dir / "timeline.json")
    return run_dir


def load_inputs(path: Path) -> dict[str, Any]:
    inputs = codec.decode(path.read_bytes())
    if not isinstance(inputs, dict):
        raise ValueError(f"{path} does not hold a node's inputs (a dict); write it with "
                         f"`asyncrl launch FLOW --save-inputs`")
    return inputs


async def run_one_node(flow: DataFlow, name: str, inputs: dict[str, Any]) -> Any:
    async with Controller():
        await flow.open()
        try:
            return await flow.run_node(name, inputs)
        finally:
            await flow.close()
