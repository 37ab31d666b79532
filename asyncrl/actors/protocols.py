"""Dispatch protocols: how one call's arguments are split across a group's ranks and how the
ranks' results are collected into the value the caller awaits. They run on the controller.

A protocol is two functions (register your own with `register_protocol`):

    split(layout, args, kwargs) -> Split     which ranks run, with which arguments,
                                             and which ranks' return values to collect
    collect(layout, results, state) -> Any   results: {rank: value} of the collected ranks;
                                             state: Split.state, passed through
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.comm import codec
from asyncrl.comm.batch import RowOps
from asyncrl.compat import add_note

DP_AXIS = "dp"


class Dispatch(str, enum.Enum):
    ONE_TO_ALL = "one_to_all"  # same args to every rank; list of results by rank
    ALL_TO_ALL = "all_to_all"  # every arg is a list with one item per rank; list of results
    RANK_ZERO = "rank_zero"  # rank 0 only; its return value
    DP = "dp"  # TensorBatch args chunked along the mesh's "dp" axis; results concatenated


@dataclass(frozen=True)
class Layout:
    """A group's ranks and their mesh coordinates, as the controller knows them."""

    group: str
    mesh: tuple[tuple[str, int], ...]

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    def coords(self, rank: int) -> dict[str, int]:
        return mesh_coords(self.mesh, rank)

    @property
    def dp_size(self) -> int:
        return dict(self.mesh).get(DP_AXIS, 1)

    def dp_rank(self, rank: int) -> int:
        return self._dp[0][rank]

    def is_dp_collect(self, rank: int) -> bool:
        """One rank per DP chunk answers: the one whose other coordinates are all 0."""
        return self._dp[1][rank]

    @property
    def dp_collect(self) -> list[int]:
        """The ranks that answer a DP call, in dp order."""
        return list(self._dp[2])

    @functools.cached_property
    def _dp(self) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]:
        """Each rank's dp rank, whether it collects, and the collecting ranks in dp order,
        worked out once per layout (DP calls ask for every rank)."""
        coords = [self.coords(r) for r in range(self.world_size)]
        dp = tuple(c.get(DP_AXIS, 0) for c in coords)
        collects = tuple(all(v == 0 for name, v in c.items() if name != DP_AXIS) for c in coords)
        order = tuple(sorted((r for r in range(self.world_size) if collects[r]),
                             key=dp.__getitem__))
        return dp, collects, order


def mesh_coords(mesh: tuple[tuple[str, int], ...], rank: int) -> dict[str, int]:
    """Row-major coordinates of `rank` (the last axis varies fastest, as in DeviceMesh)."""
    out: dict[str, int] = {}
    for name, size in reversed(mesh):
        rank, out[name] = divmod(rank, size)
    return dict(reversed(list(out.items())))


