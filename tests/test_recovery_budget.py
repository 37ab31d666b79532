"""The restart budget as Recovery spends it, on stand-ins for the flow and the controller
(as at the end of tests/test_recovery.py): a death being respawned is not a spent budget,
a spent budget says so, a failed spawn counts even when its respawn was cancelled, a hung
group respawned by a rewind is named. Then deaths that come together: a re-run meeting a
second group's death, a broken collective whose group's death shows after another's,
respawns of groups placed with respect to each other."""

import asyncio
import types

from helpers import poll_until

from asyncrl.controller.placement import Host, Placer, colocate_with
from asyncrl.controller.recovery import Recovery
from asyncrl.controller.timeline import called_groups
from asyncrl.errors import GroupDeadError, RemoteError, SpawnError
from asyncrl.futures.future import DistFuture


def _group(name, max_restarts, stateful=False, dead=True):
    """A group as Recovery sees it (its handle dead, or alive), and its death."""
    death = GroupDeadError(name, 0, -9, "killed")
    handle = types.SimpleNamespace(dead=death if dead else None, closing=False, busy=False)
    return types.SimpleNamespace(name=name, stateful=stateful, max_restarts=max_restarts,
                                 restart_backoff=0.0, handle=handle, place=None), death


def _flow(groups, spawns, spawn=None):
    """A flow as Recovery sees it: its groups, a controller that closes, a spawn, and what a
    rewind touches."""

    class Ctl:
        heartbeat_timeout, heartbeat_interval, transfer_timeout = 0.2, 0.05, 0.1

        async def close_group(self, handle):
            handle.closing = True

    async def spawned(spec):
        spawns.append(spec.name)
        return types.SimpleNamespace(dead=None, closing=False, busy=False)

    async def abandon():
        pass

    return types.SimpleNamespace(
        groups=groups, _ctl=Ctl(), _spawn=spawn or spawned, _watchers=set(), _steps={},
        feed=types.SimpleNamespace(check_rereadable=lambda: None), _abandon=abandon,
        _reset_sources=lambda: None, _origin=(0, {}), next_step=3)


async def _restore():
    return True


def test_a_node_calling_a_group_in_its_respawns_backoff_reruns_on_its_last_restart():
    """reward (max_restarts=1) died; node A's re-run counted its one restart and slept the
    backoff; node B, calling reward meanwhile, met the death and found no restart left: it
    raised and failed the step, though the respawn under way then succeeded."""
    async def main():
        spawns: list[str] = []
        spec, _ = _group("reward", max_restarts=1)
        spec.restart_backoff = 0.3
        recovery = Recovery(_flow([spec], spawns))

        def node(runs):
            def call():
                runs.append(1)
                called_groups.get().add("reward")
                if spec.handle.dead is not None:
                    raise spec.handle.dead
                return "scored"
            return call

        a_runs: list[int] = []
        b_runs: list[int] = []
        a = asyncio.ensure_future(recovery.call("a", 0, node(a_runs)))
        await poll_until(lambda: recovery.restarts["reward"] == 1, 10, "A's restart")
        b = await asyncio.wait_for(recovery.call("b", 0, node(b_runs)), 10)
        return await a, b, len(a_runs), len(b_runs), spawns, recovery.restarts
    a, b, a_runs, b_runs, spawns, restarts = asyncio.run(main())
    assert (a, b, a_runs, b_runs) == ("scored", "scored", 2, 2)
    assert spawns == ["reward"] and restarts == {"reward": 1}


def test_a_rewind_while_a_groups_last_restart_is_under_way_goes_back():
    """reward's last restart was in its backoff (a re-run cancelled there by the rewind) when
    the actor (3 restarts left) died: the rewind found reward with none left and gave up."""
    async def main():
        spawns: list[str] = []
        reward, reward_death = _group("reward", max_restarts=1)
        actor, actor_death = _group("actor", max_restarts=3, stateful=True)
        reward.restart_backoff = 60.0
        recovery = Recovery(_flow([actor, reward], spawns))
        rerun = asyncio.ensure_future(recovery.respawn(reward, reward_death))
        await poll_until(lambda: recovery.restarts["reward"] == 1, 10, "reward's restart")
        rerun.cancel()  # the rewind's _abandon
        rewound = await asyncio.wait_for(recovery.rewind(actor_death, 2, _restore), 10)
        return rewound, sorted(spawns), recovery.restarts, actor_death
    rewound, spawns, restarts, death = asyncio.run(main())
    assert rewound is True and spawns == ["actor", "reward"]
    assert restarts == {"actor": 1, "reward": 1}
    assert not getattr(death, "__notes__", [])


