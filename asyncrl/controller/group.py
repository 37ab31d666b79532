"""GroupHandle: the controller's view of one SPMD worker group, and its calls.

    group.method(*args)  ──split (protocol)──▶ encode ──▶ Call to each rank, in order
          │ returns a DistFuture at once
    Result per rank ──▶ collect (protocol) ──▶ future resolves, or fails with the first
                                               rank's RemoteError / GroupDeadError

A call whose arguments include unresolved DistFutures waits in the backlog, and holds back
the calls behind it, so every rank sees the group's calls in submission order.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import itertools
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.actors.protocols import Layout, Protocol, Split, check_split, dp_block, get_protocol
from asyncrl.comm import codec, messages
from asyncrl.comm.messages import (
    Call,
    Construct,
    Failure,
    Heartbeat,
    MethodSpec,
    PeersGone,
    Result,
    Results,
    Schema,
)
from asyncrl.compat import add_note, create_task
from asyncrl.controller.fetches import Fetches
from asyncrl.controller.finished import broken_by, note_call
from asyncrl.controller.objects import ObjectRef
from asyncrl.controller.timeline import called_groups, current_node
from asyncrl.controller.unsent import Queued as _Queued
from asyncrl.controller.unsent import check_held as _check_held
from asyncrl.controller.unsent import lost as _lost
from asyncrl.errors import (
    ClosedError,
    EncodeError,
    GroupDeadError,
    InputLostError,
    RemoteError,
    TransferTimeout,
)
from asyncrl.futures.future import DistFuture, Held, Rows, futures_in, rebuild

if TYPE_CHECKING:
    from asyncrl.controller.controller import Controller
    from asyncrl.controller.launcher import Agent
    from asyncrl.controller.outbox import Outbox

_call_ids = itertools.count(1)
# errors of the data plane a rank reports by name: raised here as themselves
_DATA_PLANE_ERRORS = {f"asyncrl.{cls.__name__}": cls for cls in (TransferTimeout, InputLostError)}
_Host = tuple[bytes | None, list[int], list[bytes]]  # a relay (None: direct), ranks, sockets
# a relay or _ALL, the sockets, an encoded message and the raw frames it announces
_Send = tuple[Any, list[bytes], bytes, list[Any]]
_ALL = object()  # _Send's relay for a message to every rank of the group


@dataclass
class RankInfo:
    pid: int
    host: str
    last_seen: float
    identity: bytes = b""  # the rank's "io" socket: heartbeats, concurrent calls, shutdown
    exec_identity: bytes = b""  # its "exec" socket: construction and in-order calls
    data_addr: str = ""  # its data-plane server
    gpu: str = ""  # the UUID of its GPU ("" without one)
    beat: Heartbeat = field(default_factory=Heartbeat)  # its last (what its store holds...)
    ready: bool = False
    gone: bool = False  # its process was found dead

    def socket(self, role: str) -> bytes:
        """Its "io" or "exec" socket's identity."""
        return self.identity if role == "io" else self.exec_identity


@dataclass
class _Pending:
    call_id: int
    method: str
    protocol: Protocol
    future: DistFuture
    state: Any
    waiting: set[int]  # ranks that have not reported yet
    collect: set[int]
    inputs: list[ObjectRef]  # keeps the objects this call pulls alive until it is done
    schemas: dict[int, Schema] = field(default_factory=dict)  # what collected ranks keep
    inline: dict[int, msgspec.Raw] = field(default_factory=dict)
    busy: float = 0.0  # the longest time a rank spent on it