@dataclass(frozen=True)
class DPRows:
    """How `rows` rows split over `dp` data-parallel ranks: exactly as
    ``TensorBatch.chunk(dp, pad=True)`` (the first rows % dp chunks get one row more; every
    chunk is padded to ceil(rows / dp) rows)."""

    rows: int
    dp: int

    def span(self, d: int) -> tuple[int, int]:
        """Rows [start, stop) of dp rank d's chunk, before padding."""
        base, extra = divmod(self.rows, self.dp)
        start = d * base + min(d, extra)
        return start, start + base + (d < extra)

    @property
    def padded(self) -> int:
        return -(-self.rows // self.dp)


@dataclass
class Split:
    calls: dict[int, tuple[tuple, dict[str, Any]]]  # rank -> (args, kwargs); absent: not run
    # ranks whose return values are sent back: `collect` gets them as {rank: value} in rank
    # order, whatever the order of this list
    collect: list[int]
    state: Any = None
    # set by DP: `calls` hold the whole batches, and each rank takes its chunk itself
    # (`take_dp_rows`): a host is sent the rows its ranks need once, not a chunk per rank
    dp_rows: DPRows | None = None


def check_split(protocol: str, split: Any, world: int) -> None:
    """A user protocol's Split, checked before anything is sent: a call to no rank would
    never finish, and unknown ranks would fail later with a bare KeyError."""
    if not isinstance(split, Split):
        raise TypeError(f"protocol {protocol!r}: split returned {type(split).__name__}, not "
                        f"an asyncrl.Split(calls, collect)")
    own = _PROTOCOLS.get(protocol)  # (one whose split is DP's own, asyncrl.rl's dp_stats:
    dp = own is not None and getattr(own.split, "__wrapped__", own.split) is _dp_split  # fine)
    if split.dp_rows is not None and not dp:  # (every rank would be sent calls[0] and cut
        raise ValueError(f"protocol {protocol!r}: split set Split.dp_rows, which only the "
                         f"built-in DP protocol sets; leave it None and give each rank its own "
                         f"arguments in calls")
    if not split.calls:
        raise ValueError(f"protocol {protocol!r}: split called no rank (calls is empty): the "
                         f"call would never finish")
    bad = sorted(f"{r} ({type(r).__name__})" for r in split.calls if not (
        type(r) is int and 0 <= r < world))  # (numpy's ints: int() them; True is no rank)
    if bad:
        raise ValueError(f"protocol {protocol!r}: split calls ranks {bad}, but the group's "
                         f"ranks are the ints 0..{world - 1}")
    idle = sorted(str(r) for r in set(split.collect) - set(split.calls))
    if idle:
        raise ValueError(f"protocol {protocol!r}: collect names ranks {idle} that split does "
                         f"not call (calls {sorted(split.calls)})")
    for rank, call in split.calls.items():
        _check_call(protocol, rank, call)


def _check_call(protocol: str, rank: int, call: Any) -> None:
    """TypeError unless `call` is (args, kwargs): `((batch), {})`, a 1-tuple without its
    comma, ran fn(*batch) on every rank; `(args,)` failed unpacking inside asyncrl."""
    pair = isinstance(call, tuple | list) and len(call) == 2
    if pair and isinstance(call[0], tuple | list) and isinstance(call[1], dict):
        return
    got = type(call).__name__
    if isinstance(call, tuple | list):
        got += f" of {len(call)}: ({', '.join(type(x).__name__ for x in call[:3])}" + (
            ", ...)" if len(call) > 3 else ")")
    raise TypeError(f"protocol {protocol!r}: split's calls[{rank}] must be a pair (args, "
                    f"kwargs), a tuple or list and a dict, e.g. ((batch,), {{}}) (a 1-tuple "
                    f"needs its comma), got {got}")


@dataclass(frozen=True)
class Protocol:
    name: str
    split: Callable[[Layout, tuple, dict[str, Any]], Split]
    collect: Callable[[Layout, dict[int, Any], Any], Any]
    builtin: bool = field(default=False, compare=False)
    # optional: `collect` from the encoded results ({rank: bytes}), without decoding each
    # first; returns None where it cannot (then they are decoded and given to `collect`)
    collect_encoded: Callable[[Layout, dict[int, Any], Any], Any] | None = None


_PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(name: str, *, split: Callable[[Layout, tuple, dict[str, Any]], Split],
                      collect: Callable[[Layout, dict[int, Any], Any], Any]) -> str:
    """Add a user protocol; use the returned name as ``@register(dispatch=name)``.

    `split(layout, args, kwargs)` returns a `Split`; `collect(layout, results, state)` gets
    ``{rank: value}`` for the ranks in ``Split.collect`` and returns what ``await`` gives."""
    if name in _PROTOCOLS and _PROTOCOLS[name].builtin:
        raise ValueError(f"protocol name {name!r} is built in; choose another name")
    _PROTOCOLS[name] = Protocol(name, _noted(name, split), collect)
    return name


def _noted(name: str, split: Callable[[Layout, tuple, dict[str, Any]], Split]
           ) -> Callable[[Layout, tuple, dict[str, Any]], Split]:
    """A user's `split` whose errors say whose they are (the caller's traceback ends in
    asyncrl's sending code; the future's name, group.method, says which call)."""
    @functools.wraps(split)
    def noted(layout: Layout, args: tuple, kwargs: dict[str, Any]) -> Split:
        try:
            return split(layout, args, kwargs)
        except Exception as e:
            add_note(e, f"raised by split() of the user protocol {name!r} "
                     f"(register_protocol), for a call on group {layout.group!r}")
            raise
    return noted


def get_protocol(name: str) -> Protocol:
    try:
        return _PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown dispatch protocol {name!r}; known: {sorted(_PROTOCOLS)} "
                         f"(register yours with asyncrl.register_protocol)") from None


