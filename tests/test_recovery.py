"""Recovery from dead and hung ranks while a flow runs (tests/drivers/recovery_flow.py):
a stateless group is respawned and only its node re-run; a stateful one sends the flow back
to its last checkpoint; a killed controller leaves no rank behind and --resume goes on.
Every run must end with each step exactly once in metrics.jsonl and in the trainer's state.
Last, one race of the respawn lock, on stand-ins for the flow and the controller."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, assert_gone, poll_until, tensorboard_scalars, wait_until

from asyncrl.actors.procs import kill_pids, pid_alive

FLOW = os.path.join(os.path.dirname(__file__), "drivers", "recovery_flow.py")
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.5", "--transfer-timeout", "10"]


@contextlib.contextmanager
def launched(run_dir: Path, *args: str, env: dict | None = None
             ) -> Iterator[subprocess.Popen]:
    """The flow's driver, however the test ends stopped if still running (SIGTERM: its groups
    shut down; SIGKILL if that hangs; its ranks then end on its silence) and reaped."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "launch", FLOW, "--run-dir",
                             str(run_dir), *FAST, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def held_pid(marks: Path, group: str, proc: subprocess.Popen) -> int:
    mark = marks / f"{group}.pid"
    wait_until(lambda: mark.exists() or proc.poll() is not None, 60, f"{group} to be held")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return int(mark.read_text())


def finish(proc: subprocess.Popen) -> str:
    """The run's stdout and stderr, once it succeeded."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    return out + err


def kill_held(tmp_path: Path, hold: str, *args: str, sig: int = signal.SIGKILL
              ) -> tuple[int, str]:
    """Launch the recovery flow with `hold=<group>:<step>`, send `sig` to the held rank once
    it is held, and let the run finish: the rank's pid and the run's output."""
    marks = tmp_path / "marks"
    marks.mkdir()
    group, _, step = hold.partition(":")
    with launched(tmp_path / "run", f"hold={hold}", f"marks={marks}", *args) as proc:
        pid = held_pid(marks, group, proc)
        # the scorer holds the score train of the step before may still pull: a rewind
        if group != "trainer" and int(step) > 0:
            trained = marks / f"trained.{int(step) - 1}"
            wait_until(lambda: trained.exists() or proc.poll() is not None, 60,
                       f"step {int(step) - 1} to be trained")
        os.kill(pid, sig)
        return pid, finish(proc)


def steps_once(run_dir: Path, steps: int) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["train/seen"] for r in rows] == list(range(steps))
    assert tensorboard_scalars(run_dir, "train/seen") == [(t, float(t)) for t in range(steps)]
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    history = json.loads((last / "trainer" / "history.json").read_text())
    assert history == [[t, t * 10] for t in range(steps)]  # trained on each step once


def recoveries(run_dir: Path) -> list[dict]:
    path = run_dir / "recoveries.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dead_or_hung_stateless_rank_reruns_only_its_node(tmp_path, sig):
    pid, err = kill_held(tmp_path, "scorer:2", "steps=5", sig=sig)
    assert_gone([pid])
    steps_once(tmp_path / "run", 5)
    event, *others = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["node"], event["step"]) == \
        ("rerun", ["scorer"], "score", 2)
    # step 3's score may have been sent to the dead scorer too (nothing holds it back while
    # step 2 trains): it re-runs on the group step 2's re-run respawned
    assert [(e["kind"], e["groups"], e["node"], e["step"]) for e in others] in (
        [], [("rerun", [], "score", 3)])
    why = "killed by signal 9" if sig == signal.SIGKILL else "no heartbeat"
    assert why in event["cause"] and "group 'scorer'" in event["cause"]
    assert "restarting group 'scorer' (1/2)" in err


def test_a_peer_death_an_async_node_meets_as_a_broken_collective_reruns_it(tmp_path):
    """Rank 1 of the two-rank scorer dies while rank 0 waits in their all-reduce: the async
    score node's await may fail with rank 0's RemoteError before the death is declared; it
    waits for the death to show and re-runs like any other (it used to rewind)."""
    kill_held(tmp_path, "scorer:2", "steps=5", "collective=1")
    steps_once(tmp_path / "run", 5)
    event, *others = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["node"], event["step"]) == \
        ("rerun", ["scorer"], "score", 2)
    assert all((e["kind"], e["groups"]) == ("rerun", []) for e in others)


def test_a_node_whose_outputs_are_partly_passed_on_is_rewound_not_rerun(tmp_path):
    """score returns the scorer's pid (done, passed on to train) and a call the scorer dies
    in: a re-run gave a second attempt's score beside the first attempt's pid (on a real
    flow, new samples' scores beside the old samples), so the flow goes back instead."""
    kill_held(tmp_path, "scorer:2", "steps=5", "pair=1")
    steps_once(tmp_path / "run", 5)
    [event] = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["step"], event["resumed_at"]) == \
        ("rewind", ["scorer"], 2, 2)
    assert "group 'scorer'" in event["cause"] and "abandoned" not in event["cause"]