def test_a_spent_budget_is_named_in_the_failure_it_leaves():
    """A run failing because reward's budget was spent reported the actor's death, with
    nothing about reward; a respawn past the budget raised the bare death."""
    async def main():
        spawns: list[str] = []
        reward, reward_death = _group("reward", max_restarts=1)
        actor, actor_death = _group("actor", max_restarts=3, stateful=True)
        recovery = Recovery(_flow([actor, reward], spawns))
        recovery.restarts["reward"] = 1  # spent on an earlier death
        rewound = await asyncio.wait_for(recovery.rewind(actor_death, 2, _restore), 10)
        try:
            await recovery.respawn(reward, reward_death)
            raised = None
        except GroupDeadError as e:
            raised = e
        return rewound, actor_death, raised, reward_death, spawns
    rewound, actor_death, raised, reward_death, spawns = asyncio.run(main())
    assert rewound is False and raised is reward_death and spawns == []
    note = "not recovered: group 'reward' used its 1 restart(s) (max_restarts=1)"
    assert actor_death.__notes__ == [note]
    assert reward_death.__notes__ == [note]


def test_a_spawn_that_fails_while_its_respawn_is_cancelled_counts_a_restart():
    """A re-run's respawn, cancelled by a rewind during its spawn, waited for the spawn, which
    failed; the rewind's respawn, finding the death counted, spawned without counting: the
    failed start-up was not counted as another restart."""
    async def main():
        spawns: list[str] = []
        spawning, release = asyncio.Event(), asyncio.Event()

        async def spawn(spec):
            spawns.append(spec.name)
            if len(spawns) == 1:
                spawning.set()
                await release.wait()
                raise SpawnError("rank 0 never said hello")
            return types.SimpleNamespace(dead=None, closing=False, busy=False)

        spec, dead = _group("reward", max_restarts=3)
        recovery = Recovery(_flow([spec], spawns, spawn))
        rerun = asyncio.ensure_future(recovery.respawn(spec, dead))
        await spawning.wait()
        rerun.cancel()
        await asyncio.sleep(0)
        release.set()
        cancelled = await asyncio.gather(rerun, return_exceptions=True)
        respawned = await asyncio.wait_for(recovery.respawn(spec, dead), 10)
        return cancelled, respawned, spawns, recovery.restarts
    [cancelled], respawned, spawns, restarts = asyncio.run(main())
    assert isinstance(cancelled, asyncio.CancelledError) and respawned is True
    assert spawns == ["reward", "reward"] and restarts == {"reward": 2}


def test_a_hung_group_a_rewind_respawns_is_named_in_its_event():
    """A live group still busy when the rewind's calls had ended was respawned, uncounted,
    without a word: the rewind's event named only the dead."""
    async def main():
        spawns: list[str] = []
        actor, death = _group("actor", max_restarts=3, stateful=True)
        ref, _ = _group("ref", max_restarts=3, dead=False)
        ref.handle.busy = True  # hung in a call
        recovery = Recovery(_flow([actor, ref], spawns))
        rewound = await asyncio.wait_for(recovery.rewind(death, 2, _restore), 10)
        return rewound, recovery.events, recovery.restarts, sorted(spawns)
    rewound, [event], restarts, spawns = asyncio.run(main())
    assert rewound is True and spawns == ["actor", "ref"]
    assert (event.kind, event.groups, event.hung) == ("rewind", ["actor"], ["ref"])
    assert restarts == {"actor": 1, "ref": 0}


def test_a_rerun_that_meets_a_second_groups_death_runs_again():
    """ref and reward (both stateless) died together under a node that calls both: its
    returned future failed with ref's death, ref was respawned, and the re-run, calling the
    dead reward, failed the step (a rewind, or the run's end without a checkpoint)."""
    async def main():
        spawns: list[str] = []
        ref, ref_death = _group("ref", max_restarts=2, dead=False)
        reward, reward_death = _group("reward", max_restarts=2, dead=False)
        recovery = Recovery(_flow([ref, reward], spawns))
        loop = asyncio.get_running_loop()
        futures: list[DistFuture] = []

        def node():
            for spec in (ref, reward):
                called_groups.get().add(spec.name)
                if spec.handle.dead is not None:  # a dead group refuses the call
                    raise spec.handle.dead
            futures.append(DistFuture.held("scored", "ref.logprobs") if futures else
                           DistFuture._new(loop, "ref.logprobs"))
            return futures[-1]

        out = await recovery.call("score", 0, node)
        ref.handle.dead, reward.handle.dead = ref_death, reward_death  # both die, then the
        futures[0]._set_exception(ref_death)  # call sent to ref fails
        return await asyncio.wait_for(out, 10), spawns, recovery.events
    result, spawns, events = asyncio.run(main())
    assert result == "scored" and spawns == ["ref", "reward"]
    assert [(e.kind, e.groups, e.node) for e in events] == \
        [("rerun", ["ref"], "score"), ("rerun", ["reward"], "score")]