def protocol_name(dispatch: Dispatch | str) -> str:
    if not isinstance(dispatch, str):  # (a Dispatch is a str) before a lookup: {} "unhashable"
        raise TypeError(f"dispatch= takes an asyncrl.Dispatch or a protocol name (str), got "
                        f"{type(dispatch).__name__} {dispatch!r}; e.g. "
                        f"@register(dispatch=Dispatch.DP)")
    name = dispatch.value if isinstance(dispatch, Dispatch) else dispatch
    get_protocol(name)
    return name


# -- built-in protocols ----------------------------------------------------------------------
def _one_to_all_split(layout: Layout, args: tuple, kwargs: dict) -> Split:
    ranks = range(layout.world_size)
    return Split({r: (args, kwargs) for r in ranks}, list(ranks))


def _by_rank(layout: Layout, results: dict[int, Any], state: Any) -> list:
    return [results[r] for r in sorted(results)]


def _all_to_all_split(layout: Layout, args: tuple, kwargs: dict) -> Split:
    n = layout.world_size
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"a list of {len(value)}" if isinstance(value, (list, tuple)) else \
                type(value).__name__
            raise ValueError(f"ALL_TO_ALL call on group {layout.group!r}: {what} must be a list "
                             f"with one item per rank ({n}), got {got}")
    calls = {r: (tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()})
             for r in range(n)}
    return Split(calls, list(range(n)))


def _rank_zero_split(layout: Layout, args: tuple, kwargs: dict) -> Split:
    return Split({0: (args, kwargs)}, [0])


def _rank_zero_collect(layout: Layout, results: dict[int, Any], state: Any) -> Any:
    return results[0]


@dataclass
class _DPState:
    chunk_rows: list[int]  # rows of each (padded) chunk sent
    pads: list[int]  # trailing padding rows of each chunk
    batched: bool  # whether any argument was a TensorBatch