def test_a_stateless_group_dead_in_a_save_is_respawned_and_the_save_made_again(tmp_path):
    """The scorer's rank exits while step 3's checkpoint is written, and the trainer's save
    of it takes longer than the transfer and heartbeat timeouts (a large model's): the save
    failed at the death while the trainer still wrote, the resave gave up waiting for it,
    and the flow went back to step 1's checkpoint (steps 2 and 3 ran twice)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with launched(tmp_path / "run", "steps=5", "die_saving=3", "slow_save=5",
                  f"marks={marks}", "--transfer-timeout", "1") as proc:  # 1 + 2.5 s < 5 s
        finish(proc)
    assert (marks / "scorer.died_saving").exists() and (marks / "trainer.saved_slowly").exists()
    steps_once(tmp_path / "run", 5)
    [event] = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["step"]) == ("resave", ["scorer"], 3)
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "scorer").is_dir()


def test_a_node_that_called_a_stateful_group_is_not_rerun_but_rewound(tmp_path):
    """The train node updates the trainer, then calls the scorer, which dies: re-running the
    node would train on step 3 twice, so the flow goes back to its checkpoint instead."""
    kill_held(tmp_path, "echo:3", "steps=5", "mixed=1")
    steps_once(tmp_path / "run", 5)
    [event] = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["step"], event["resumed_at"]) == \
        ("rewind", ["scorer"], 3, 2)


def test_a_death_a_node_only_awaited_is_not_rerun_but_rewound(tmp_path):
    """score reads the trainer, so the scorer's death there is not repaired by a re-run;
    train awaits score's value and meets that death: train never called the scorer, and a
    re-run of train would meet the same failure again (it spun the controller's loop: a
    hang with the loop at 100 %), so the flow goes back to its checkpoint."""
    kill_held(tmp_path, "scorer:3", "steps=5", "peek=1")
    steps_once(tmp_path / "run", 5)
    [event] = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["step"], event["resumed_at"]) == \
        ("rewind", ["scorer"], 3, 2)


def test_an_input_lost_with_a_group_a_rerun_already_replaced_rewinds(tmp_path):
    """Steps 1-3 in flight (staleness=1): the trainer waits at step 1 with train 2 and 3
    queued behind it; the scorer is killed in score 3, which re-runs on a new scorer. Then
    train 2 pulls score 2 from the dead one: InputLostError, and nothing is dead any more.
    The flow goes back to its start (no checkpoint yet) instead of failing for want of a
    dead group to blame."""
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    with launched(run_dir, "steps=6", "checkpoint_every=4", "staleness=1", "hold=scorer:3",
                  "wait=trainer:1", f"marks={marks}", "draw=1") as proc:
        pid = held_pid(marks, "scorer", proc)
        wait_until(lambda: (marks / "trainer.waiting").exists() or proc.poll() is not None,
                   60, "the trainer to wait")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: recoveries(run_dir) or proc.poll() is not None, 60, "the re-run")
        (marks / "go").write_text("")
        finish(proc)
    steps_once(run_dir, 6)
    rerun, rewind = recoveries(run_dir)
    assert (rerun["kind"], rerun["groups"], rerun["node"]) == ("rerun", ["scorer"], "score")
    assert (rewind["kind"], rewind["groups"], rewind["resumed_at"]) == ("rewind", [], 0)
    assert "InputLostError" in rewind["cause"] and "group 'scorer' is dead" in rewind["cause"]
    # the controller's random numbers drawn again from where the run started, as a straight
    # run draws them (they went on from where they were)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seeded = random.Random(0)
    assert [r["noise"] for r in rows] == [seeded.random() for _ in range(6)]


def test_dead_stateful_rank_rewinds_to_its_checkpoint(tmp_path):
    _, err = kill_held(tmp_path, "trainer:5", "steps=7")
    steps_once(tmp_path / "run", 7)
    [event] = recoveries(tmp_path / "run")
    # checkpoints after steps 1 and 3 (every 2): step 4 ran, then 5 died; back to 3
    assert (event["kind"], event["groups"], event["resumed_at"]) == ("rewind", ["trainer"], 4)
    assert "rewound to step 4" in err
    last = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]  # a resume goes on
    assert json.loads((last / "meta.json").read_text())["restarts"] == {"scorer": 0,
                                                                        "trainer": 1}
    assert json.loads((tmp_path / "run" / "restarts.json").read_text()) == {"scorer": 0,
                                                                           "trainer": 1}


def test_a_group_dying_as_a_rewind_loads_its_checkpoint_is_respawned_and_loads_again(
        tmp_path):
    """A rank dying in load_state (out of memory again, say) failed the rewind inside the
    run's error handling: the run ended with restarts left. Now the dead group is respawned,
    counted, and the checkpoint loaded again."""
    _, err = kill_held(tmp_path, "trainer:5", "steps=7", "die_loading=1")
    assert (tmp_path / "marks" / "trainer.died_loading").exists()  # it did die loading
    steps_once(tmp_path / "run", 7)
    [event] = recoveries(tmp_path / "run")
    assert (event["kind"], event["groups"], event["resumed_at"]) == ("rewind", ["trainer"], 4)
    assert json.loads((tmp_path / "run" / "restarts.json").read_text()) == {"scorer": 0,
                                                                           "trainer": 2}
    assert "restarting group 'trainer' (2/2)" in err, err[-3000:]


def test_a_group_dying_as_a_resume_loads_its_checkpoint_is_respawned_and_loads_again(
        tmp_path):
    """--resume loaded the checkpoint before the run's recovery was in place: a rank dying
    in load_state ended the resume."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    with launched(run_dir, "steps=3", f"marks={marks}") as proc:
        finish(proc)
    with launched(run_dir, "--resume", "steps=5", f"marks={marks}", "die_loading=1") as proc:
        out = finish(proc)
    assert (marks / "trainer.died_loading").exists()  # it did die loading
    assert "restarting group 'trainer' (1/2)" in out, out[-3000:]
    steps_once(run_dir, 5)
    assert json.loads((run_dir / "restarts.json").read_text()) == {"scorer": 0, "trainer": 1}


