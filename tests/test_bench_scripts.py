"""The benchmark scripts' own logic, without running a benchmark: their options, the lines they
print, the limits they check. Light (no ray, no benchmark at full size)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import io
import json
import logging
import os
import resource
import subprocess
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import ROOT

BENCH = Path(ROOT) / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script by name, as it imports its neighbours (machine.py)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def main_lines(module, monkeypatch, *argv: str) -> list[dict]:
    """The JSON lines a benchmark's main() prints, given `argv`."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    out = io.StringIO()
    with redirect_stdout(out):
        module.main()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def check_issue_lines(lines: list[dict], bench: str, keys: tuple[str, ...],
                      identity: tuple[str, ...]) -> list[dict]:
    """Every line of `bench` that ran (no "skipped") has the issue's `keys`, and no two share
    `identity`: a reader that picks the issue's result by bench and identity finds one, and
    never a summary or an extra measurement instead."""
    ran = [line for line in lines if line.get("bench") == bench and "skipped" not in line]
    assert ran, lines
    for line in ran:
        assert set(keys) <= set(line), line
    ids = [tuple(line[k] for k in identity) for line in ran]
    assert len(ids) == len(set(ids)), ids
    return ran


class FakeController:
    """The part of asyncrl.Controller a benchmark's driver uses, its groups `group()`, in this
    process: the driver's own logic runs, no rank starts."""

    payload_bytes = 0

    def __init__(self, group, **settings):
        self.group = group

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def spawn(self, worker, *args, **kwargs):
        return self.group()

    async def close_group(self, group):
        return None


