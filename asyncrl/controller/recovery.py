"""Recovery: what a DataFlow does when a group dies while it runs.

    a stateless group died (reward fn,        respawn it; re-run the node whose call failed,
    reference) under a node's call            once its inputs are done, with the same ones
                                              (their producers still hold them); the step
                                              goes on, nothing else moves
    anything else: a stateful group died      drop the steps in flight, let the live groups'
    (actor, critic, rollout), or a call       calls end, respawn the dead groups, load the last
    lost an input a dead group held           checkpoint into every group, run again from the
                                              step after it (its metrics rows are rewritten)
    stateless groups died in a checkpoint's   respawn them, make the save again
    save (their random state is saved too)

A group is stateful when its worker class overrides `save_state`. Each group restarts at
most `max_restarts` times over a run (`asyncrl.group(..., max_restarts=3)`), after waiting
`restart_backoff` seconds, doubled on each restart up to a minute. Downstream nodes never
see a failure that a re-run repaired: what a node returns reaches them through stand-in
futures that follow the re-runs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.actors.worker import set_rng_state
from asyncrl.compat import add_note
from asyncrl.controller.finished import death_of
from asyncrl.controller.logs import append_line, replace_json, say
from asyncrl.controller.placement import constraints_of
from asyncrl.controller.timeline import called_groups
from asyncrl.errors import (
    ClosedError,
    GroupDeadError,
    InputLostError,
    RecoveryError,
    RemoteError,
    SpawnError,
)
from asyncrl.futures.future import DistFuture, Rows, futures_in, rebuild

if TYPE_CHECKING:
    from asyncrl.controller.declare import GroupSpec
    from asyncrl.controller.flow import DataFlow

MAX_BACKOFF = 60.0
_NO_DEATH = "_asyncrl_no_death_behind"  # on a failure: waited for a death behind it, none


@dataclass
class RecoveryEvent:
    """One recovery, as written to RUN_DIR/recoveries.jsonl."""

    kind: str  # "rerun": one node ran again | "rewind": the flow went back to a checkpoint
    # | "resave": a checkpoint's save was made again
    groups: list[str]  # the groups respawned
    step: int  # the step that failed
    node: str | None  # the node re-run ("rerun" only)
    resumed_at: int | None  # the first step run again ("rewind" only)
    cause: str
    seconds: float  # from noticing the failure until the flow could go on
    hung: list[str] = field(default_factory=list)  # live groups respawned as hung ("rewind")


RESTARTS_FILE = "restarts.json"  # beside recoveries.jsonl: each group's restarts so far


class Recovery:
    """One DataFlow's restart budget and its two ways back (see the module docstring)."""

    def __init__(self, flow: DataFlow):
        self.flow = flow
        self.restarts: dict[str, int] = {g.name: 0 for g in flow.groups}
        self.events: list[RecoveryEvent] = []
        self.log_path: Path | None = None  # set: each recovery is appended there as JSON
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task] = set()  # closes and spawns a cancel cannot stop
        self._counted: dict[str, Any] = {}  # group -> the dead handle its last restart counted
        self._stopped = False  # the run stops: closes and spawns are cancelled, not waited for
        self._driver: asyncio.Task | None = None  # the task that opened the flow (the driver's)

    def start(self) -> None:
        """The flow opens (in the driver's task): a cancel of that task stops a respawn in it
        (a rewind's, a resume's load) at once; a node's re-run's still waits (see _unstoppable)."""
        self._stopped, self._driver = False, asyncio.current_task()

    def stop(self) -> None:
        """The run stops (its flow closes): closes and spawns under way are cancelled, not
        waited for (up to startup_timeout + construct_timeout): a spawn undoes itself (bounded),
        a close goes on and the flow's close waits for it."""
        self._stopped = True
        for task in self._background:
            task.cancel()

    def resume_counts(self, saved: dict[str, int]) -> None:
        """A resumed run's restarts so far: those written as they happened (beside
        `log_path`) or its checkpoint's, `saved`, the larger; so that a crash that recurs at
        each resume spends the budget instead of looping under a requeue."""
        counts = dict(saved)
        written = self.log_path.with_name(RESTARTS_FILE) if self.log_path else None
        if written is not None and written.is_file():
            for name, n in json.loads(written.read_text()).items():
                counts[name] = max(int(n), int(counts.get(name, 0)))
        for name, count in counts.items():
            if name in self.restarts:
                self.restarts[name] = int(count)
        spent = {n: c for n, c in self.restarts.items() if c}
        if spent:
            say(self.flow._ctl, f"asyncrl: restarts so far in this run (the budget is the "
                                f"run's): {spent}")

    @property
    def enabled(self) -> bool:
        return any(g.max_restarts > 0 for g in self.flow.groups)

    def _spec(self, name: str) -> GroupSpec | None:
        return next((g for g in self.flow.groups if g.name == name), None)

    def _left(self, spec: GroupSpec) -> bool:
        return self.restarts[spec.name] < spec.max_restarts

    def _restartable(self, spec: GroupSpec) -> bool:
        """Whether `spec` may come back: a restart left, or its current death already counted
        (a respawn of it is under way: its backoff, its spawn)."""
        return self._left(spec) or (spec.handle is not None
                                    and self._counted.get(spec.name) is spec.handle)

    def _spent(self, exc: BaseException, groups: list[GroupSpec]) -> None:
        """Note on `exc` (and say) each of `groups` whose restart budget stops a recovery."""
        for spec in groups:
            if self._restartable(spec):
                continue
            note = (f"not recovered: group {spec.name!r} used its {self.restarts[spec.name]} "
                    f"restart(s) (max_restarts={spec.max_restarts})")
            if note not in getattr(exc, "__notes__", ()):
                add_note(exc, note)
                say(self.flow._ctl, f"[asyncrl] {note}")

    def rerunnable(self, exc: BaseException, called: set[str]) -> GroupSpec | None:
        """The stateless group whose death `exc` reports, if the node called it (a death it
        only awaited, an upstream node's, a re-run would meet again), it may restart, and the
        node called no group that keeps state (a re-run repeats every call: an update twice)."""
        if not isinstance(exc, GroupDeadError) or exc.group not in called:
            return None
        spec = self._spec(exc.group)
        if spec is None or spec.stateful or not self._restartable(spec) or \
                self._stateful(called):
            return None
        return spec

    def _stateful(self, called: set[str]) -> bool:
        return any(s is not None and s.stateful for s in map(self._spec, called))

    async def respawn(self, spec: GroupSpec, cause: BaseException, count: bool = True) -> bool:
        """Replace `spec`'s group by a fresh one; False when a dead one had already been
        replaced (several calls saw the same death). Raises `cause` when the budget is spent
        (or the respawn's own failure, once it is). A respawn that fails to start is another
        restart. count=False: a live group that has to go (hung), not counted.

        Until its replacement is up the old handle stays: calls to it raise its death (which
        their nodes recover from), not "not running". Closing and spawning go on if the
        caller is cancelled (a rewind), so no group is left half closed or unowned; not if
        the run stops (_unstoppable)."""
        if self.flow._ctl is None:  # the flow has closed: nothing to bring back
            raise cause
        lock = self._locks.setdefault(spec.name, asyncio.Lock())
        async with lock:
            old = spec.handle
            if count and old is not None and old.dead is None and not old.closing:
                return False
            if old is not None:
                await self._unstoppable(self.flow._ctl.close_group(old))
            # a death counts once: a caller cancelled in the backoff (a rewind's) had counted
            # it, and the next caller, finding the same handle dead, spawns without counting
            # (the rest of the backoff is skipped: the rewind waited for its calls to end)
            counted = count and old is not None and self._counted.get(spec.name) is old
            while True:
                if count and not counted:
                    await self._count(spec, cause, old)
                counted = False
                await self._placed_again(spec)
                try:
                    await self._unstoppable(self._spawn_into(spec))
                    return True
                except (SpawnError, RemoteError) as e:  # (RemoteError: its __init__ raised,
                    cause, count = e, True  # an OOM beside a colocated group, a file hiccup)
                except asyncio.CancelledError:  # the spawn failed meanwhile: its failure is a
                    if spec.handle is old:  # restart the next respawn counts
                        self._counted.pop(spec.name, None)
                    raise

    async def _placed_again(self, spec: GroupSpec) -> None:
        """Wait for the respawns under way of the groups `spec` is placed with respect to
        (colocate_with(g), separate_from(g)): while one is closed and not yet back, `spec`
        cannot be placed ("names a group that is not placed yet"). Those were placed before
        it: their respawns never wait for `spec`'s."""
        for c in constraints_of(spec.place):
            lock = self._locks.get(c.target) if c.target is not None else None
            if lock is not None and lock.locked():
                async with lock:
                    pass

    async def _spawn_into(self, spec: GroupSpec) -> None:
        spec.handle = await self.flow._spawn(spec)

    async def _unstoppable(self, work: Awaitable[Any]) -> Any:
        """`work`, carried on if the caller is cancelled; the cancelled caller still waits for
        it (and so keeps the group's lock): a rewind that took the lock at once would find
        the group half closed, or spawn it a second time beside the one still starting.
        Cancelled with its caller when the run stops: stop(), or the driver's task cancelled
        (SIGTERM, Ctrl-C: no rewind follows, and a spawn can take minutes)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self._background.discard)
        if self._stopped:
            task.cancel()
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if asyncio.current_task() is self._driver and not self._stopped:
                task.cancel()  # (once: Controller.spawn's undo runs to its end)
            while not task.done():
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:
                    continue  # bounded: a spawn ends by its start-up timeouts (or stop())
            raise

    async def finish(self) -> None:
        """Wait for closes and spawns that went on after a cancel (before the flow closes)."""
        await asyncio.gather(*self._background, return_exceptions=True)

    async def _count(self, spec: GroupSpec, cause: BaseException, dead: Any = None) -> None:
        """One restart of `spec` against its budget (for its `dead` handle), after its
        backoff."""
        if not self._left(spec):
            self._counted.pop(spec.name, None)  # a respawn after this one counts (and fails)
            self._spent(cause, [spec])
            raise cause
        self.restarts[spec.name] += 1
        self._counted[spec.name] = dead
        n = self.restarts[spec.name]
        if self.log_path is not None:  # as they happen: a resume goes on from them (a
            # checkpoint's count misses those after it, which a crash loop repeats)
            replace_json(self.log_path.with_name(RESTARTS_FILE), self.restarts)
        delay = min(spec.restart_backoff * 2 ** (n - 1), MAX_BACKOFF)
        say(self.flow._ctl, f"[asyncrl] restarting group {spec.name!r} ({n}/"
                            f"{spec.max_restarts}) in {delay:g} s: {_first_line(cause)}")
        await asyncio.sleep(delay)

    # -- re-running a node -------------------------------------------------------------------
    async def call(self, node: str, step: int, fn: Callable[[], Any], given: Any = None) -> Any:
        """`fn()` (a node's function with its inputs, `given`, bound), re-run after each
        death of a stateless group it called (an async node's await may meet it first as a
        peer's broken collective); with restarts on, what it returns is guarded."""
        inputs = futures_in(given)
        out, called = await self._run(node, step, fn, inputs)
        if not self.enabled:
            return out
        return self._guard(node, step, out, fn, called, inputs)

    async def _run(self, node: str, step: int, fn: Callable[[], Any],
                   inputs: list[DistFuture]) -> tuple[Any, set[str]]:
        """What `fn()` returns, re-run while a death of a stateless group it called explains
        its failure; and the groups its last attempt called."""
        seen: list[BaseException] = []
        while True:
            called: set[str] = set()
            try:
                return await _attempt(fn, called), called
            except Exception as e:
                spec = self.rerunnable(e, called)
                if spec is None and isinstance(e, RemoteError):  # a peer's death fails a
                    # collective before the death is declared: wait for it to show
                    spec = await self._died(f"{e.group}.{e.method}", called, e)
                if spec is None or any(e is s for s in seen):  # the same failure again: a
                    raise  # re-run does not reach what failed
                seen.append(e)
                await self._respawned_for(node, step, spec, e, inputs)

    async def _respawned_for(self, node: str, step: int, spec: GroupSpec,
                             cause: BaseException, inputs: list[DistFuture]) -> None:
        """`spec` respawned (unless another caller already did) for `node`'s re-run, and the
        re-run recorded; then its `inputs` done. The death may re-run an upstream node too,
        in any order: a call on its stand-in queued first on the respawned group would hold
        back the upstream re-run's calls behind it, waiting for them for ever."""
        started = time.monotonic()
        respawned = await self.respawn(spec, cause)
        self._record("rerun", [spec.name] if respawned else [], step, node, None, cause,
                     started)
        pending = [f._fut for f in inputs if not f.done()]
        if pending:  # (a cancel, a rewind's, leaves them be)
            await asyncio.wait(pending)

    def _guard(self, node: str, step: int, out: Any, fn: Callable[[], Any],
               called: set[str], given: list[DistFuture]) -> Any:
        """`out` with a stand-in for each future the node's own calls returned; one it was
        given (an upstream node's, passed on) is its own (a re-run returns it again, done:
        its stand-in's result would stop the re-run)."""
        inner = _unique_futures(out, given)
        if not inner:
            return out
        loop = asyncio.get_running_loop()
        proxies = {id(f): DistFuture._new(loop, f._label) for f in inner}
        watcher = loop.create_task(self._follow(node, step, inner, list(proxies.values()), fn,
                                                called, given))
        self.flow._watchers.add(watcher)
        watcher.add_done_callback(self.flow._watchers.discard)
        if step in self.flow._steps:  # cancelled with its step, if that fails: a re-run
            self.flow._steps[step].watchers.append(watcher)  # would spend a restart on it
        watcher.add_done_callback(_settled)  # its failure reaches the stand-ins
        return _replace(out, proxies)

    async def _follow(self, node: str, step: int, inner: list[DistFuture],
                      proxies: list[DistFuture], fn: Callable[[], Any], called: set[str],
                      given: list[DistFuture]) -> None:
        """Pass each inner future's result on to its stand-in; on a death a re-run repairs,
        re-run and follow the new futures. Stand-ins left unresolved fail with the cause.
        Not re-run once some stand-in has a result: the re-run's would not match it (new
        samples scored beside the old ones); a rewind is left to repair it."""
        failure: BaseException = ClosedError(f"node {node!r} of step {step} was abandoned")
        seen: list[BaseException] = []
        try:
            while True:
                forwards = [(f._fut, functools.partial(_forward, proxy=p, inner=f))
                            for p, f in zip(proxies, inner, strict=True)]
                for fut, forward in forwards:
                    fut.add_done_callback(forward)
                await asyncio.wait([f._fut for f in inner], return_when=asyncio.FIRST_EXCEPTION)
                failed = [f for f in inner
                          if f._fut.done() and not f._fut.cancelled() and f._fut.exception()]
                if failed:  # (what the stand-ins left fail with, whatever comes next)
                    failure = failed[0]._fut.exception()  # type: ignore[assignment]
                if not failed or any(p.done() for p in proxies):
                    return
                for fut, forward in forwards:  # what this attempt still returns is not the
                    fut.remove_done_callback(forward)  # re-run's
                spec = self.rerunnable(failure, called) or await self._died(failed[0]._label,
                                                                            called, failure)
                if spec is None or any(failure is s for s in seen):  # the same failure
                    return  # again (an upstream future it returns): a re-run cannot repair it
                seen.append(failure)
                await self._respawned_for(node, step, spec, failure, given)
                # (another group it calls may have died too: re-run again, not rewound)
                out, called = await self._run(node, step, fn, given)
                inner = _unique_futures(out, given)
                if len(inner) != len(proxies):
                    failure = RecoveryError(f"node {node!r} returned {len(inner)} futures when "
                                            f"re-run, {len(proxies)} the first time")
                    return
        except BaseException as e:  # a restart that failed, or cancelled by a rewind
            if not isinstance(e, asyncio.CancelledError):
                failure = e
            raise
        finally:
            for p in proxies:
                p._set_exception(failure)  # no-op for those already resolved

    async def _died(self, label: str, called: set[str], exc: BaseException
                    ) -> GroupSpec | None:
        """The stateless group that ran `label` ("group.method"), if it turns out dead: a rank
        whose peer died fails the call before the death is declared. `exc`, the failure, is
        marked when no death showed: a rewind after it does not wait again."""
        spec = self._spec(label.rpartition(".")[0])  # group names may hold dots
        if spec is None or spec.name not in called or spec.stateful or \
                not self._restartable(spec) or self._stateful(called):
            return None
        death = death_of(exc)  # declared already: the group may be back since (a late await)
        if death is not None and death.group == spec.name:
            return spec
        dead = await self.dead_groups(of=spec)  # (another group's death may show first)
        if not dead:
            setattr(exc, _NO_DEATH, True)
        return spec if spec in dead else None

    # -- rewinding to a checkpoint -----------------------------------------------------------
    async def rewind(self, exc: BaseException, step: int,
                     restore: Callable[[], Awaitable[bool]] | None) -> bool:
        """Bring the flow back to its last checkpoint after `exc`, when a group's death
        explains it (one dead now, or one a re-run has brought back: an input it held is
        gone) and every dead group may restart; False when it does not (`exc` stands)."""
        flow, ctl = self.flow, self.flow._ctl
        started = time.monotonic()
        # an input lost with a dead group, or its death, is explained even when a node's
        # re-run has respawned that group meanwhile (nothing is dead now); only then: the
        # same loss again after this rewind would not be repaired by another
        repaired = _death_behind(exc) and self._respawned_since_rewind()
        # a user code's error a node's call already waited for a death behind: reported now
        waited = any(getattr(e, _NO_DEATH, False) for e in _chain(exc))
        dead = await self.dead_groups(wait=not (repaired or waited))
        if not (dead or repaired) or not all(self._restartable(g) for g in dead):
            self._spent(exc, dead)
            return False
        fresh = restore is None
        if fresh and (flow._origin[0] != 0):  # no checkpoint to go back to, and the groups
            add_note(exc, f"not recovered: no checkpoint to go back to, and this run started "
                          f"at step {flow._origin[0]}, not 0")  # are not at step 0
            return False
        flow.feed.check_rereadable()  # before any group is touched
        await flow._abandon()
        # a call pulling from a dead rank ends when its rank hears of the death (at worst
        # at its transfer timeout); one that outlasts that is hung: its group goes too (not
        # counted against its restarts)
        busy = await self._settle(ctl.transfer_timeout + ctl.heartbeat_timeout)
        dead += [g for g in self.flow.groups if g not in dead and (
            g.handle is None or g.handle.dead is not None)]  # died while the calls ended
        stuck = [g for g in busy if g not in dead]
        for spec in dead:
            await self.respawn(spec, exc)
        for spec in stuck:
            say(ctl, f"[asyncrl] group {spec.name!r} still busy after the calls ended (hung): "
                     f"respawning it (not counted)")
            await self.respawn(spec, exc, count=False)
        flow._reset_sources()
        loaded = await self.restored(restore, dead) if restore is not None else False
        if not loaded and flow._origin[0] != 0:
            raise RecoveryError(f"no checkpoint to go back to after {type(exc).__name__}, and "
                                f"this run started at step {flow._origin[0]}, not 0: its "
                                f"groups' state before that step is gone")
        if not loaded:  # before the first checkpoint: back to the run's start, every group
            for spec in flow.groups:  # as built (random number generators too); as the dead
                if spec not in dead + stuck:  # ones (a cancel leaves none half closed)
                    await self.respawn(spec, exc, count=False)
            set_rng_state(flow._origin_rng)  # nodes that draw random numbers draw them again
            flow.resume_at(*flow._origin, rewind=True)
        resumed = flow.next_step
        self._record("rewind", [g.name for g in dead], step, None, resumed, exc, started,
                     [g.name for g in stuck])
        say(flow._ctl, f"[asyncrl] rewound to step {resumed} after: {_first_line(exc)}")
        return True

    async def restored(self, restore: Callable[[], Awaitable[Any]],
                       dead: list[GroupSpec] | None = None) -> Any:
        """`restore()` (a checkpoint's load), done again after the groups that died in it
        (out of memory again, say) are respawned, counted, while their restarts last; those
        are added to `dead`."""
        while True:
            try:
                return await restore()
            except Exception as again:  # noqa: BLE001 - a death: respawned; else it stands
                died = await self.dead_groups(wait=False)  # (restore waited for it to show)
                if not died or not all(self._restartable(g) for g in died):
                    self._spent(again, died)
                    raise
                for spec in died:
                    await self.respawn(spec, again)
                if dead is not None:
                    dead += [g for g in died if g not in dead]

    async def resave(self, exc: BaseException, step: int) -> bool:
        """A checkpoint's save that stateless groups died in (a reward function's or a
        reference's rank: they save their random state too): respawn them, counted, for the
        save to be made again once the live groups' saves have ended; False when that does
        not explain `exc` (a stateful group died, the budget is spent: a rewind's turn)."""
        ctl, started = self.flow._ctl, time.monotonic()
        dead = await self.dead_groups() if _death_behind(exc) else []
        if not dead or any(g.stateful or not self._restartable(g) for g in dead):
            return False
        if await self._settle(ctl.transfer_timeout + ctl.heartbeat_timeout):
            return False  # a live group's save still runs into the folder a save removes
        for spec in dead:
            await self.respawn(spec, exc)
        self._record("resave", [g.name for g in dead], step, None, None, exc, started)
        return True

    def _respawned_since_rewind(self) -> bool:
        """Whether a re-run respawned a group since the last rewind (or the run's start)."""
        for event in reversed(self.events):
            if event.kind == "rewind":
                return False
            if event.groups:
                return True
        return False

    async def dead_groups(self, wait: bool = True, of: GroupSpec | None = None
                          ) -> list[GroupSpec]:
        """The flow's dead groups. A failure can reach us before the supervisor declares the
        death behind it (a peer's collective broke): wait as long as declaring takes for one
        to show (`of`'s, when given). A failure with no death behind it (a bug in user code)
        is reported that much later. wait=False: those dead now."""
        ctl = self.flow._ctl
        deadline = time.monotonic() + ctl.heartbeat_timeout + 2 * ctl.heartbeat_interval
        while True:
            dead = [g for g in self.flow.groups
                    if g.handle is None or g.handle.dead is not None]
            if (of in dead if of is not None else dead) or not wait or \
                    time.monotonic() > deadline:
                return dead
            await asyncio.sleep(ctl.heartbeat_interval / 4)

    async def _settle(self, timeout: float) -> list[GroupSpec]:
        """Wait until no live group has calls pending; the groups still busy at `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [g for g in self.flow.groups if g.handle is not None
                    and g.handle.dead is None and g.handle.busy]
            if not busy or time.monotonic() > deadline:
                return busy
            await asyncio.sleep(0.02)

    def _record(self, kind: str, groups: list[str], step: int, node: str | None,
                resumed: int | None, cause: BaseException, started: float,
                hung: list[str] | None = None) -> None:
        event = RecoveryEvent(kind, groups, step, node, resumed,
                              f"{type(cause).__name__}: {_first_line(cause)}",
                              round(time.monotonic() - started, 3), hung or [])
        self.events.append(event)
        if self.log_path is not None:  # one write of a whole line: a reader sees it whole
            append_line(self.log_path, json.dumps(asdict(event)))


async def _attempt(fn: Callable[[], Any], called: set[str]) -> Any:
    """fn() (awaited if it is a coroutine), noting in `called` every group it calls."""
    called_groups.set(called)
    out = fn()
    return await out if asyncio.iscoroutine(out) else out


def _death_behind(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a group's death, a call it broke, or an input
    lost with one: declared deaths, which a rewind recovers from whether or not the group is
    back."""
    return any(death_of(e) is not None or isinstance(e, InputLostError) for e in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what caused it, in turn."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _unique_futures(out: Any, given: list[DistFuture]) -> list[DistFuture]:
    """The futures in `out`, each once, but those in `given`."""
    ids = {id(f) for f in given}
    return list({id(f): f for f in futures_in(out) if id(f) not in ids}.values())


def _settled(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: its awaiter may have been cancelled


def _forward(done: asyncio.Future, proxy: DistFuture, inner: DistFuture) -> None:
    if not done.cancelled() and done.exception() is None:
        proxy.busy_s = inner.busy_s
        proxy._set_result(done.result())


def _replace(out: Any, proxies: dict[int, DistFuture]) -> Any:
    if isinstance(out, DistFuture):  # (one the node was given stays)
        return proxies.get(id(out), out)
    if isinstance(out, Rows):
        return Rows([(proxies.get(id(f), f), picked) for f, picked in out.parts])
    if isinstance(out, list | tuple):
        return rebuild(out, [_replace(x, proxies) for x in out])
    if isinstance(out, dict):
        return {k: _replace(v, proxies) for k, v in out.items()}
    return out