def _dp_split(layout: Layout, args: tuple, kwargs: dict) -> Split:
    """Batches (local TensorBatch or RemoteBatch: the same row operations) are chunked with
    padding; every other argument is broadcast (one holding a batch, with none beside it,
    is refused: it would be sent whole to every rank)."""
    dp = layout.dp_size
    batches = [a for a in (*args, *kwargs.values()) if isinstance(a, RowOps)]
    if not batches:
        _refuse_nested_batches(layout, args, kwargs)
    lengths = {len(b) for b in batches}
    if len(lengths) > 1:
        raise ValueError(f"DP call on group {layout.group!r}: TensorBatch arguments have "
                         f"different lengths {sorted(lengths)}; they are split row by row, so "
                         f"they must have the same number of rows")
    rows = max(lengths, default=0)
    per_chunk = -(-rows // dp)
    base, extra = divmod(rows, dp)
    real = [base + (d < extra) for d in range(dp)]
    state = _DPState([per_chunk] * dp, [per_chunk - r for r in real], bool(batches))
    if batches and rows >= dp:  # no empty chunk (its padding row comes from another's rows)
        whole = (args, kwargs)
        return Split(dict.fromkeys(range(layout.world_size), whole), layout.dp_collect, state,
                     DPRows(rows, dp))
    chunked = {id(b): b.chunk(dp, pad=True) for b in batches}  # once per batch argument
    arg_chunks = [chunked.get(id(a)) for a in args]
    kwarg_chunks = [(n, v, chunked.get(id(v))) for n, v in kwargs.items()]
    per_dp = []
    for d in range(dp):
        a = tuple(a if c is None else c[d] for a, c in zip(args, arg_chunks, strict=True))
        k = {n: v if c is None else c[d] for n, v, c in kwarg_chunks}
        per_dp.append((a, k))
    dp_of = layout._dp[0]
    calls = {r: per_dp[d] for r, d in enumerate(dp_of)}
    return Split(calls, layout.dp_collect, state)


def _refuse_nested_batches(layout: Layout, args: tuple, kwargs: dict[str, Any]) -> None:
    """A batch inside a dict, list or tuple argument is not chunked (only arguments that are
    batches are): every rank would get all its rows, and the results repeat them dp times."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in named:
        inner = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list | tuple) else ()
        if any(isinstance(x, RowOps) for x in inner):
            raise ValueError(
                f"DP call on group {layout.group!r}: {what} is a {type(value).__name__} holding "
                f"a TensorBatch, which DP would send whole to every dp rank (only arguments "
                f"that are batches are split by rows); pass the TensorBatch itself as an "
                f"argument, or call a ONE_TO_ALL method to give every rank every row")


def dp_block(args: tuple, kwargs: dict[str, Any], start: int, stop: int
             ) -> tuple[tuple, dict[str, Any]]:
    """The arguments with rows [start, stop) of each batch: what a host's ranks need."""
    return (tuple(a.slice(start, stop) if isinstance(a, RowOps) else a for a in args),
            {k: v.slice(start, stop) if isinstance(v, RowOps) else v for k, v in kwargs.items()})


def take_dp_rows(args: list, kwargs: dict[str, Any], rows: DPRows, first: int, d: int
                 ) -> tuple[list, dict[str, Any]]:
    """On a rank: its chunk of each batch argument, from the block of rows starting at row
    `first` that its host was sent, padded as `chunk(pad=True)` pads it."""
    start, stop = rows.span(d)

    def cut(x: Any) -> Any:
        if not isinstance(x, RowOps):
            return x
        chunk = x.slice(start - first, stop - first)
        return chunk.pad_to(rows.padded)
    return [cut(a) for a in args], {k: cut(v) for k, v in kwargs.items()}


def _dp_collect_encoded(layout: Layout, results: dict[int, Any], state: _DPState) -> Any:
    """`_dp_collect` of TensorBatches straight from their encodings: one tensor per column."""
    ranks = sorted(results, key=layout.dp_rank)
    return codec.decode_concat([results[r] for r in ranks],
                               lambda d, rows: _dp_kept(layout, d, rows, state))


def _dp_kept(layout: Layout, d: int, rows: int, state: _DPState) -> int | None:
    """How many of the rows dp rank d returned are real: padding rows (and the rows the
    method made from them, r rows per row sent) are dropped. None: kept whole, where dp rank
    d was sent no padding, or returned a row count that is not a multiple of the rows sent
    (a summary of its chunk, say: its rows are not the input's, so none is padding's)."""
    pad, sent = state.pads[d], state.chunk_rows[d]
    if not (pad and state.batched) or rows % sent:
        return None
    return rows - pad * (rows // sent)


def _dp_cut(layout: Layout, d: int, out: Any, state: _DPState) -> Any:
    """Dp rank d's result without its padding rows' part when it is a batch (its rows as
    `_dp_kept` says). Anything else as it is: a list or tensor one item a row cannot be told
    from a summary of that length (a (loss, tokens) pair on a chunk of two rows)."""
    if isinstance(out, RowOps):
        rows = _dp_kept(layout, d, len(out), state)
        return out if rows is None else out.slice(0, rows)
    return out


def _dp_collect(layout: Layout, results: dict[int, Any], state: _DPState) -> Any:
    """Batches: concatenated in dp order, padding rows dropped. Other values: a list in dp
    order, as the ranks returned them (a value a row holds its padding rows' items too:
    return a TensorBatch to have them dropped)."""
    ordered = [_dp_cut(layout, d, results[r], state)
               for d, r in enumerate(sorted(results, key=layout.dp_rank))]
    if not ordered or not all(isinstance(x, RowOps) for x in ordered):
        return ordered
    return type(ordered[0]).concat(ordered)


for _p in (Protocol(Dispatch.ONE_TO_ALL.value, _one_to_all_split, _by_rank, True),
           Protocol(Dispatch.ALL_TO_ALL.value, _all_to_all_split, _by_rank, True),
           Protocol(Dispatch.RANK_ZERO.value, _rank_zero_split, _rank_zero_collect, True),
           Protocol(Dispatch.DP.value, _dp_split, _dp_collect, True, _dp_collect_encoded)):
    _PROTOCOLS[_p.name] = _p
