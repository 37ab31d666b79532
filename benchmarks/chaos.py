"""Chaos: the GRPO demo flow (examples/grpo_tiny.py) run twice in the same session, once
undisturbed and once while random ranks of random groups are SIGKILLed at random times
(seeded). The disturbed run must lose no step, record none twice, and end with the same
metrics.

    {"bench": "chaos", "kills": N, "recoveries": ..., "steps_completed": ..., "steps_lost": 0,
     "duplicate_rows": 0, "recovery_s": ..., "extra_s": ..., "max_reward_diff": ...}

recovery_s: the time the recoveries took, from noticing the death until the flow could go on
(summed); extra_s: the disturbed run's wall time minus the undisturbed one's (recoveries plus
the steps run again after a rewind); max_reward_diff: the largest difference in reward/mean
at the same step between the two runs (a recovery must not change what the run computes).
The next kill waits until the previous one was recovered from, so each kill is one failure.

Run: `.venv/bin/python benchmarks/chaos.py [--kills 4] [--steps 40] [--seed 0] [--groups actor]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from machine import describe, version

ROOT = Path(__file__).resolve().parent.parent
RANK_TITLE = re.compile(r"asyncrl\.actors\.rank_main \[(\S+) rank \d+\]")
FAST = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--transfer-timeout", "15"]


def launch(run_dir: Path, steps: int, every: int) -> subprocess.Popen:
    """The launcher, its stderr in a file beside the run (a pipe nobody reads while the run
    goes on would fill and block it)."""
    with open(_stderr(run_dir), "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "asyncrl", "launch", "examples/grpo_tiny.py", "--run-dir",
             str(run_dir), "--steps", str(steps), "--checkpoint-every", str(every), *FAST,
             f"steps={steps}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def _stderr(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".stderr")


def stop(proc: subprocess.Popen) -> None:
    """The launcher and everything under it, if still there (a failed or interrupted run)."""
    if proc.poll() is not None:
        return
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    proc.kill()
    proc.wait()
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def ranks(proc: subprocess.Popen) -> dict[str, list[int]]:
    """group -> pids of its live ranks (processes titled `... asyncrl.actors.rank_main [<group>
    rank <r>]`, forked by the agent server or started anew)."""
    out: dict[str, list[int]] = {}
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in children:
        try:
            title = RANK_TITLE.search(" ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title:
            out.setdefault(title[1], []).append(p.pid)
    return out


def count_lines(path: Path) -> int:
    """Whole lines only: a row being written has no newline yet."""
    return path.read_text().count("\n") if path.exists() else 0


def finish(proc: subprocess.Popen, run_dir: Path, what: str) -> None:
    proc.wait(timeout=900)
    if proc.returncode != 0:
        err = _stderr(run_dir).read_text()
        raise SystemExit(f"chaos: the {what} run failed:\n{err[-4000:]}")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def disturb(proc: subprocess.Popen, chaos_dir: Path, args: argparse.Namespace,
            rng: random.Random, seen: list) -> list[dict]:
    """Kill random ranks while the run goes on, one failure at a time; the kills made.
    `seen` gets each count of metrics rows it saw, and "none live" when it found no rank
    to kill (why kills fell short, if they did)."""
    started = time.perf_counter()
    log = chaos_dir / "recoveries.jsonl"
    kills: list[dict] = []
    while len(kills) < args.kills and proc.poll() is None:
        done = count_lines(chaos_dir / "metrics.jsonl")
        if not seen or seen[-1] != done:
            seen.append(done)
        if done >= args.steps - 5:
            break  # a kill after a group's last call would need no recovery
        if done < args.after or count_lines(log) < len(kills):
            time.sleep(0.1)  # starting, or recovering from the last kill: poll
            continue
        time.sleep(rng.uniform(*args.gap))  # a random moment: that is the point here
        live = {g: p for g, p in ranks(proc).items()
                if args.groups is None or g in args.groups}
        if not live or count_lines(chaos_dir / "metrics.jsonl") >= args.steps - 5:
            seen.append("none live" if not live else "late")
            continue
        group = rng.choice(sorted(live))
        pid = rng.choice(sorted(live[group]))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append({"group": group, "pid": pid, "at_s": round(time.perf_counter()
                                                                - started, 2)})
    return kills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--after", type=int, default=1, metavar="N",
                    help="no kill before the run has finished N steps")
    ap.add_argument("--groups", nargs="*", default=None,
                    help="kill ranks of these groups only (default: any group)")
    ap.add_argument("--gap", type=float, nargs=2, default=(1.0, 5.0), metavar=("MIN", "MAX"),
                    help="seconds between a recovery (or the start) and the next kill")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="asyncrl-chaos-") as tmp:
        clean_dir, chaos_dir = Path(tmp) / "clean", Path(tmp) / "chaos"
        started = time.perf_counter()
        proc = launch(clean_dir, args.steps, args.checkpoint_every)
        try:
            finish(proc, clean_dir, "undisturbed")
        finally:
            stop(proc)
        clean_s = time.perf_counter() - started

        started = time.perf_counter()
        proc = launch(chaos_dir, args.steps, args.checkpoint_every)
        try:
            rows_seen: list = []
            kills = disturb(proc, chaos_dir, args, rng, rows_seen)
            finish(proc, chaos_dir, "disturbed")
        finally:
            stop(proc)
        chaos_s = time.perf_counter() - started
        log = chaos_dir / "recoveries.jsonl"

        clean, chaos = rows(clean_dir), rows(chaos_dir)
        seen = [r["step"] for r in chaos]
        events = [json.loads(line) for line in log.read_text().splitlines()] \
            if log.exists() else []
        by_step = {r["step"]: r["reward/mean"] for r in clean}
        result = {
            "bench": "chaos", "kills": len(kills), "recoveries": len(events),
            "steps_completed": len(set(seen)),
            "steps_lost": len(set(range(args.steps)) - set(seen)),
            # (a rewind drops the rows after its checkpoint: steps run again show in recoveries)
            "duplicate_rows": len(seen) - len(set(seen)),
            "recovery_s": round(sum(e["seconds"] for e in events), 2),
            "extra_s": round(chaos_s - clean_s, 2),
            "max_reward_diff": max(abs(r["reward/mean"] - by_step[r["step"]]) for r in chaos),
            "killed": [k["group"] for k in kills],
            "kinds": [e["kind"] for e in events], "seed": args.seed,
            "clean_run_s": round(clean_s, 2), "chaos_run_s": round(chaos_s, 2),
            # (the runs are processes of their own: the versions installed, none imported)
            **describe(**{d: version(d) for d in ("torch", "pyzmq", "msgspec", "asyncrl")})}
        if len(kills) < args.kills:  # (what it saw as it tried)
            result["rows_seen"] = rows_seen
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
