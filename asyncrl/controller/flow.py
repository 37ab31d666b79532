"""DataFlow: an RL pipeline declared as nodes, run step after step.

    step t:  inputs ──▶ rollout ──▶ score ──▶ train        a node starts when the nodes it
                          └──────▶ ref ───────┘             names have *returned* (their
    step t+1: dispatched once train of step t-k has         futures may still be running), so
              finished (rollout follows="train";            a step is dispatched at once
              k = max_staleness) and all of step t-k-1 (a bound on steps in flight)
    checkpoint after step t: steps <= t all finish, the save runs, then step t+1 is dispatched

A node is a small controller-side function; its parameters name its inputs (flow inputs,
other nodes, or `<node>_out`, and `step`: the step index, unless a node or an input has that
name). What it receives is exactly what the upstream node returned. Step t+1 is
dispatched once every node of step t has returned: an async node that awaits its group's
work holds it until that work is done (a plain node returning the DistFuture does not).
A node has *finished* once its returned futures and every group call it made are done, and
failed if one of those failed, returned or not (finished.py); the graph is resolved and
checked in flow_graph.py.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.actors.worker import rng_state
from asyncrl.compat import cancel, cancelling
from asyncrl.controller.blame import blame, upstream
from asyncrl.controller.declare import GroupSpec, declared_for
from asyncrl.controller.finished import Calls, dispatched, finished, node_calls, quiet, shielded
from asyncrl.controller.flow_graph import count, named_nodes, resolve, topological
from asyncrl.controller.inputs import Inputs
from asyncrl.controller.logs import say
from asyncrl.controller.nodes import FlowError, Node, NodeError
from asyncrl.controller.recovery import Recovery
from asyncrl.controller.saved_inputs import save_node_inputs
from asyncrl.controller.timeline import current_node
from asyncrl.errors import InputsExhausted
from asyncrl.futures.future import held_at, resolved

log = logging.getLogger("asyncrl")


@dataclass
class _Step:
    index: int
    returned: dict[str, asyncio.Task] = field(default_factory=dict)
    finished: dict[str, asyncio.Task] = field(default_factory=dict)
    watchers: list[asyncio.Task] = field(default_factory=list)  # recovery's, of its nodes
    calls: dict[str, Calls] = field(default_factory=dict)  # by node: the group calls it made
    started: float = 0.0  # dispatched (ahead: up to max_staleness + 2 steps in flight)
    ended: float = 0.0  # its last node finished

    def _finish(self, _: asyncio.Task) -> None:
        self.ended = max(self.ended, time.perf_counter())


class DataFlow:
    """``DataFlow(nodes=[...], inputs={"prompts": source}, max_staleness=0)``.

    A source is an iterable (one item per step; the run ends when it is exhausted) or a
    constant; one with ``state_dict()`` / ``load_state_dict()`` (a PromptSource) is resumed
    from its saved position, any other iterable by skipping the items it had yielded.
    `checkpoint_every`: checkpoint after every that many steps (and always after the last).
    The graph is checked here, before anything launches."""

    def __init__(self, nodes: list[Any], inputs: dict[str, Any] | None = None,
                 max_staleness: int = 0, groups: list[GroupSpec] | None = None,
                 checkpoint_every: int | None = None, steps: int | None = None):
        self.inputs = dict(inputs or {})
        self.nodes = named_nodes(nodes, self.inputs)
        if not count(max_staleness, 0):
            raise FlowError(f"max_staleness must be an int >= 0 (0 with follows=: on-policy, "
                            f"each rollout waits for the train step before it), got "
                            f"{max_staleness!r}")
        self.max_staleness = max_staleness
        if checkpoint_every is not None and not count(checkpoint_every, 1):
            raise FlowError(f"checkpoint_every must be an int >= 1 (or None: only after the "
                            f"last step), got {checkpoint_every!r}")
        self.checkpoint_every = checkpoint_every
        # --checkpoint-every and --keep-checkpoints as `asyncrl launch` was given them (noted
        # in checkpoints: a resume goes on with them)
        self.launch_options: dict[str, Any] = {}
        if steps is not None and not count(steps, 1):
            raise FlowError(f"steps must be an int >= 1 (or None: until an input runs out), "
                            f"got {steps!r}")
        self.steps = steps  # what run() and `asyncrl launch` run when not told
        self.deps = {name: resolve(n, self.nodes, self.inputs) for name, n in self.nodes.items()}
        self.order = topological(self.deps)
        self.groups = list(groups) if groups is not None else \
            declared_for(n.fn for n in self.nodes.values())
        self.feed = Inputs(self.inputs)  # one item a step from each, and their positions
        self._last_end = 0.0  # when the last step given to on_step finished
        # by index: the steps in flight and the last finished ones a later step waits on
        # (older ones are let go, and with them the futures their nodes returned)
        self._steps: dict[int, _Step] = {}
        self._failed: int | None = None  # a step that failed: no step after it can run
        self._told = False  # step() or run() raised a NodeError: the driver knows
        self._stepping = False  # a step() runs: a second one at once is refused
        self._earlier: Callable[[Exception], Awaitable[None]] | None = None  # _finish_earlier
        self._next = 0  # the index of the step dispatched next (> 0 once resumed)
        self._ctl: Any = None
        self._own_ctl = False
        self.save_inputs: Path | None = None  # set: each node's inputs are written there
        self._watchers: set[asyncio.Task] = set()  # recovery tasks following node outputs
        self._origin: tuple[int, dict[str, Any]] = (0, {})  # where this run started
        self._origin_rng: dict[str, Any] = {}  # and the controller's random state there
        self.recovery = Recovery(self)

    # -- groups -------------------------------------------------------------------------------
    async def open(self, ctl: Any = None) -> None:
        """Spawn the flow's groups on `ctl` (the running Controller; one is opened if none)."""
        from asyncrl.controller.controller import Controller

        if self._ctl is not None:  # (a second open's failure would close the first's groups)
            raise FlowError("this DataFlow is open already: close it first (or use "
                            "`async with flow:` once)")
        self.recovery.start()  # (this task is the driver's: its cancel stops a respawn)
        if ctl is None:
            ctl = Controller.current()
        if ctl is None:
            ctl = Controller()
            await ctl.start()
            self._own_ctl = True
        self._ctl = ctl
        try:
            await self._open(ctl)
        except BaseException:  # nothing left running, and the flow not half open
            try:
                await self.close()
            except Exception:  # the open's failure is the one to say
                log.exception("asyncrl: closing a flow that failed to open failed too")
            raise

    async def _open(self, ctl: Any) -> None:
        k, names = self.max_staleness, list(self.nodes)  # (said here, not in each process
        if k and not any(n.follows for n in self.nodes.values()):  # importing the flow file)
            log.warning(f"asyncrl: max_staleness={k} bounds follows= edges, and no node of "
                        f"this flow has one: steps overlap up to {k + 1} apart; give the node "
                        f"that must wait for another follows= (a rollout's: follows=\"train\"; "
                        f"this flow's nodes: {names}; only the in-flight bound holds a step back)")
        # (no timeline of its own: `asyncrl launch` gives the controller one, which writes
        # each checkpoint's steps out; one here kept every event of a run, read by nothing)
        names = [g.name for g in self.groups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise FlowError(f"two groups are named {dup}; pass name=... to asyncrl.group")
        # every group placed on paper first: an impossible one fails before any starts (the
        # others would otherwise load their models before the failure is reported)
        ctl.check_placements([(g.name, g.nprocs, g.place) for g in self.groups])
        if self.recovery.enabled:  # a rewind reads the inputs again: refused before the
            self.feed.check_rereadable()  # groups load their models, not at the first rewind
        # started together: one group's start-up waits overlap the others' work. Placement
        # still sees the groups before each one: spawn places a group before its first await.
        spawned = await asyncio.gather(*(self._spawn(g) for g in self.groups),
                                       return_exceptions=True)
        for g, handle in zip(self.groups, spawned, strict=True):
            if not isinstance(handle, BaseException):
                g.handle = handle  # closed with the flow, as every group that started
        failed = [e for e in spawned if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        self.feed = Inputs(self.inputs)
        self._reset_sources()

    async def _spawn(self, g: GroupSpec) -> Any:
        return await self._ctl.spawn(g.worker_cls, *g.args, nprocs=g.nprocs, name=g.name,
                                     mesh=g.mesh, place=g.place, env=g.env, nice=g.nice, **g.kwargs)

    def _reset_sources(self) -> None:
        """Every input from its beginning again, and no step run (a rewind starts here)."""
        self.feed.reset()
        self._steps, self._next, self._failed, self._told = {}, 0, None, False

    @property
    def ended(self) -> str | None:
        """The input whose end ended the run, if one did (or the node whose own inputs ran out)."""
        return self.feed.ended

    async def _abandon(self) -> None:
        """Cancel the steps in flight and what follows their outputs (a rewind)."""
        tasks = [t for s in self._steps.values()
                 for t in (*s.returned.values(), *s.finished.values())]
        tasks += list(self._watchers)
        for task in tasks:
            cancel(task)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close the groups this flow spawned (and its own Controller, if it opened one),
        after cancelling what still runs for it (steps, recoveries, respawns); closed even if
        this is cancelled while it waits for those (a second Ctrl-C or SIGTERM)."""
        self.recovery.stop()  # a respawn under way is cancelled, not waited for (minutes)
        ctl, own = self._ctl, self._own_ctl
        failed: list[BaseException] = []
        try:
            await self._abandon()
            await self.recovery.finish()
        finally:  # every group closed, and the controller, if one fails (or is cancelled)
            try:
                if ctl is not None:  # (shielded, as Controller.close stops its groups)
                    failed = await asyncio.shield(self._close_groups(ctl))
            finally:  # (closed, if not cleanly: it can be opened again)
                self._ctl, self._own_ctl = None, False
                self.feed.release()  # (a DataLoader's workers end here, not with the flow)
                if own and ctl is not None:
                    await ctl.close()
        if failed:
            raise failed[0]

    async def _close_groups(self, ctl: Any) -> list[BaseException]:
        """Close every group of the flow on `ctl`: the failures."""
        handles = [g.handle for g in self.groups if g.handle is not None]
        closed = await asyncio.gather(*(ctl.close_group(h) for h in handles),
                                      return_exceptions=True)
        for g in self.groups:
            g.handle = None
        return [e for e in closed if isinstance(e, BaseException)]

    async def __aenter__(self) -> DataFlow:
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """Left cleanly: the steps in flight finish first (their nodes' un-returned group calls
        too), as flow.run()'s do; the first to fail raises, unless step()/run() raised one."""
        steps = [self._steps[t] for t in sorted(self._steps)] if exc[0] is None else []
        try:
            await self._let_finish(steps, lambda span, bound: f"[asyncrl] leaving `async with "
                                   f"flow:`: letting step(s) {span} finish (within {bound:g} s)")
        finally:
            await self.close()
        failed = (e for s in steps for t in s.finished.values()
                  if t.done() and not t.cancelled() and (e := t.exception()) is not None)
        if not self._told and (first := next(failed, None)):
            raise first

    # -- positions, for checkpoints ----------------------------------------------------------
    def positions(self) -> dict[str, Any]:
        """Where each iterable input is (`Inputs.positions`)."""
        return self.feed.positions()

    def resume_at(self, start: int, positions: dict[str, Any], rewind: bool = False) -> None:
        """Continue at step index `start` with the inputs where `positions()` said they were
        (the flow is open and has run no step yet; `rewind`: a recovery within the run)."""
        if self._ctl is None or self._steps:
            raise RuntimeError("resume_at() goes after open() and before the first step")
        self.feed.resume_at(start, positions, rewind)
        self._next = start

    # -- steps --------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The index of the step `step()` dispatches next."""
        return self._next

    async def step(self) -> dict[str, Any] | None:
        """Dispatch one step; return ``{node: what it returned}`` once every node returned
        (None once an input or a node's own inputs ran out). Earlier steps may still run.
        One at a time: await each step before the next."""
        if self._stepping:  # (both would take one step index, and the second's wait is off)
            raise RuntimeError("flow.step() is running already: await each step before "
                               "calling the next (or use flow.run())")
        self._stepping = True
        try:
            return await self._step()
        except NodeError:
            self._told = True
            raise
        finally:
            self._stepping = False

    async def _step(self) -> dict[str, Any] | None:
        if self._ctl is None:
            raise RuntimeError("the flow is not open: use `async with flow:` or flow.run()")
        if self._failed is not None:  # its nodes were cancelled: later steps wait on them
            raise FlowError(f"step {self._failed} failed, and the steps after it need its "
                            f"nodes: rewind the flow to a checkpoint (asyncrl.group("
                            f"max_restarts=...) makes flow.run() do it) or close it")
        t = self.next_step
        # step t starts once the nodes its `follows=` nodes name have finished in step t-k-1;
        # the steps in flight are bounded one further: every node of step t-k-2 has finished
        # (a side node, an eval or a critic's update, may lag one step behind, not more)
        bound, before = t - self.max_staleness - 2, self._steps.get(t - self.max_staleness - 1)
        waits = list(self._steps[bound].finished.values()) if bound in self._steps else []
        if before is not None:  # (absent: before a resume)
            waits += [before.finished[n.follows] for n in self.nodes.values() if n.follows]
        if waits:  # before the input is read, shielded: a driver's timeout here leaves the
            await shielded(waits)  # flow as it was (those steps' work, the input item)
        values = self.feed.next()
        if values is None:
            return None
        step = _Step(t, started=time.perf_counter())
        self._steps[t] = step
        self._next = t + 1
        loop = asyncio.get_running_loop()
        for name in self.order:
            calls = step.calls[name] = Calls()  # (a node finishes after its group calls)
            task = quiet(loop.create_task(self._run_node(step, self.nodes[name], values, calls)))
            step.returned[name] = task
            step.finished[name] = dispatched(quiet(loop.create_task(finished(
                task, calls, functools.partial(self._blame, step, name)))))
            step.finished[name].add_done_callback(step._finish)
        # step t+1 looks back to step t-k-1 (its bound) and t-k (its follows= edges): older
        # steps (all finished, as step t-k-2 was before this one) are let go
        for old in [i for i in self._steps if i < bound + 1]:
            del self._steps[old]
        try:  # a node's failure said at once, not after the slower nodes before it return
            await asyncio.wait(step.returned.values(), return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in step.returned.values() if t.done() and not t.cancelled()
                      and t.exception() is not None]
            for task in failed[:1]:
                task.result()  # raises its NodeError
            return {name: await task for name, task in step.returned.items()}
        except BaseException as e:
            tasks = [*step.returned.values(), *step.finished.values(), *step.watchers]
            for task in tasks:
                cancel(task)  # (a recovery watcher would re-run a failed step's node)
            if not (isinstance(e, NodeError) and isinstance(e.__cause__, InputsExhausted)):
                self._failed = t
                raise
            # a node's own inputs ran out (DAPO's prompts): a normal end, its last checkpoint
            self._next, self.feed.ended = t, e.node  # saved (_run_steps), with step t's
            self.feed.unread()  # items not used (a resume reads them again)
            # its other nodes' cleanup ends first, not after the last save or the close
            # (a cancel here leaves step t for close() to wait on)
            await asyncio.gather(*tasks, return_exceptions=True)
            sent = [f for calls in step.calls.values() for f in calls.running]
            if sent and self._ctl is not None:  # and the calls they had sent (a save or a
                # close would race them), as long as a failed step's (_complete_running)
                await asyncio.wait(sent, timeout=self._ctl.collective_timeout)
            del self._steps[t]
            say(self._ctl, f"[asyncrl] node {e.node!r}, step {t}: {e.__cause__}: the run ends")
            return None

    async def _run_node(self, step: _Step, n: Node, values: dict[str, Any],
                        calls: Calls) -> Any:
        kwargs = {}
        for p in n.params:
            src = self.deps[n.name][p.name]
            if src is None:
                kwargs[p.name] = p.default
            elif src[0] == "input":
                kwargs[p.name] = values[src[1]]
            elif src[0] == "step":
                kwargs[p.name] = step.index
            else:
                kwargs[p.name] = await step.returned[src[1]]
        current_node.set((n.name, step.index))
        node_calls.set(calls)
        start = time.perf_counter()
        try:
            if self.save_inputs is not None:  # for `asyncrl run --node` (values awaited; a
                # failed upstream future named as without it); the node's time starts after
                await save_node_inputs(self.save_inputs / f"step{step.index}", n.name, kwargs)
                start = time.perf_counter()
            out = await self.recovery.call(n.name, step.index, functools.partial(
                calls.run, n.fn, kwargs), kwargs)
        except (Exception, asyncio.CancelledError) as e:
            task = asyncio.current_task()  # the node's own cancel (a task it awaited): its
            if not isinstance(e, Exception) and (task is None or cancelling(task)):  # failure
                raise  # this step's cancel (the driver's Ctrl-C, a failure beside it)
            err = self._blame(step, n.name, e if isinstance(e, Exception) else RuntimeError(
                f"node {n.name!r} raised CancelledError (a task it awaited was cancelled)"))
            raise err from err.__cause__
        finally:
            timeline = self._ctl.timeline if self._ctl is not None else None
            if timeline is not None:
                timeline.node(n.name, step.index, start, time.perf_counter())
        return out

    async def run(self, steps: int | None = None,
                  on_step: Callable[[int, dict[str, Any], float], None] | None = None,
                  checkpoint: Callable[[int], Awaitable[None]] | None = None,
                  restore: Callable[[], Awaitable[bool]] | None = None,
                  on_rewind: Callable[[int], Awaitable[None] | None] | None = None,
                  keep: bool = True) -> list[dict[str, Any]]:
        """Run until step index `steps` (default: the flow's `steps`, else until an input is
        exhausted, or a node's own inputs: InputsExhausted) inside the current Controller (or
        one of its own), spawning and closing the groups; return this run's node results by
        step, with DistFutures resolved to their values. Step indices count from 0 across
        resumes: resumed at step 4, ``run(8)`` runs steps 4..7.

        `checkpoint(t)` is awaited once steps <= t have finished and before step t+1 is
        dispatched (else t+1's calls could reach the ranks before the save): after every
        `checkpoint_every`-th step and after the last step of a run that ends normally.
        With restarts (`asyncrl.group(max_restarts=)`), a death the flow recovers from by
        going back (recovery.py) awaits `restore()` (load the newest checkpoint; False when
        there is none: the run starts over) and calls `on_rewind(t)` (awaited if async: a
        file's rewrite goes on a thread, not the loop): steps after t run again, and what
        `on_step` was given for them is void.

        `on_step(t, values, seconds)` gets each step's values once it finished, in order;
        `seconds`: from the end of the step before (or its dispatch, if later) to its own end,
        the period a step adds to the run (a step dispatched while earlier ones still run
        would count their time too, measured from its dispatch).

        `keep=False` (what `asyncrl launch` runs): a run of any length holds nothing for its
        return value (an empty list), and a node's TensorBatch left on its ranks is not
        fetched for `on_step` either: it gets the DistFuture (done) in its place (a future
        whose ranks keep TensorBatches, whatever its protocol collects them into)."""
        steps = self.steps if steps is None else steps
        opened = self._ctl is None
        if opened:
            await self.open()
        if steps is None and not self.feed.consumed:  # (no iterable input: none runs out)
            log.warning("asyncrl: this flow's inputs are all constants and it has no steps=: "
                        "the run goes on until a node raises InputsExhausted; pass "
                        "run(steps=N) or DataFlow(..., steps=N)")
        done: dict[int, dict[str, Any]] = {}
        self._origin, self._origin_rng = (self.next_step, self.positions()), rng_state()
        try:
            while True:
                try:
                    await self._run_steps(steps, on_step, checkpoint, done, keep)
                    break
                except Exception as e:
                    failed = getattr(e, "step", self.next_step - 1)  # a NodeError says
                    if not self.recovery.enabled or \
                            not await self.recovery.rewind(e, failed, restore):
                        await self._finish_earlier(e)
                        raise
                    kept = self.next_step - 1
                    for t in [t for t in done if t > kept]:
                        del done[t]
                    rewound = on_rewind(kept) if on_rewind is not None else None
                    if inspect.isawaitable(rewound):
                        await rewound
        finally:
            if opened:
                await self.close()
        return [done[t] for t in sorted(done)]

    async def _run_steps(self, steps: int | None,
                         on_step: Callable[[int, dict[str, Any], float], None] | None,
                         checkpoint: Callable[[int], Awaitable[None]] | None,
                         done: dict[int, dict[str, Any]], keep: bool) -> None:
        pending: list[tuple[_Step, dict[str, Any]]] = []
        saved, self._earlier = None, None

        async def complete(step: _Step, results: dict[str, Any]) -> None:
            values = await self._complete(step, results, on_step, keep)
            if keep:
                done[step.index] = values

        while steps is None or self.next_step < steps:
            try:
                results = await self.step()
            except Exception:  # the steps before it that finished well are the run's:
                await self._complete_finished(pending, complete)  # their rows are not lost
                self._earlier = functools.partial(self._complete_running, pending, complete)
                raise
            if results is None:
                break
            t = self.next_step - 1
            pending.append((self._steps[t], results))
            due = (checkpoint is not None and self.checkpoint_every is not None
                   and (t + 1) % self.checkpoint_every == 0)
            while pending and (due or all(x.done() for x in pending[0][0].finished.values())):
                await complete(*pending.pop(0))
            if due and checkpoint is not None:
                await self._save(checkpoint, t)
                saved = t
        for step, results in pending:
            await complete(step, results)
        last = self.next_step - 1
        if checkpoint is not None and self._steps and saved != last:
            await self._save(checkpoint, last)

    async def _save(self, checkpoint: Callable[[int], Awaitable[None]], t: int) -> None:
        """Checkpoint step `t`; a save that stateless groups died in is made again once they
        are back (a rewind would run finished steps again: from step 0 with no checkpoint)."""
        while True:
            try:
                return await checkpoint(t)
            except Exception as e:
                if not self.recovery.enabled or not await self.recovery.resave(e, t):
                    raise

    async def _finish_earlier(self, e: Exception) -> None:
        """A step failed and the run ends (no rewind): let the steps dispatched before it
        that still run finish, and complete those that finish well (their rows, as a run
        without overlap has them). A dead or silent group fails their calls; a call that
        runs on is waited for up to the collective timeout (then the run ends as before)."""
        earlier, self._earlier, self._told = self._earlier, None, True  # (raised: once)
        if earlier is not None:
            await earlier(e)

    async def _complete_running(self, pending: list[tuple[_Step, dict[str, Any]]],
                                complete: Callable[[_Step, dict[str, Any]], Awaitable[None]],
                                e: Exception) -> None:
        ahead = []  # up to the first that failed already: no step after it completes
        for step, _ in pending:
            if any(t.done() and (t.cancelled() or t.exception()) for t in step.finished.values()):
                break
            ahead.append(step)
        what = (f"node {e.node!r} failed at step {e.step}" if isinstance(e, NodeError)
                else "a step failed")
        await self._let_finish(ahead, lambda span, bound: (
            f"[asyncrl] {what}: letting step(s) {span}, dispatched before it, finish first "
            f"(their rows; within {bound:g} s; the error follows)"))
        await self._complete_finished(pending, complete)

    async def _let_finish(self, steps: list[_Step], notice: Callable[[str, float], str]) -> None:
        """Wait for `steps`' nodes still running, up to the collective timeout (then left, said;
        a cancel leaves them running too); `notice(steps, seconds)` says first what waits."""
        running = [t for step in steps for t in step.finished.values() if not t.done()]
        if not running:
            return
        bound = self._ctl.collective_timeout if self._ctl is not None else 0.0
        span = f"{steps[0].index}" + (f"-{steps[-1].index}" if len(steps) > 1 else "")
        say(self._ctl, notice(span, bound))
        _, left = await asyncio.wait(running, timeout=bound)
        if left:
            say(self._ctl, f"[asyncrl] step(s) {span} still ran {bound:g} s later (the "
                           f"collective timeout): left unfinished")

    async def _complete_finished(self, pending: list[tuple[_Step, dict[str, Any]]],
                                 complete: Callable[[_Step, dict[str, Any]], Awaitable[None]]
                                 ) -> None:
        """Complete the pending steps that finished without a failure, in order, up to one
        that did not; a failure while completing one (its values could not be fetched, its
        on_step raised) is said and ends them: no later step completes past it."""
        def ok(task: asyncio.Task) -> bool:
            return task.done() and not task.cancelled() and task.exception() is None
        while pending and all(map(ok, pending[0][0].finished.values())):
            step, results = pending.pop(0)
            try:
                await complete(step, results)
            except Exception as e:  # noqa: BLE001 - the run's own failure is raised
                say(self._ctl, f"[asyncrl] completing step {step.index} failed too: "
                               f"{type(e).__name__}: {e}")
                pending.clear()
                return

    async def _complete(self, step: _Step, results: dict[str, Any],
                        on_step: Callable[[int, dict[str, Any], float], None] | None,
                        keep: bool) -> dict[str, Any]:
        await shielded(step.finished.values())
        values = {}
        for name, r in results.items():
            try:
                values[name] = await resolved(r, batches=keep)
            except Exception as e:
                err = self._blame(step, name, e)
                raise err from err.__cause__
        if on_step is not None:
            since = max(step.started, self._last_end)
            on_step(step.index, values, max(0.0, step.ended - since))
        self._last_end = max(self._last_end, step.ended)
        return values

    def _blame(self, step: _Step, name: str, e: Exception) -> NodeError:
        """Node `name`'s failure `e`, named by the node it began in (blame.py)."""
        return blame(step.returned, upstream(self.deps, self.order, name), name, step.index, e)

    def node_inputs(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """Node `name`'s arguments among saved `inputs`: FlowError for a node that does not
        exist or inputs it lacks (checked before any group starts)."""
        if name not in self.nodes:
            raise FlowError(f"no node named {name!r}; nodes: {sorted(self.nodes)}; pass --node "
                            f"with one of them")
        n = self.nodes[name]
        kwargs = {p.name: inputs[p.name] for p in n.params if p.name in inputs}
        missing = [p.name for p in n.params if p.name not in kwargs and not p.optional]
        if missing:
            raise FlowError(f"node {name!r} needs inputs {missing}; the saved file has "
                            f"{sorted(inputs)}: pass the inputs file `asyncrl launch "
                            f"--save-inputs` wrote for this node "
                            f"(RUN_DIR/inputs/step<t>/{name}.msgpack)")
        return kwargs

    async def run_node(self, name: str, inputs: dict[str, Any],
                       futures: dict[str, list[list[Any]]] | None = None) -> Any:
        """Run one node alone with given inputs (values), for debugging; its value.
        `futures`: where the node was given DistFutures (input -> paths of keys and indices
        into it; [] for the input itself): given done ones of those values again."""
        kwargs = self.node_inputs(name, inputs)
        for param, paths in (futures or {}).items():
            for path in paths if param in kwargs else ():
                kwargs[param] = held_at(kwargs[param], path, f"saved input {param!r}")
        calls = Calls()  # its group calls waited for, their failure raised, as in a run
        returned = quiet(asyncio.get_running_loop().create_task(
            _alone(self.nodes[name].fn, kwargs, calls)))
        await finished(returned, calls, lambda e: e)
        return await resolved(returned.result())


async def _alone(fn: Callable[..., Any], kwargs: dict[str, Any], calls: Calls) -> Any:
    """A node run alone (its own task: node_calls set in its context only)."""
    node_calls.set(calls)
    out = calls.run(fn, kwargs)
    return await out if inspect.iscoroutine(out) else out  # (a DistFuture passed on as is)

