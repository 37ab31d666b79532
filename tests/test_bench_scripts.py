"""The benchmark scripts' own logic, without running a benchmark: their options, the lines they
print, the limits they check. Light (no ray, no benchmark at full size)."""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import resource
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from helpers import ROOT

BENCH = Path(ROOT) / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script by name, as it imports its neighbours (machine.py)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


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
    monkeypatch.setattr(sys, "argv", ["controller_scale.py", "--sizes", "4,16",
                                      "--rank-calls", "400", "--warmup", "0.5"])
    level, limits = logging.getLogger("asyncrl").level, resource.getrlimit(
        resource.RLIMIT_NOFILE)
    try:
        with redirect_stdout(io.StringIO()):
            cs.main()
    finally:  # main() sets both for the process it runs in
        logging.getLogger("asyncrl").setLevel(level)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert floors == benches == [(4, 100, 50), (16, 25, 12)]


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
    monkeypatch.setattr(sys, "argv", ["control_plane.py", *argv])
    out = io.StringIO()
    with redirect_stdout(out):
        cp.main()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_control_plane_lines_all_say_where(bench, monkeypatch):
    """Every JSON line carries the machine, commit and date, Ray's "skipped" one too."""
    lines = control_plane_lines(bench, monkeypatch, "--rounds", "1")
    assert any("skipped" in line for line in lines)
    for line in lines:
        assert {"machine", "commit", "date", "versions"} <= set(line), line


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