class _Method:
    __slots__ = ("_group", "_name")

    def __init__(self, group: GroupHandle, name: str):
        self._group, self._name = group, name

    def __call__(self, /, *args: Any, **kwargs: Any) -> DistFuture:
        return self._group.call(self._name, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<method {self._group.name}.{self._name}>"


class GroupHandle:
    """Returned by ``Controller.spawn``. ``group.<method>(...)`` returns a DistFuture."""

    def __init__(self, ctl: Controller, name: str, cls: type, layout: Layout, agent: Agent):
        self._ctl = ctl
        self.name = name
        self.worker_class = cls
        self.layout = layout
        self.agent = agent
        self.methods: dict[str, MethodSpec] = {}
        self.construct_msg: Construct | None = None  # what each rank is sent to build
        self.construct_frames: list[Any] = []  # and the raw frames of its large arguments
        self.ranks: dict[int, RankInfo] = {}
        self._pending: dict[int, _Pending] = {}
        self._backlog: deque[_Queued] = deque()
        self._drainer: asyncio.Task | None = None
        # concurrent calls waiting for their inputs (the loop holds tasks only weakly)
        self._waiting: dict[asyncio.Task, _Queued] = {}
        self._arg_names: dict[str, list[str]] = {}
        self.fetches = Fetches(name, ctl.loop, lambda rank, msg: ctl.post(
            self.ranks[rank].identity, msg), ctl.transfer_timeout)
        self._fans: dict[str, list[_Host]] = {}
        self.dead: GroupDeadError | None = None
        self.closing = False
        self.stopping: asyncio.Future[None] | None = None  # the stop in progress (controller)
        loop = ctl.loop
        self.started: asyncio.Future[None] = loop.create_future()  # every rank said hello
        self.ready: asyncio.Future[None] = loop.create_future()  # every worker is built
        self.exited = asyncio.Event()  # the torchrun agent has exited

    # -- public -----------------------------------------------------------------------------
    @property
    def nprocs(self) -> int:
        return self.layout.world_size

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.layout.mesh)

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of every rank that said hello."""
        return {r: info.pid for r, info in self.ranks.items()}

    @property
    def busy(self) -> bool:
        """Calls sent and not answered, or waiting for their inputs."""
        return bool(self._pending or self._backlog or self._waiting)

    @property
    def store_stats(self) -> dict[int, tuple[int, int]]:
        """rank -> (objects, bytes) in its object store, as of its last heartbeat."""
        return {r: (info.beat.objects, info.beat.object_bytes) for r, info in self.ranks.items()}

    @property
    def dropped_frames(self) -> dict[int, int]:  # frames dropped: bad signature, replay...
        return {r: info.beat.dropped for r, info in self.ranks.items()}

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self.methods:
            raise self._no_method(name)
        return _Method(self, name)

    def _no_method(self, name: str) -> AttributeError:
        return AttributeError(
            f"group {self.name!r} ({self.worker_class.__name__}) has no registered method "
            f"{name!r}; registered: {sorted(m for m in self.methods if not m.startswith('_'))} "
            f"(mark methods with @asyncrl.register)")

    def __repr__(self) -> str:
        return f"<GroupHandle {self.name!r} {self.worker_class.__name__} x{self.nprocs}>"

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> DistFuture:
        """Call a registered method by name; the same as ``group.<method>(...)``.

        On the controller's loop, errors in the arguments raise here and nothing is sent;
        from another thread the call is handed to the loop and such errors fail the future.
        Arguments are read when the call is sent (later, if it waits for inputs or for the
        calls ahead of it); a call's tensors of 32 MiB or more in all are sent from their own
        memory (`codec.IN_PLACE_MIN`): do not change them in place until the call is done."""
        called = called_groups.get()
        if called is not None:  # first: a node whose call meets the death is re-run
            called.add(self.name)
        if self.dead is not None or self.closing:  # a dead group being replaced is still
            raise self._refusal()  # dead (a node that called it can be re-run), not "closed"
        if method not in self.methods:
            raise self._no_method(method)
        loop = self._ctl.loop
        future = DistFuture._new(loop, f"{self.name}.{method}")
        item = _Queued(method, args, kwargs, future)
        timeline = self._ctl.timeline
        if timeline is not None:
            timeline.call(self.name, current_node.get(), future)
        if threading.get_ident() == self._ctl._loop_thread:
            self._submit(item)
        else:
            loop.call_soon_threadsafe(self._submit_or_fail, item)
        note_call(future)  # the node making it finishes once it ends (finished.py; after:
        return future  # one refused here raised, and left no future to wait for)

    def _refusal(self, closed: str = "") -> Exception:
        """Its death, a copy for each raise (one object raised again and again grows its
        traceback, whose frames keep what they name alive), or ClosedError."""
        return copy.copy(self.dead) if self.dead is not None else \
            ClosedError(f"group {self.name!r} is closed{closed}")

    def _submit(self, item: _Queued) -> None:
        if self.closing or self.dead is not None:
            raise self._refusal()
        concurrent = self.methods[item.method].concurrent
        if any(isinstance(a, DistFuture | Rows) for a in (*item.args, *item.kwargs.values())) or (
                self._backlog and not concurrent):
            self._hold(item)
            return
        try:
            self._send(item)
        except EncodeError:
            # futures inside a list, tuple or dict show up when encoding meets them (looking
            # through every argument of every call would cost more than encoding it): the
            # call waits for them as for top-level ones
            if not futures_in([*item.args, *item.kwargs.values()]):
                raise
            self._hold(item)

    def _hold(self, item: _Queued) -> None:
        """Send `item` once its inputs are done (a call not `concurrent`: in order, after the
        calls held before it)."""
        if self.methods[item.method].concurrent:
            task = self._ctl.loop.create_task(self._send_when_ready(item))
            self._waiting[task] = item
            task.add_done_callback(self._waiting.pop)
        else:
            item.context = contextvars.copy_context()  # (the drainer serves every node)
            self._backlog.append(item)
            if self._drainer is None or self._drainer.done():
                self._drainer = create_task(self._ctl.loop, self._drain(), contextvars.Context())

    def _submit_or_fail(self, item: _Queued) -> None:
        try:
            self._submit(item)
        except Exception as e:  # noqa: BLE001 - the caller on another thread sees it at result()
            item.fail(e)

    # -- sending ----------------------------------------------------------------------------
    async def _drain(self) -> None:
        while self._backlog:
            item = self._backlog[0]
            try:  # in its caller's context, as a concurrent call's task is: the links it
                # sets up are that node's calls (timeline, re-runs), not the first node's
                await create_task(self._ctl.loop, self._send_when_ready(item), item.context)
            finally:  # _fail_all may have emptied the backlog meanwhile
                if self._backlog and self._backlog[0] is item:
                    self._backlog.popleft()

    async def _send_when_ready(self, item: _Queued) -> None:
        try:
            await self._take_inputs(item)
            self._send(item)
        except Exception as e:  # noqa: BLE001 - the caller sees it at await (its traceback
            item.fail(e)  # keeps this frame, which names only the call: emptied by fail)

    async def _take_inputs(self, item: _Queued) -> None:
        """Its futures' results in place of them, once done, and still held by their groups."""
        item.args = tuple([await self._view(a, i, item) for i, a in enumerate(item.args)])
        item.kwargs = {k: await self._view(v, k, item) for k, v in item.kwargs.items()}
        for ref in item.inputs:  # (one dead while a later input was awaited: not sent)
            _check_held(ref, "an input")
        if self.closing or self.dead is not None:
            raise self._refusal()

    def _send(self, item: _Queued) -> None:
        protocol = get_protocol(self.methods[item.method].dispatch)
        split = protocol.split(self.layout, item.args, item.kwargs)
        if not protocol.builtin:
            check_split(protocol.name, split, self.nprocs)
        call_id = next(_call_ids)
        role = "io" if self.methods[item.method].concurrent else "exec"
        produced = codec.produced_bytes_encoded
        if split.dp_rows is not None:
            sends = self._dp_calls(split, item.method, role, call_id)
        else:
            sends = self._calls_by_rank(split, item.method, role, call_id)
        self._ctl.payload_bytes += codec.produced_bytes_encoded - produced
        codec.own_unless_large(list({id(raw): raw for *_, raw in sends if raw}.values()))
        self._pending[call_id] = _Pending(call_id, item.method, protocol, item.future,
                                          split.state, set(split.calls), set(split.collect),
                                          item.inputs)
        self._ctl.calls[call_id] = self
        box = self._ctl.outbox()
        for relay, identities, call, raw in sends:
            if relay is _ALL:
                self.post_all(box, role, call, raw)
            else:
                box.put_many(relay, identities, call, raw)
        box.flush(call_id)

    def _encode(self, method: str, args: tuple, kwargs: dict[str, Any]
                ) -> tuple[msgspec.Raw, list[Any]]:
        """The payload of a Call, and the raw frames of its large arrays."""
        try:
            payload, raw = codec.encode_call_oob(args, kwargs, self._names(method))
            return msgspec.Raw(payload), raw
        except codec.ArgEncodeError as e:
            raise EncodeError(f"cannot send argument {e.name!r} of {self.name}.{method}(): "
                              f"{e.cause}") from None

    def _calls_by_rank(self, split: Split, method: str, role: str, call_id: int) -> list[_Send]:
        """A Call per distinct arguments, shared by the ranks given them."""
        ranks_of: dict[tuple[int, int], list[int]] = {}
        for rank, (args, kwargs) in split.calls.items():
            ranks_of.setdefault((id(args), id(kwargs)), []).append(rank)
        collect = set(split.collect)
        if len(ranks_of) == 1 and len(split.calls) == self.nprocs:
            # the same Call for every rank (a broadcast): no work per rank
            args, kwargs = next(iter(split.calls.values()))
            payload, raw = self._encode(method, args, kwargs)
            return [(_ALL, [], messages.encode(Call(
                call_id, method, payload, _keep(range(self.nprocs), collect),
                buffers=_sizes(raw))), raw)]
        sends: list[_Send] = []
        for ranks in ranks_of.values():
            payload, raw = self._encode(method, *split.calls[ranks[0]])
            call = messages.encode(Call(call_id, method, payload, _keep(ranks, collect),
                                        buffers=_sizes(raw)))
            for rank in ranks:
                identity = self.ranks[rank].socket(role)
                sends.append((self._ctl.relay_of.get(identity), [identity], call, raw))
        return sends

    def _dp_calls(self, split: Split, method: str, role: str, call_id: int) -> list[_Send]:
        """A DP call: each host is sent the rows its ranks need, once, in one Call that its
        ranks share; each rank takes its own chunk (`take_dp_rows`)."""
        rows, dp_of, collect = split.dp_rows, self.layout._dp[0], set(split.collect)
        assert rows is not None
        args, kwargs = split.calls[0]  # every rank has the whole batches
        sends: list[_Send] = []
        for relay, ranks, identities in self._hosts(role):
            spans = [rows.span(dp_of[r]) for r in ranks]
            first, last = min(s[0] for s in spans), max(s[1] for s in spans)
            payload, raw = self._encode(method, *dp_block(args, kwargs, first, last))
            sends.append((relay, identities, messages.encode(Call(
                call_id, method, payload, _keep(ranks, collect), (rows.rows, first),
                _sizes(raw))), raw))
        return sends

    def _names(self, method: str) -> list[str]:
        names = self._arg_names.get(method)
        if names is None:
            try:
                params = list(inspect.signature(getattr(self.worker_class, method)).parameters)
                names = params[1:]
            except (TypeError, ValueError):
                names = []
            self._arg_names[method] = names
        return names

    # -- receiving --------------------------------------------------------------------------
    def fan(self, role: str) -> list[_Host] | None:
        """Every rank's "io" or "exec" socket, by the relay it is behind (None: reached
        directly), with its rank; None until every rank said hello on both."""
        fan = self._fans.get(role)
        if fan is None:
            if len(self.ranks) < self.nprocs or not all(i.identity and i.exec_identity
                                                       for i in self.ranks.values()):
                return None
            relay_of = self._ctl.relay_of
            by_relay: dict[bytes | None, tuple[list[int], list[bytes]]] = {}
            for rank in sorted(self.ranks):
                identity = self.ranks[rank].socket(role)
                ranks, identities = by_relay.setdefault(relay_of.get(identity), ([], []))
                ranks.append(rank)
                identities.append(identity)
            fan = self._fans[role] = [(relay, r, i) for relay, (r, i) in by_relay.items()]
        return fan

    def _hosts(self, role: str) -> list[_Host]:
        """`fan`, with each rank reached directly on its own."""
        fan = self.fan(role)
        assert fan is not None, "a call is sent once every rank said hello"
        out: list[_Host] = []
        for relay, ranks, identities in fan:
            if relay is None:
                out += [(None, [r], [i]) for r, i in zip(ranks, identities, strict=True)]
            else:
                out.append((relay, ranks, identities))
        return out

    def post_all(self, box: Outbox, role: str, message: bytes, raw: Sequence[Any] = ()
                 ) -> None:
        """Put one message (and the raw frames it announces) for every rank's `role` socket
        (those that said hello)."""
        fan = self.fan(role)
        if fan is None:
            for info in self.ranks.values():
                identity = info.socket(role)
                if identity:
                    box.put(identity, message, raw)
            return
        for relay, _, identities in fan:
            box.put_many(relay, identities, message, raw)

    def _on_result(self, msg: Result) -> None:
        p = self._pending.get(msg.call_id)
        rank = msg.rank
        if p is None or rank not in p.waiting:
            return
        p.waiting.discard(rank)
        p.busy = max(p.busy, msg.busy)
        if msg.error is not None:
            first = p.future._fut.exception() if p.future._fut.done() else None
            if first is None:
                p.future._set_exception(self._remote_error(rank, p.method, msg.error))
            elif isinstance(first, RemoteError) and len(getattr(first, "__notes__", [])) < 16:
                # shown with the first rank's error (16 at most): a bug on every rank is not
                # taken for one rank's trouble
                add_note(first, f"{self.name}[rank {rank}].{p.method} raised too: "
                                f"{msg.error.type}: {msg.error.message}")
            if msg.aborted_links:
                self._ctl.links.aborted(msg.aborted_links)
        elif rank in p.collect:
            if msg.schema is not None:
                p.schemas[rank] = msg.schema
            if msg.inline:
                p.inline[rank] = msg.value
        if not p.waiting:
            self._done(p)

    def _on_results(self, msg: Results) -> None:
        """A host's answers to one call, all successful (from its relay)."""
        p = self._pending.get(msg.call_id)
        if p is None:
            return
        ranks = msg.ranks
        n = len(ranks)
        if len(msg.values) != n or len(msg.inline) != n or len(msg.schema_of) != n or \
                any(not -1 <= i < len(msg.schemas) for i in msg.schema_of):
            self._ctl.channel.drop("malformed")  # before any state changes: the ranks'
            return  # real answers still count
        if not p.waiting.issuperset(ranks) or not p.collect.issuperset(ranks):
            for i, rank in enumerate(ranks):  # not the common case: one by one
                schema = msg.schemas[msg.schema_of[i]] if msg.schema_of[i] >= 0 else None
                self._on_result(Result(msg.call_id, rank, msg.values[i], schema=schema,
                                       inline=msg.inline[i], busy=msg.busy))
            return
        p.waiting.difference_update(ranks)
        p.busy = max(p.busy, msg.busy)
        schemas, schema_of = msg.schemas, msg.schema_of
        if len(schemas) == 1 and -1 not in schema_of:
            p.schemas.update(dict.fromkeys(ranks, schemas[0]))
        else:
            p.schemas.update((r, schemas[i]) for r, i in zip(ranks, schema_of, strict=True)
                             if i >= 0)
        if all(msg.inline):
            p.inline.update(zip(ranks, msg.values, strict=True))
        else:
            p.inline.update((r, v) for r, v, inline in zip(ranks, msg.values, msg.inline,
                                                           strict=True) if inline)
        if not p.waiting:
            self._done(p)

    def _done(self, p: _Pending) -> None:
        """Every rank answered: resolve the call's future (unless a rank failed it)."""
        del self._pending[p.call_id]
        self._ctl.calls.pop(p.call_id, None)
        if p.future.done():  # another rank failed: nothing will name what these ranks kept
            if p.schemas:
                self._ctl.releases.queue(self, list(p.schemas), p.call_id)
            return
        layout, protocol, state = self.layout, p.protocol, p.state
        p.future.busy_s = p.busy
        encoded = protocol.collect_encoded
        p.future._set_result(ObjectRef(
            self, p.call_id, lambda parts: protocol.collect(layout, parts, state),
            p.schemas, p.inline,
            None if encoded is None else lambda raws: encoded(layout, raws, state),
            "" if protocol.builtin else protocol.name))

    def _remote_error(self, rank: int, method: str, error: Failure) -> Exception:
        own = _DATA_PLANE_ERRORS.get(error.type)  # raised by asyncrl itself on the rank
        if own is not None:
            return own(f"{self.name}[rank {rank}].{method}: {error.message}")
        return RemoteError(self.name, rank, method, error.type, error.message, error.traceback)

    async def _fetch(self, rank: int, obj_id: int, nbytes: int = 0) -> Any:
        """A stored part that was too big to come with its Result (a driver awaits it)."""
        if self.dead is not None or self.closing:
            raise self._refusal("; its results are gone")
        return await self.fetches.get(rank, obj_id, nbytes)

    async def _view(self, arg: Any, name: int | str, item: _Queued, lost_value: bool = True
                    ) -> Any:
        """A DistFuture argument (or one in a list, tuple, dict or Rows) becomes references to
        its data, which the consumer's ranks pull from the producer's: never via here. A
        small result of a group gone since (`lost_value`) goes as itself: the controller has
        all of it."""
        if not isinstance(arg, DistFuture):
            if not futures_in(arg):
                return arg
            if isinstance(arg, Rows):  # rows of futures: one batch of their references (a
                # lost one's value could not join them: InputLostError, as before)
                return await arg.batch(lambda f: self._view(f, name, item, lost_value=False))
            if isinstance(arg, dict):
                return {k: await self._view(v, f"{name}[{k!r}]", item) for k, v in arg.items()}
            return rebuild(arg, [await self._view(v, f"{name}[{i}]", item)
                                 for i, v in enumerate(arg)])
        try:
            ref = await asyncio.shield(arg._fut)
        except Exception as e:
            raise RuntimeError(f"input {name!r} ({arg._label}) failed: {e}") from e
        if isinstance(ref, Held):  # a value on the controller: it goes with the call
            return ref.view()
        if lost_value and _lost(ref) and ref.came_inline():
            return await ref.value()  # (decoded only: no rank is asked)
        _check_held(ref, f"input {name!r} ({arg._label})")  # (heard of here, maybe not there)
        item.inputs.append(ref)
        transport = self._ctl.transport
        if self._ctl.links.needed(ref, self, transport):  # (set up before the call goes)
            await self._ctl.links.ensure(ref.group, self, required=transport == "nccl")
        return ref.view(f"input {name!r} of {self.name}.{item.method}() ({arg._label})")

    def _fail_all(self, exc: BaseException) -> None:
        # a copy each: one object raised by many kept its last awaiter's frames (and batches)
        for p in self._pending.values():
            first = p.future._fut.exception() if p.future._fut.done() else None
            if isinstance(first, RemoteError) and isinstance(exc, GroupDeadError):
                broken_by(first, exc)  # a rank whose peer died failed it first
            p.future._set_exception(copy.copy(exc))
            self._ctl.calls.pop(p.call_id, None)
        self._pending.clear()
        while self._backlog:
            self._backlog.popleft().future._set_exception(copy.copy(exc))
        for task, item in list(self._waiting.items()):  # fail now, not when inputs arrive
            task.cancel()
            item.future._set_exception(copy.copy(exc))
        if self._drainer is not None:  # (the backlog's head waits on its inputs: let go;
            self._drainer.cancel()  # and not kept: its end's traceback names their futures)
            self._drainer = None
        self.fetches.fail(exc)
        for waiter in (self.started, self.ready):
            if not waiter.done():
                waiter.set_exception(copy.copy(exc))
                waiter.exception()

    def _mark_dead(self, rank: int | None, exit_code: int | None, reason: str) -> None:
        if self.dead is not None or self.closing:
            return
        self.dead = GroupDeadError(self.name, rank, exit_code, reason, self.agent.tail())
        info = self.ranks.get(rank) if rank is not None else None
        cluster = self._ctl.cluster
        if cluster is not None:  # a respawn goes elsewhere first; with no rank to name, away
            heard = {i.host for i in self.ranks.values()}  # from the hosts that failed it
            cluster.suspect(*[info.host] if info is not None else self.agent.blamed(heard))
        self._fail_all(self.dead)
        self.announce_gone(f"is dead: {reason}")

    def announce_gone(self, why: str) -> None:
        """Tell the ranks of every other running group that this group's data servers will
        never answer again: their pulls from it fail now (InputLostError), not at the
        transfer timeout."""
        addrs = [info.data_addr for info in self.ranks.values() if info.data_addr]
        if not addrs:
            return
        message = messages.encode(PeersGone(self.name, addrs, next(_call_ids), why))
        box = self._ctl.outbox()
        for other in self._ctl.groups.values():
            if other is not self and other.dead is None and not other.closing:
                other.post_all(box, "io", message)
        box.flush()


def _keep(ranks: Iterable[int], collect: set[int]) -> list[int] | None:
    """A Call's `collect` for the ranks it goes to: None when each of them keeps its result,
    else those that do (so that ranks told apart only by it still share one Call)."""
    ranks = list(ranks)
    return None if collect.issuperset(ranks) else [r for r in ranks if r in collect]


def _sizes(raw: list[Any]) -> list[int]:
    """A Call's `buffers`: the byte sizes of its raw frames."""
    return [a.nbytes for a in raw]