def test_a_broken_collective_waits_for_its_own_groups_death_not_the_first_one():
    """ref's rank 0 failed in a collective its dead peer broke while another group's death
    (reward's, not called by the node) was already declared: the wait for a death behind
    the failure ended at reward's, found ref alive, and failed the step instead of re-running
    it once ref's death showed a moment later."""
    async def main():
        spawns: list[str] = []
        ref, ref_death = _group("ref", max_restarts=2, dead=False)
        reward, _ = _group("reward", max_restarts=2)  # dead already
        flow = _flow([ref, reward], spawns)
        flow._ctl.heartbeat_timeout = 5.0  # how long a death may take to show
        recovery = Recovery(flow)
        broken = RemoteError("ref", 0, "logprobs", "DistBackendError", "peer gone", "")
        runs: list[int] = []

        def node():
            runs.append(1)
            called_groups.get().add("ref")
            if len(runs) == 1:  # ref's death is declared a moment after its rank's failure
                asyncio.get_running_loop().call_later(
                    0.2, lambda: setattr(ref.handle, "dead", ref_death))
                raise broken
            return "logprobs"

        return await asyncio.wait_for(recovery.call("ref", 0, node), 10), runs, spawns
    result, runs, spawns = asyncio.run(main())
    assert (result, len(runs), spawns) == ("logprobs", 2, ["ref"])


def test_groups_placed_together_that_die_together_are_placed_again():
    """reward is placed colocate_with(ref); both died. ref's respawn closed it (no longer
    placed) and slept its backoff while reward's respawn spawned: its placement failed with
    "names a group that is not placed yet", and the run ended."""
    async def main():
        placer = Placer(Host(0, (0, 1, 2, 3)))
        ref, ref_death = _group("ref", max_restarts=2)
        reward, reward_death = _group("reward", max_restarts=2)
        ref.restart_backoff, reward.place = 0.3, colocate_with("ref")
        placer.place("ref", 2, None)
        placer.place("reward", 2, reward.place)
        placer.place("other", 2, None)  # ref goes back to its cores, reward with it
        first = placer.placed["ref"]

        async def spawn(spec):
            placer.place(spec.name, 2, spec.place)
            return types.SimpleNamespace(dead=None, closing=False, busy=False, name=spec.name)

        ref.handle.name, reward.handle.name = "ref", "reward"
        flow = _flow([ref, reward], [], spawn)

        async def close_group(handle):
            handle.closing = True
            placer.forget(handle.name)
        flow._ctl.close_group = close_group
        recovery = Recovery(flow)
        both = asyncio.gather(recovery.respawn(ref, ref_death),
                              recovery.respawn(reward, reward_death))
        return await asyncio.wait_for(both, 10), first, placer.placed
    respawned, first, placed = asyncio.run(main())
    assert respawned == [True, True]
    assert placed["ref"] == placed["reward"] == first


def test_a_node_passing_an_upstream_future_on_is_re_run_after_a_death():
    """`return {"rollout": rollout, "score": reward.score(rollout)}`: the rollout it was
    given got a stand-in too, done at once, and a done stand-in stopped the re-run after
    reward's death: the flow went back to its last checkpoint (or step 0) instead."""
    async def main():
        spawns: list[str] = []
        reward, death = _group("reward", max_restarts=1, dead=False)
        recovery = Recovery(_flow([reward], spawns))
        rollout = DistFuture.held("rows", "rollouts.generate")
        runs: list[DistFuture] = []

        def node(rollout):
            called_groups.get().add("reward")
            runs.append(DistFuture.held("scores", "reward.score") if runs else
                        DistFuture._new(asyncio.get_running_loop(), "reward.score"))
            return {"rollout": rollout, "score": runs[-1]}

        given = {"rollout": rollout}
        out = await recovery.call("score", 0, lambda: node(**given), given)
        reward.handle.dead = death
        runs[0]._set_exception(death)
        return out, await asyncio.wait_for(out["score"], 10), len(runs), spawns, rollout
    out, score, runs, spawns, rollout = asyncio.run(main())
    assert (score, runs, spawns) == ("scores", 2, ["reward"])
    assert out["rollout"] is rollout  # passed on as given
