"""Pipeline benchmark: the overlapped GRPO flow (examples/grpo_async.py) with max_staleness 0,
1 and 2; weight sync against the data plane's own bandwidth; TRL's GRPOTrainer on the same
task, model, batch and generation length. Everything in one run, on this machine.

    {"bench": "pipeline", "max_staleness": k, "step_s", "gen_s", "train_s",
     "overlap_efficiency", "speedup_vs_k0", "tokens_per_s"}
        each k runs --rounds times, the rounds interleaved (k = 0, 1, 2, then TRL; again...);
        every figure is the median over the rounds (best_step_s and best_tokens_per_s: the
        fastest round's; rounds_*: every round's);
        step_s: the period between steps' starts (wall_step_s: wall time / steps, which
        also spreads the last overlapped step's tail over the steps);
        gen_s, train_s: the rollout and train nodes' busy time a step in the k=0 runs;
        overlap_efficiency: a round's step_s / max(gen_s, train_s) of the k=0 run of the
        same round, the median over the rounds (its min-max in overlap_efficiency_range);
        speedup_vs_k0 likewise, paired by round (targets at k=1, judged by the medians:
        efficiency <= 1.15 and a step >= 1.6x faster than k=0, with generation and
        training about equal); busy_ms: every node's busy time a step, median of the rounds
    {"bench": "weight_sync", "bytes", "sync_s", "gib_per_s", "transport_gib_per_s",
     "outside_wire_fraction"}
        a trainer group's full weights to a rollout group (one call), against a plain
        data-plane pull of the same bytes between the same groups; outside the wire: the
        share of the sync's time a pull of its bytes does not account for (1 - wire_s /
        sync_s: packing, loading, the controller's hops), and never less than
        pack_load_fraction, the ranks' own gathering, packing, unpacking and loading
        (targets: >= 60 % of the transport, < 20 % outside the wire)
    {"bench": "grpo_vs_trl", "system": "asyncrl" | "trl", "tokens_per_s"} (TRL's: "threads")
        TRL in one process with one torch thread and with one per core this process may run
        on (asyncrl's two groups use a core each), in each round right after asyncrl's runs:
        the target is asyncrl ahead of the faster of the two, each round's asyncrl against
        the same round's TRL, judged by the median of those ratios

Run: `.venv/bin/python benchmarks/pipeline.py [--steps 30] [--rounds 2] [--sync-preset llama-100m]`
(`--skip-trl` without trl; `--kl-coef 0`: no KL term, so neither asyncrl nor TRL runs a
reference model; `--sync-only`: the weight sync alone, as scripts/gpu_check.sh runs it on
one GPU, both groups sharing it). Stdout holds only JSON lines. Driver code stays behind __main__:
the ranks import this file to find the sync workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from machine import describe, version

import asyncrl
from asyncrl import TensorBatch
from asyncrl.actors.rank_fork import RANK_ENV_DEFAULTS
from asyncrl.rl import Policy, Rollout

ROOT = Path(__file__).resolve().parent.parent
FLOW = ROOT / "examples" / "grpo_async.py"
# generation and training take about the same time with these (see gen_s and train_s)
SETTINGS = ["max_new_tokens=16", "lr=0"]  # lr=0: response lengths stay put over the run


def run_flow(k: int, steps: int, run_dir: Path, warmup: int, kl_coef: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "asyncrl", "launch", str(FLOW), "--steps",
                          str(steps), "--run-dir", str(run_dir), f"steps={steps}",
                          f"max_staleness={k}", f"kl_coef={kl_coef}", *SETTINGS],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    from asyncrl.controller.bench import analyse

    deps = {"rollout": [], "score": ["rollout"], "train": ["rollout", "score"],
            "sync": ["train"]}
    if kl_coef:  # a KL term: the reference's log-probs, beside the rollout
        deps["reference"] = ["rollout"]
        deps["train"].append("reference")
    return analyse(run_dir, deps, warmup=warmup)


def _median(values: list[float], digits: int) -> float:
    return round(statistics.median(values), digits)


def _range(values: list[float], digits: int) -> list[float]:
    return [round(min(values), digits), round(max(values), digits)]


def pipeline(steps: int, warmup: int, rounds: int, kl_coef: float, trl_threads: list[int],
             emit: Callable[[dict], None]) -> tuple[list[dict], list[dict[int, dict]]]:
    """Each k run `rounds` times, the rounds interleaved (k = 0, 1, 2, then TRL with each of
    `trl_threads`; k = 0, 1, 2, TRL; ...) so that a noisy minute hits every system alike.
    A k's ratios are taken within a round, against the same round's k=0 run, and their
    median is the figure: the k=0 run of another minute is no baseline. Returns the rows
    (one per k) and each round's TRL runs by thread count (TRL's lines emitted as run)."""
    rows, runs = [], {0: [], 1: [], 2: []}
    trl: list[dict[int, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for k, done in runs.items():
                done.append(run_flow(k, steps, Path(tmp) / f"k{k}-{r}", warmup, kl_coef))
            got = {}
            for threads in trl_threads:
                try:
                    got[threads] = {**trl_run(steps, warmup, threads, kl_coef), "round": r}
                except RuntimeError as e:  # asyncrl's rounds go on without it
                    emit({"bench": "grpo_vs_trl", "system": "trl", "round": r,
                          "threads": threads, "skipped": str(e)[-2000:]})
                    trl_threads = []
                    got = {}
                    break
                emit(got[threads])
            if got:
                trl.append(got)
    gens = [f["nodes"]["rollout"]["busy_s_per_step"] for f in runs[0]]
    trains = [f["nodes"]["train"]["busy_s_per_step"] for f in runs[0]]
    for k, done in runs.items():
        periods = [f["period_s"] for f in done]
        efficiency = [p / max(g, t) for p, g, t in zip(periods, gens, trains, strict=True)]
        speedup = [f0["period_s"] / p for f0, p in zip(runs[0], periods, strict=True)]
        tokens = [f["tokens_per_s"] for f in done]
        row = {"bench": "pipeline", "max_staleness": k, "kl_coef": kl_coef,
               "rounds": rounds, "steps": steps, "warmup": warmup,
               "step_s": _median(periods, 4), "best_step_s": round(min(periods), 4),
               "wall_step_s": _median([f["step_s"] for f in done], 4),
               "gen_s": _median(gens, 4), "train_s": _median(trains, 4),
               "overlap_efficiency": _median(efficiency, 3),
               "overlap_efficiency_range": _range(efficiency, 3),
               "speedup_vs_k0": _median(speedup, 3), "speedup_vs_k0_range": _range(speedup, 3),
               "tokens_per_s": _median(tokens, 1), "best_tokens_per_s": round(max(tokens), 1),
               # the runs' own busy times: what sharing the cores and the memory bus
               # does to each node when the groups overlap
               "busy_ms": {n: round(1000 * statistics.median(
                   f["nodes"][n]["busy_s_per_step"] for f in done if n in f["nodes"]), 1)
                   for n in done[0]["nodes"]},
               "rounds_step_s": [round(p, 4) for p in periods],
               "rounds_tokens_per_s": [round(x, 1) for x in tokens],
               "rounds_overlap_efficiency": [round(x, 3) for x in efficiency],
               "rounds_speedup_vs_k0": [round(x, 3) for x in speedup]}
        if k == 1:  # the targets, judged by the medians
            row["efficiency_met"] = row["overlap_efficiency"] <= 1.15
            row["speedup_met"] = row["speedup_vs_k0"] >= 1.6
        rows.append(row)
    return rows, trl


class SyncTrainer(Policy):
    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def blob(self, nbytes: int) -> TensorBatch:
        """The same bytes as the weights, as one TensorBatch (the transport's reference)."""
        rows = -(-nbytes // (1 << 20))
        device = next(self.backend.model.parameters()).device  # where the weights are
        return TensorBatch({"flat": torch.ones((rows, 1 << 20), dtype=torch.uint8,
                                               device=device)})


class SyncRollout(Rollout):
    @asyncrl.register
    def receive(self, blob: TensorBatch) -> int:
        return blob.tensor("flat").numel()  # pulled: nothing else done with it


async def weight_sync(preset: str, repeat: int) -> dict:
    model = {"preset": preset}
    # building two ~100M-parameter models keeps a rank busy for seconds: a patient heartbeat
    async with asyncrl.Controller(heartbeat_timeout=60) as ctl:
        trainer = await ctl.spawn(SyncTrainer, model, nprocs=1, hybrid=False, name="trainer")
        # one GPU: both groups on it, the weights going by CUDA IPC; else apart (NCCL between
        # GPUs, shared memory between a CPU host's cores)
        one_gpu = torch.cuda.device_count() == 1
        rollout = await ctl.spawn(SyncRollout, model, nprocs=1, name="rollout",
                                  place=asyncrl.colocate_with(trainer) if one_gpu
                                  else asyncrl.separate_from(trainer))
        syncs, wires, blob = [], [], None
        for _ in range(repeat + 1):  # the first warms the pools
            t0 = time.perf_counter()
            got = await rollout.load_weights(trainer.sync_pack())
            syncs.append((time.perf_counter() - t0, got))
            if blob is None:
                # made once and kept: a blob made each round was freed on the trainer (an
                # munmap of its bytes) while the next sync ran, which slowed that sync by
                # ~20 ms of ~60 here; a pipeline frees no such buffer beside its syncs
                blob = trainer.blob(int(got["sync/bytes"]))
                await blob._fut  # produced (not fetched here): time only the transfer
            t0 = time.perf_counter()
            await rollout.receive(blob)
            wires.append(time.perf_counter() - t0)
        del blob
    sync_s = statistics.median(s for s, _ in syncs[1:])
    # the packing and loading the ranks time themselves; the rest of the time outside the
    # wire (the controller's hops, the pull's own overhead) shows in 1 - wire_s / sync_s
    pack_load = statistics.median((g["sync/pack_s"] + g["sync/load_s"]) / s
                                  for s, g in syncs[1:])
    nbytes = syncs[0][1]["sync/bytes"]
    wire_s = statistics.median(wires[1:])
    return {"bench": "weight_sync", "preset": preset, "bytes": int(nbytes), "repeat": repeat,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "sync_s": round(sync_s, 4), "gib_per_s": round(nbytes / sync_s / 2**30, 3),
            "transport_gib_per_s": round(nbytes / wire_s / 2**30, 3),
            "share_of_transport": round(wire_s / sync_s, 3),
            # at least the packing and loading the ranks timed, where the pulls' noise
            # makes the sync look as fast as the bare pull
            "outside_wire_fraction": round(max(pack_load, 1 - wire_s / sync_s), 3),
            "pack_load_fraction": round(pack_load, 3),
            "pack_s": round(statistics.median(g["sync/pack_s"] for _, g in syncs[1:]), 4),
            "load_s": round(statistics.median(g["sync/load_s"] for _, g in syncs[1:]), 4)}


def trl_thread_counts() -> list[int]:
    """TRL's torch threads: one, and one per core this process may run on (the cores
    asyncrl's ranks are pinned within, not the machine's: a container or taskset gives
    fewer)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on macOS)
        cores = os.cpu_count() or 1
    return sorted({1, cores})


def trl_run(steps: int, warmup: int, threads: int, beta: float) -> dict:
    """TRL's GRPOTrainer (trl_grpo.py) in a process of its own, as asyncrl's groups are.
    With torch's own allocator settings, not the huge pages asyncrl's ranks ask for: with
    them TRL ran slower here (two threads: 9,800 against 13,200 tokens/s)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV_DEFAULTS}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "trl_grpo.py"), "--steps", str(steps),
         "--warmup", str(warmup), "--threads", str(threads), "--beta", str(beta),
         "--max-new-tokens", "16", "--lr", "0"],
        env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"trl_grpo.py exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sync-preset", default="llama-100m")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each max_staleness and of TRL, interleaved; medians reported")
    p.add_argument("--sync-only", action="store_true",
                   help="only the weight sync (the GPU check: one GPU shared by both groups)")
    p.add_argument("--kl-coef", type=float, default=1e-3,
                   help="0: no KL term, so no reference group (TRL's default beta)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    env = {"cpu": platform.processor() or platform.machine(),
           **describe(torch=torch.__version__, trl=version("trl"),
                      transformers=version("transformers"), asyncrl=asyncrl.__version__),
           "config": {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                      "kl_coef": args.kl_coef, "sync_preset": args.sync_preset,
                      "repeat": args.repeat}}

    def emit(row: dict) -> None:  # as produced: a later part failing loses no figure
        print(json.dumps({**env, **row}), flush=True)  # (a TRL line's own versions kept)

    if args.sync_only:
        emit(asyncio.run(weight_sync(args.sync_preset, args.repeat)))
        return
    with_trl = not args.skip_trl
    if with_trl:  # found missing now, not after the asyncrl runs
        try:
            import datasets  # noqa: F401 - what trl_grpo.py imports
            import trl  # noqa: F401
        except ImportError as e:
            emit({"bench": "grpo_vs_trl", "system": "trl", "skipped": f"{e}"})
            with_trl = False
    threads = trl_thread_counts() if with_trl else []
    rows, trl = pipeline(args.steps, args.warmup, args.rounds, args.kl_coef, threads, emit)
    for row in rows:
        emit(row)
    emit(asyncio.run(weight_sync(args.sync_preset, args.repeat)))
    k0, k1 = (next(r for r in rows if r.get("max_staleness") == k) for k in (0, 1))
    for k, row in ((0, k0), (1, k1)):  # k=0: on-policy, as TRL's GRPO; k=1: overlapped
        emit({"bench": "grpo_vs_trl", "system": "asyncrl", "max_staleness": k,
              "rounds": args.rounds, "tokens_per_s": row["tokens_per_s"],
              "rounds_tokens_per_s": row["rounds_tokens_per_s"]})
    if trl:
        # each round's asyncrl against the same round's faster TRL; the overlapped k=1 run
        # is one step off-policy, TRL on-policy: k=0 is the like for like (what the overlap
        # adds is the difference)
        best = {next(iter(got.values()))["round"]: max(r["tokens_per_s"] for r in got.values())
                for got in trl}
        ratios = {k: [row["rounds_tokens_per_s"][r] / b for r, b in best.items()]
                  for k, row in ((0, k0), (1, k1))}
        emit({"bench": "grpo_vs_trl", "summary": True, "rounds": len(best),
              "asyncrl_over_best_trl": _median(ratios[1], 3),
              "asyncrl_over_best_trl_range": _range(ratios[1], 3),
              "on_policy_asyncrl_over_best_trl": _median(ratios[0], 3),
              "on_policy_asyncrl_over_best_trl_range": _range(ratios[0], 3),
              "target": "> 1", "met": statistics.median(ratios[1]) > 1,
              "met_on_policy": statistics.median(ratios[0]) > 1})


if __name__ == "__main__":
    main()