def test_controller_scale_names_the_open_file_limit():
    """A floor whose peers cannot all be accepted under the open-file limit fails at once,
    saying so, instead of waiting forever for hellos libzmq never accepted."""
    limit = 100  # the hard one too: raising the soft limit cannot help
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard open-file limit, {hard}, is below the {limit} this test sets")

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    out = subprocess.run([sys.executable, str(BENCH / "controller_scale.py"), "--sizes", "64",
                          "--calls", "broadcast", "--rank-calls", "640", "--repeat", "1"],
                         preexec_fn=low, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0
    assert "open-file limit of 100" in out.stderr or "open-file limit is 100" in out.stderr, \
        out.stderr[-2000:]


def controller_scale_lines(cs, monkeypatch, *argv: str) -> list[dict]:
    """controller_scale.py's main() and its lines; the logging level and open-file limit
    that main() sets for its process put back."""
    level, limits = logging.getLogger("asyncrl").level, resource.getrlimit(
        resource.RLIMIT_NOFILE)
    try:
        return main_lines(cs, monkeypatch, *argv)
    finally:
        logging.getLogger("asyncrl").setLevel(level)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_controller_scale_floor_warms_up_as_the_calls(bench, monkeypatch):
    """The raw ZeroMQ floor takes --warmup's share of its calls, as asyncrl's calls do."""
    cs = bench("controller_scale")
    floors, benches = [], []

    def floor(n, calls, warmup, repeat):
        floors.append((n, calls, warmup))
        return {"ranks": n, "call": "zmq_floor", "us_per_rank": 1.0, "relay": False}

    async def fake_bench(sizes, kinds, rank_calls, warmup, repeat, encrypt, relay):
        for n in sizes:
            calls = max(10, rank_calls // n)
            benches.append((n, calls, max(2, int(calls * warmup))))  # measure()'s warm-up
        return [{"ranks": n, "call": k, "us_per_rank": 1.0, "relay": True}
                for n in sizes for k in kinds]

    monkeypatch.setattr(cs, "zmq_floor", floor)
    monkeypatch.setattr(cs, "bench", fake_bench)
    controller_scale_lines(cs, monkeypatch, "--sizes", "4,16", "--rank-calls", "400",
                           "--warmup", "0.5")
    assert floors == benches == [(4, 100, 50), (16, 25, 12)]


def test_controller_scale_lines_are_one_per_ranks_and_call(bench, monkeypatch):
    """Each "controller_scale" line is one (ranks, call) with its us_per_rank, as the issue
    shapes it; the targets' summary is a bench of its own."""
    cs = bench("controller_scale")
    repeats = [(0.01, 0.001, 0.02)]  # one repeat's (CPU, ZeroMQ I/O, wall) seconds

    async def fake_bench(sizes, kinds, rank_calls, warmup, repeat, encrypt, relay):
        return [cs.record(n, k, 10, repeats, relay=True) for n in sizes for k in kinds]

    monkeypatch.setattr(cs, "zmq_floor", lambda n, calls, warmup, repeat: cs.record(
        n, "zmq_floor", calls, repeats, relay=False))
    monkeypatch.setattr(cs, "bench", fake_bench)
    lines = controller_scale_lines(cs, monkeypatch, "--sizes", "4,16")
    ran = check_issue_lines(lines, "controller_scale", ("ranks", "us_per_rank"),
                            ("ranks", "call"))
    assert len(ran) == 6  # 2 sizes x (the floor, broadcast, dp)
    assert [line["bench"] for line in lines if line not in ran] == ["controller_scale_summary"]


def test_pipeline_gives_trl_the_cores_it_may_use(bench, monkeypatch):
    pipeline = bench("pipeline")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert pipeline.trl_thread_counts() == [1, 3]
    monkeypatch.delattr(os, "sched_getaffinity")  # (macOS)
    assert pipeline.trl_thread_counts() == [1, 64]


def control_plane_lines(bench, monkeypatch, *argv: str) -> list[dict]:
    """control_plane.py's main() and its JSON lines, each system's round a made-up figure,
    without ray (as in CI)."""
    cp = bench("control_plane")
    fake = {"rtt_us_median": 100.0, "rtt_us_p99": 200.0, "calls_per_s": 1000.0}
    monkeypatch.setattr(cp, "bench_zmq", lambda args, peers=1: dict(fake))
    monkeypatch.setattr(cp, "bench_asyncrl", lambda args: {1: dict(fake), 2: dict(fake)})
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError, here or not
    return main_lines(cp, monkeypatch, *argv)


def test_control_plane_lines_all_say_where(bench, monkeypatch):
    """Every JSON line carries the machine, commit and date, Ray's "skipped" one too."""
    lines = control_plane_lines(bench, monkeypatch, "--rounds", "1")
    assert any("skipped" in line for line in lines)
    for line in lines:
        assert {"machine", "commit", "date", "versions"} <= set(line), line


def test_control_plane_lines_are_one_per_system_and_ranks(bench, monkeypatch):
    """Each "control_plane" line that ran is one (system, ranks) with its figures, as the
    issue shapes it; the targets' summary is a bench of its own."""
    lines = control_plane_lines(bench, monkeypatch, "--rounds", "1")
    check_issue_lines(lines, "control_plane", ("system", "ranks", "rtt_us_median", "rtt_us_p99",
                                               "calls_per_s"), ("system", "ranks"))
    assert lines[-1]["bench"] == "control_plane_summary"


def fake_ray() -> types.ModuleType:
    """What data_plane.py uses of ray, in this process: an actor's `.remote` call answers
    at once, its value its own reference."""
    ray = types.ModuleType("ray")

    def remote(**options):
        def actor(cls):
            def start():
                obj = cls()
                return types.SimpleNamespace(**{
                    name: types.SimpleNamespace(remote=getattr(obj, name))
                    for name in dir(cls) if not name.startswith("_")})
            return types.SimpleNamespace(remote=start)
        return actor

    ray.remote = remote
    ray.init = ray.shutdown = lambda **options: None
    ray.get = lambda refs: refs
    ray.wait = lambda refs, num_returns: (refs, [])
    return ray


class Produced:
    """A call's result in DataPlaneGroup: its column, and `_fut`, as the driver awaits it."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    @property
    def _fut(self):
        return asyncio.sleep(0)


class DataPlaneGroup:
    """A Source or Sink group of data_plane.py in this process: a call's result is its batch,
    a sink's total the batch's sum."""

    pids = {0: os.getpid()}
    store_stats = {0: (0, 0)}  # (objects, bytes) per rank: none left

    def make(self, index, device="cpu"):
        return Produced(torch.ones(len(index), 1024))

    def small(self, index):
        return Produced(torch.ones(len(index), 16))

    async def total(self, result):
        return [float(result.x.sum())]


def test_data_plane_lines_are_one_per_system_and_layout(bench, monkeypatch):
    """Each "data_plane" line that ran is one (system, layout) with its GiB/s, as the issue
    shapes it: the 2-thread copy and the hand-off timed with its producing call have layouts
    of their own, the lifetime check and the summary benches of their own."""
    dp = bench("data_plane")
    for key, value in dp.RANK_ENV_DEFAULTS.items():  # main() sets them where unset
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setitem(sys.modules, "ray", fake_ray())
    monkeypatch.setattr(dp.asyncrl, "Controller", functools.partial(FakeController,
                                                                   DataPlaneGroup))
    threads = torch.get_num_threads()
    try:  # (the copy sets one thread for the process)
        lines = main_lines(dp, monkeypatch, "--mib", "1", "--repeat", "1", "--calls", "1")
    finally:
        torch.set_num_threads(threads)
    ran = check_issue_lines(lines, "data_plane", ("system", "layout", "gib_per_s"),
                            ("system", "layout"))
    assert {("memcpy", "copy"), ("ray", "dp2->dp2"), ("ray", "dp2->dp1"),
            ("asyncrl", "dp2->dp2"), ("asyncrl", "dp2->dp1")} <= {
        (line["system"], line["layout"]) for line in ran}
    assert [line["bench"] for line in lines if line not in ran] == [
        "data_plane_lifetimes", "data_plane_summary"]


def test_load_line_names_its_window():
    pytest.importorskip("psutil", reason="benchmarks/load.py measures memory with psutil")
    out = subprocess.run([sys.executable, str(BENCH / "load.py"), "--futures", "8",
                          "--window", "4"], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.splitlines()[-1])
    assert (line["futures"], line["window"], line["objects_left"]) == (8, 4, 0)


def test_quick_fills_only_the_options_not_given(bench, monkeypatch):
    """--quick shrinks the counts and sizes not given; those given stay as given."""
    calls = control_plane_lines(bench, monkeypatch, "--rounds", "1")[-1]["calls"]
    assert calls == {"sequential": 3000, "pipelined": 5000, "inflight": 1000, "warmup": 200,
                     "rounds": 1}
    calls = control_plane_lines(bench, monkeypatch, "--quick", "--warmup", "7", "--calls", "50",
                                "--rounds", "1")[-1]["calls"]
    assert calls == {"sequential": 50, "pipelined": 500, "inflight": 100, "warmup": 7,
                     "rounds": 1}
    dp = bench("data_plane")
    full, quick = dp.parse([]), dp.parse(["--quick", "--repeat", "9"])
    assert (full.mib, full.repeat, full.calls) == (256, 5, 10_000)
    assert (quick.mib, quick.repeat, quick.calls) == (32, 9, 500)


class SwitchGroup:
    """A SwitchBench group of hybrid_switch.py in this process: each method answers at once,
    one rank's list of VALUES[name]."""

    VALUES = {"which_gpu": None, "device_copy": 0.001, "all_gather": 0.001,
              "host_round_trip": 0.01, "switch": {"params": 1000, "switch_s": 0.002}}

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            return [self.VALUES[name]]
        return call


def test_hybrid_switch_lines_name_the_issues_baselines(bench, monkeypatch):
    """Each "hybrid_switch" line's baseline is one the issue names, "all_gather" (CPU) or
    "memcpy" (GPU), baseline_s that one's time and ratio against it; the offloaded
    optimizer's host round trip is a field of its own; one line per (params, optimizer)."""
    hs = bench("hybrid_switch")
    monkeypatch.setattr(hs.asyncrl, "Controller", functools.partial(FakeController,
                                                                   SwitchGroup))
    found = {}
    for gpu, ranks in ((False, "2"), (True, "1")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        lines = main_lines(hs, monkeypatch, "--presets", "tiny-llama", "--ranks", ranks)
        for line in check_issue_lines(lines, "hybrid_switch", ("params", "switch_s", "baseline",
                                                                "baseline_s"),
                                      ("params", "optimizer")):
            assert line["baseline_s"] == 0.001, line  # the copy or the all_gather alone
            assert line["ratio"] == round(line["switch_s"] / line["baseline_s"], 2), line
            found[line["optimizer"]] = (line["baseline"], line.get("host_round_trip_s"))
    assert found == {"on host": ("all_gather", None), "offloaded": ("memcpy", 0.01),
                     "kept": ("memcpy", None)}


# a rank of SwitchBench.all_gather's gloo floor, its shards uneven as FSDP2's are for 3 ranks
# (a 128-row weight: 43, 43, 42 rows); argv: rank, world size, the init file
GATHER_RANK = """
import sys, types
import torch, torch.distributed as dist
import hybrid_switch

rank, world = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=world)
params = [torch.ones([43, 43, 42][rank], 4)]
fake = types.SimpleNamespace(world_size=world, backend=types.SimpleNamespace(
    model=types.SimpleNamespace(parameters=lambda: params)))
print(hybrid_switch.SwitchBench.all_gather(fake, 1))
dist.destroy_process_group()
"""


def test_hybrid_switch_gathers_uneven_shards(tmp_path):
    """--ranks 3: FSDP2's shards differ in size across the ranks; the floor still gathers."""
    procs = [subprocess.Popen([sys.executable, "-c", GATHER_RANK, str(r), "3",
                               str(tmp_path / "store")], cwd=BENCH, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(3)]
    try:
        outs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0], outs[0][1][-2000:]
    assert all(float(out) >= 0 for out, _ in outs)