def test_a_respawn_that_fails_to_build_counts_as_a_restart_and_tries_again(tmp_path):
    """Its __init__ raising (a RemoteError, not a SpawnError) failed the node, and the flow
    rewound to its checkpoint, before session 26; now the respawn is tried again, counted,
    and only the node re-runs."""
    _, out = kill_held(tmp_path, "scorer:1", "steps=4", "fail_build=1")
    steps_once(tmp_path / "run", 4)
    assert (tmp_path / "marks" / "build_failed").exists()  # the first respawn did fail
    assert "restarting group 'scorer' (2/2) in" in out and "failed to build (once)" in out
    assert [(e["kind"], e["node"]) for e in recoveries(tmp_path / "run")] == [("rerun", "score")]


def test_restart_budget_spent_fails_the_run_with_the_cause(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    with launched(tmp_path / "run", "steps=4", "hold=scorer:1", f"marks={marks}",
                  "restarts=0") as proc:
        os.kill(held_pid(marks, "scorer", proc), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # the death fails score's own call of step 1, or first (steps overlap: nothing holds
    # step 1 back while step 0 trains) train of step 0 still pulling score 0 from that rank,
    # which hears of the death and gives up at once
    assert ("node 'score' failed at step 1" in err and "killed by signal 9" in err) or (
        "node 'train' failed at step 0" in err and "from scorer:0: group 'scorer' is dead"
        in err), err
    assert recoveries(tmp_path / "run") == []


def test_killed_controller_leaves_no_rank_and_resume_goes_on(tmp_path, killed_driver_env):
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    children: list[int] = []
    try:
        with launched(run_dir, "steps=7", "hold=trainer:3", f"marks={marks}",
                      env=killed_driver_env) as proc:
            held_pid(marks, "trainer", proc)  # steps 0..2 done, checkpoint after step 1
            children += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            assert len(children) >= 4  # two torchrun agents and their ranks
            proc.kill()
            proc.communicate()
        assert_gone(children, timeout=15)  # the ranks exit on the controller's silence
    finally:  # (else agents and ranks outliving their controller stay)
        kill_pids([p for p in children if pid_alive(p)])
    with launched(run_dir, "--resume") as resumed:  # its own settings again: steps=7, ...
        out = finish(resumed)
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000001'}" in out
    assert '"steps": "7"' in out
    steps_once(run_dir, 7)
    # the killed controller wrote its timeline at the checkpoint: the steps before it stay
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    assert sorted({e["args"]["step"] for e in trace if e["ph"] == "X"}) == list(range(7))


def test_killed_actor_rank_of_the_grpo_demo_resumes_from_its_checkpoint():
    """benchmarks/chaos.py with one kill of an FSDP actor rank: the run goes back to its last
    checkpoint (after step 2: killed once 4 steps are done) and ends with exactly the metrics
    of an undisturbed run."""
    out = subprocess.run([sys.executable, "benchmarks/chaos.py", "--kills", "1", "--groups",
                          "actor", "--steps", "14", "--checkpoint-every", "3", "--after", "4",
                          "--gap", "0", "0.2"], capture_output=True, text=True, timeout=400,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["kills"], result["killed"], result["kinds"]) == (1, ["actor"], ["rewind"]), \
        json.dumps(result)  # (whole: with rows_seen when no kill was made)
    assert (result["steps_completed"], result["steps_lost"], result["duplicate_rows"]) == \
        (14, 0, 0), result
    assert result["max_reward_diff"] < 1e-6, result

def test_a_respawn_cancelled_mid_spawn_keeps_the_group_until_its_spawn_ends():
    """A node's re-run is respawning a dead group when a rewind cancels it: the spawn goes
    on, and the rewind's own respawn must find the new group, not start a second (it failed
    with "a group named ... already exists") nor count a second restart."""
    import asyncio
    import types

    from asyncrl.controller.recovery import Recovery

    async def main():
        spawns, spawning, release = [], asyncio.Event(), asyncio.Event()

        class Ctl:
            async def close_group(self, handle):
                handle.closing = True

        async def spawn(spec):
            spawns.append(spec.name)
            spawning.set()
            await release.wait()  # ranks saying hello, workers being built
            return types.SimpleNamespace(dead=None, closing=False)

        spec, dead = _dead_reward(max_restarts=3, restart_backoff=0.0)
        flow = types.SimpleNamespace(groups=[spec], _ctl=Ctl(), _spawn=spawn)
        recovery = Recovery(flow)
        rerun = asyncio.ensure_future(recovery.respawn(spec, dead))
        await spawning.wait()
        rerun.cancel()  # the rewind's _abandon
        rewind = asyncio.ensure_future(recovery.respawn(spec, dead))
        await asyncio.sleep(0)  # one turn: the rewind is waiting for the group's lock
        release.set()
        results = await asyncio.gather(rerun, rewind, return_exceptions=True)
        return results, spawns, recovery.restarts, spec.handle.dead
    (rerun, rewound), spawns, restarts, handle_dead = asyncio.run(main())
    assert isinstance(rerun, asyncio.CancelledError)
    assert rewound is False and spawns == ["reward"] and restarts == {"reward": 1}
    assert handle_dead is None  # the group the cancelled re-run started


@pytest.mark.parametrize("how", ["close, then cancel", "cancel, then close", "driver"])
def test_a_respawn_under_way_when_the_run_stops_is_cancelled_not_waited_for(how):
    """SIGTERM while a node's re-run (or the driver's rewind) respawned a group: the stop
    waited for the whole spawn (up to startup_timeout + construct_timeout), past docker's or
    slurm's SIGKILL, dropping each further cancel."""
    import asyncio
    import types

    from asyncrl.controller.recovery import Recovery

    async def main():
        spawning, never, cancelled = asyncio.Event(), asyncio.Event(), []

        class Ctl:
            async def close_group(self, handle):
                handle.closing = True

        async def spawn(spec):
            spawning.set()
            try:
                await never.wait()  # ranks loading a model, for minutes
            except asyncio.CancelledError:
                cancelled.append(spec.name)
                raise

        spec, dead = _dead_reward(max_restarts=3, restart_backoff=0.0)
        recovery = Recovery(types.SimpleNamespace(groups=[spec], _ctl=Ctl(), _spawn=spawn))

        async def driver():  # a rewind's respawn, in the task that opened the flow
            recovery.start()
            await recovery.respawn(spec, dead)
        respawn = asyncio.ensure_future(
            driver() if how == "driver" else recovery.respawn(spec, dead))
        await spawning.wait()
        if how == "close, then cancel":
            recovery.stop()  # DataFlow.close()
        respawn.cancel()
        await asyncio.sleep(0.05)  # (held, if it is)
        if how == "cancel, then close":
            recovery.stop()
        done, _ = await asyncio.wait([respawn], timeout=5)
        never.set()  # (a spawn still waited for ends: the test fails, not hangs)
        await asyncio.wait([respawn])
        return respawn in done and respawn.cancelled(), cancelled, spec.handle is not None
    ended, cancelled, kept = asyncio.run(main())
    assert ended and cancelled == ["reward"]
    assert kept  # the dead handle stays until the flow closes it


def _dead_reward(max_restarts, restart_backoff):
    """A stateless group "reward" as Recovery sees it, its handle dead; and the death."""
    import types

    from asyncrl.errors import GroupDeadError

    dead = GroupDeadError("reward", 0, -9, "killed")
    return types.SimpleNamespace(name="reward", stateful=False, max_restarts=max_restarts,
                                 restart_backoff=restart_backoff, place=None,
                                 handle=types.SimpleNamespace(dead=dead, closing=False)), dead


def _stub_flow(spec, spawns):
    """A flow as Recovery sees it: its groups, a controller that closes, a spawn."""
    import types

    class Ctl:
        async def close_group(self, handle):
            handle.closing = True

    async def spawn(spec):
        spawns.append(spec.name)
        return types.SimpleNamespace(dead=None, closing=False)

    return types.SimpleNamespace(groups=[spec], _ctl=Ctl(), _spawn=spawn, _watchers=set(),
                                 _steps={})


def test_a_death_counts_one_restart_when_its_respawn_is_cancelled_in_the_backoff():
    """A re-run counted the restart, then slept its backoff; a rewind cancelled it there
    and, finding the group still dead, counted it again: one crash spent two restarts (with
    max_restarts=1 it ended the run)."""
    import asyncio

    from asyncrl.controller.recovery import Recovery

    async def main():
        spawns: list[str] = []
        spec, dead = _dead_reward(max_restarts=1, restart_backoff=60.0)
        recovery = Recovery(_stub_flow(spec, spawns))
        rerun = asyncio.ensure_future(recovery.respawn(spec, dead))
        await poll_until(lambda: recovery.restarts["reward"] == 1, 10,
                         "the restart to be counted (then its 60 s backoff)")
        rerun.cancel()
        respawned = await asyncio.wait_for(recovery.respawn(spec, dead), 10)
        return respawned, spawns, recovery.restarts, spec.handle.dead
    respawned, spawns, restarts, handle_dead = asyncio.run(main())
    assert respawned and spawns == ["reward"] and restarts == {"reward": 1}
    assert handle_dead is None


def test_a_rerun_that_returns_the_same_failed_future_stops_rerunning():
    """A node returning an upstream future that failed with a stateless group's death (the
    upstream node, which called a stateful group too, was not re-run) was re-run without
    end: its group respawned once, then each re-run met the same failure, respawn found
    the group alive, and the node ran again, thousands of times a second."""
    import asyncio

    from asyncrl.controller.recovery import Recovery
    from asyncrl.controller.timeline import called_groups
    from asyncrl.errors import GroupDeadError
    from asyncrl.futures.future import DistFuture

    async def main():
        spawns: list[str] = []
        spec, dead = _dead_reward(max_restarts=3, restart_backoff=0.0)
        recovery = Recovery(_stub_flow(spec, spawns))
        upstream = DistFuture._new(asyncio.get_running_loop(), "reward.score")
        upstream._set_exception(dead)
        runs = []

        def node():
            runs.append(1)
            called_groups.get().add("reward")  # it calls the group, and returns upstream's
            return upstream

        out = await recovery.call("score", 0, node)
        with pytest.raises(GroupDeadError):
            await asyncio.wait_for(out, 10)
        return len(runs), spawns
    runs, spawns = asyncio.run(main())
    assert runs == 2 and spawns == ["reward"]


def test_a_user_error_in_a_stateless_group_is_reported_after_one_wait_for_a_death():
    """A node's call raising in user code (no death behind it) waited once in the call for a
    death to show, then again in the rewind: twice the heartbeat timeout before the error."""
    import asyncio
    import types

    from asyncrl.controller.nodes import NodeError
    from asyncrl.controller.recovery import Recovery
    from asyncrl.controller.timeline import called_groups
    from asyncrl.errors import RemoteError

    bug = RemoteError("reward", 0, "score", "KeyError", "'answer'", "")

    def node():
        called_groups.get().add("reward")
        raise bug

    async def main():
        spec, _ = _dead_reward(max_restarts=3, restart_backoff=0.0)
        spec.handle = types.SimpleNamespace(dead=None, closing=False)  # alive
        flow = _stub_flow(spec, [])
        flow._ctl.heartbeat_timeout, flow._ctl.heartbeat_interval = 1.0, 0.1
        recovery = Recovery(flow)
        looked = recovery.dead_groups

        async def dead_groups(wait=True, of=None):  # each look noted; none waits: nothing
            waits.append(wait)  # dies here
            return await looked(wait=False)
        recovery.dead_groups = dead_groups
        with pytest.raises(RemoteError):
            await recovery.call("score", 0, node)
        failed = NodeError("score", 0, bug)
        failed.__cause__ = bug  # (as the flow raises it)
        return await recovery.rewind(failed, 0, None)
    waits: list[bool] = []
    assert asyncio.run(main()) is False
    assert waits == [True, False]  # the call's wait for a death; the rewind only looks


def test_a_groups_death_keeps_no_awaiters_frames_alive():
    """Every call of a dead group failed with the one GroupDeadError (`group.dead`), and each
    raise grew its traceback: the last awaiter's frames stayed alive with it (a flow's step,
    its batches on groups still alive) until the group died again."""
    import asyncio
    import gc
    import weakref
    from collections import deque
    from types import SimpleNamespace

    from asyncrl.controller.group import GroupHandle, _Queued
    from asyncrl.errors import GroupDeadError
    from asyncrl.futures.future import DistFuture

    class Batch:  # what an awaiting step holds
        pass

    async def main():
        loop = asyncio.get_running_loop()
        ctl = SimpleNamespace(loop=loop, transfer_timeout=1.0, calls={}, post=None)
        group = GroupHandle(ctl, "trainer", object, None, None)
        futures = [DistFuture._new(loop, f"trainer.step{i}") for i in range(3)]
        group._backlog = deque(_Queued("step", (), {}, f) for f in futures)
        held: list[weakref.ref] = []

        async def step(fut):
            batch = Batch()
            held.append(weakref.ref(batch))
            await fut

        tasks = [asyncio.ensure_future(step(f)) for f in futures]
        await asyncio.sleep(0)  # each awaits its future
        dead = GroupDeadError("trainer", 0, -9, "killed")
        group._fail_all(dead)
        errors = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(e, GroupDeadError) and str(e) == str(dead) for e in errors)
        # each awaiter raised its own future's copy (the one object, raised by all, kept
        # the last one's frames): not `dead`, nor another's
        own = [f._fut.exception() for f in futures]
        assert all(e is o for e, o in zip(errors, own, strict=True))
        assert len({id(e) for e in [dead, *errors]}) == 4
        del tasks, errors, futures, own, group
        return dead, held
    dead, held = asyncio.run(main())
    gc.collect()
    assert dead.__traceback__ is None  # kept (as group.dead is), it holds no frame
    assert len(held) == 3 and all(ref() is None for ref in held)
