"""A DataFlow's inputs: one item per step from each iterable, a constant as it is, and where
each iterable is, for checkpoints.

    positions()  ──▶ meta.json   a source with state_dict() (a PromptSource): its own state;
                                 any other: {"consumed": n, "item": digest of item n,
                                 made as it was read: a node may change it in place}
    resume_at()  ◀── meta.json   load_state_dict(), or n items skipped and the n-th checked
                                 against its digest: a source whose order changes from run
                                 to run (a set of strings, a shuffle without a seed) would
                                 otherwise repeat some items and never give others
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from asyncrl.actors.worker import rng_state, set_rng_state
from asyncrl.controller.nodes import FlowError
from asyncrl.errors import CheckpointError

log = logging.getLogger("asyncrl")


class Inputs:
    def __init__(self, sources: dict[str, Any]):
        self.sources = sources
        self._iters: dict[str, Iterator[Any] | None] = {}
        self.consumed: dict[str, int] = {}  # items taken from each iterable, the whole run
        # the digest of the last item taken (skip-count sources), made as it is read: a node
        # may change its item in place (a DataLoader's dict batch) before a checkpoint
        self._last: dict[str, str | None] = {}
        self.ended: str | None = None  # the input whose end ended the run, if one did
        # the last step's items, the restorable sources' states before them and _last
        # before them: unread() puts them back
        self._read: tuple[dict[str, Any], list[tuple[str, Any, Any]],
                          dict[str, str | None]] | None = None
        # the random state the inputs were first opened in (the process's RNGs, the
        # generators the sources shuffle with): a rewind opens them in it again
        self._opened: tuple[dict[str, Any], list[tuple[Any, Any]]] | None = None

    def reset(self) -> None:
        """Every input from its beginning again (a rewind after a first read), in the order
        it gave the first time: a DataLoader(shuffle=True) draws its order from the global
        RNG or its generator= as it is read, both moved on since (its items would come
        twice or never, and a later checkpoint's digests refuse a resume). The caller sets
        the RNG state the steps go on with (a checkpoint's) after skipping, as a resume."""
        if self._iters:
            self.check_rereadable()
        if self._opened is None:
            gens = {id(g): g for v in self.sources.values() for g in _generators(v)}
            self._opened = (rng_state(), [(g, g.get_state()) for g in gens.values()])
        else:
            set_rng_state(self._opened[0])
            for g, state in self._opened[1]:
                g.set_state(state)
        self._iters = {k: _iterate(k, v) for k, v in self.sources.items()}
        self.consumed = {k: 0 for k, it in self._iters.items() if it is not None}
        self._last, self._read = {}, None

    def release(self) -> None:
        """The flow closed: let go of the iterators that run worker processes (a
        DataLoader's with num_workers > 0): dropped, they end them; held, the workers lived
        as long as the DataFlow (a notebook, a sweep of flows). A DataLoader(persistent_
        workers=True) keeps its own, as meant. What positions() reads stays, and so do the
        other iterators (an open reads from a fresh Inputs)."""
        for name, source in self.sources.items():
            if getattr(source, "num_workers", 0):  # (unread()'s chain wraps one: dropped too)
                self._iters.pop(name, None)

    def check_rereadable(self) -> None:
        for name, source in self.sources.items():
            if isinstance(source, Iterator) and not _restorable(source):  # read once (one
                # with state_dict and load_state_dict goes back to a checkpoint's position)
                raise FlowError(
                    f"input {name!r} is a one-shot iterator (a generator?): it cannot be read "
                    f"again from a checkpoint's position; pass a list, a PromptSource or "
                    f"another re-iterable source")

    def positions(self) -> dict[str, Any]:
        """Where each iterable input is: a copy of its ``state_dict()``, else
        ``{"consumed": n}`` and the digest of its n-th item (JSON, tensors, arrays)."""
        out: dict[str, Any] = {}
        for name, n in self.consumed.items():
            source = self.sources[name]
            if _restorable(source):  # (copied: a source may hand out the dict it moves on)
                out[name] = copy.deepcopy(source.state_dict())
                continue
            out[name] = {"consumed": n}
            digest = self._last.get(name)
            if digest is not None:
                out[name]["item"] = digest
        return out

    def resume_at(self, start: int, positions: dict[str, Any], rewind: bool = False) -> None:
        """The inputs where `positions()` said they were, at step index `start`. `rewind`
        (a recovery in this run, its groups already respawned): an input that gives other
        items there is a warning, not the end of the run."""
        for name in self.consumed:
            source = self.sources[name]
            state = _position(name, source, positions)
            if _restorable(source):
                try:  # (a copy: a source that keeps the dict it is given moves it on, and
                    source.load_state_dict(copy.deepcopy(state))  # a rewind reuses it)
                except ValueError as e:  # another source than the run's (its data, seed)
                    raise CheckpointError(f"input {name!r}: {e}") from e
                self._iters[name] = iter(source)  # a fresh iterator, from that position
                self.consumed[name] = start
                continue
            self._skip(name, state, rewind)

    def check(self, positions: dict[str, Any]) -> None:
        """Refuse, before any group starts, what resume_at would refuse once every group
        loaded its checkpoint: an iterable input with no position (renamed or added since),
        or one of another kind of source; positions that sources which can check one
        (`check_state`: a PromptSource, its records, seed and shuffle) say were saved for
        other data, and those a re-iterable source (a list) no longer reaches or gives
        another item at (skipped on an iterator of its own: resume_at skips again)."""
        for name, source in self.sources.items():
            if not _iterable(source):  # (a constant: read whole each step, no position)
                continue
            state = _position(name, source, positions)
            if hasattr(source, "check_state"):
                try:
                    source.check_state(state)
                except ValueError as e:
                    raise CheckpointError(f"input {name!r}: {e}") from e
            elif isinstance(source, Sequence) and not _restorable(source):  # (a list, a
                # range: read again alike; a DataLoader that shuffles on each pass would give
                # the resume another order than this check saw)
                it = _iterate(name, source)  # (not a one-shot iterator's: the run reads it once)
                if it is not None:
                    _skipped(name, it, state, rewind=False)

    def _skip(self, name: str, state: dict[str, Any], rewind: bool) -> None:
        it = self._iters[name]
        assert it is not None
        source = self.sources[name]
        listed = type(source).__name__ if isinstance(source, Sequence) else None
        last = _skipped(name, it, state, rewind, listed)
        if state["consumed"]:  # (none taken: no item to digest at the next checkpoint)
            self._last[name] = _digest(last)
        self.consumed[name] = state["consumed"]

    def next(self) -> dict[str, Any] | None:
        """One step's values, or None when an input has run out (`ended` names it)."""
        values = {}
        # with several iterable inputs, one may end after the ones before it gave this step's
        # item: those are put back where they were, or the run's last checkpoint would save
        # them one item past what its steps used (a resumed run would skip it); so may the
        # step's node (unread)
        taken: list[tuple[str, Any, Any]] = []
        for name, it in self._iters.items():
            if it is None:
                values[name] = self.sources[name]
                continue
            source = self.sources[name]
            before = copy.deepcopy(source.state_dict()) if _restorable(source) else None
            try:
                values[name] = next(it)
            except StopIteration:
                self._restore(taken)
                self.ended = name
                return None
            if before is not None:
                taken.append((name, source, before))
        self._read = (values, taken, dict(self._last))
        for name in self.consumed:  # only for a step that runs (checkpoints save these)
            self.consumed[name] += 1
            if not _restorable(self.sources[name]):
                self._last[name] = _digest(values[name])
        return values

    def unread(self) -> None:
        """Put the last step's items back (its node's own inputs ran out: it did not run):
        positions() then says where the steps that ran left the inputs, and a resume, or
        the next step, reads those items again."""
        if self._read is None:
            return
        (values, taken, self._last), self._read = self._read, None
        self._restore(taken)
        for name in self.consumed:
            self.consumed[name] -= 1
            it = self._iters[name]
            if not _restorable(self.sources[name]) and it is not None:
                self._iters[name] = itertools.chain([values[name]], it)

    def _restore(self, taken: list[tuple[str, Any, Any]]) -> None:
        for key, source, state in taken:  # (a fresh iterator: from that position)
            source.load_state_dict(state)
            self._iters[key] = iter(source)


def _position(name: str, source: Any, positions: dict[str, Any]) -> Any:
    """Iterable input `name`'s position in `positions`, checked to be there (an input
    renamed or added since has none) and to be of `source`'s kind: a count of items for a
    source without load_state_dict(), and a state for one with it."""
    if name not in positions:
        raise CheckpointError(
            f"the checkpoint saved no position for input {name!r} (it has "
            f"{sorted(positions)}); resume with the flow that wrote it")
    state = positions[name]
    if not _restorable(source) and not (isinstance(state, dict) and "consumed" in state):
        raise CheckpointError(
            f"input {name!r} was saved as {state}, a position for a source with "
            f"load_state_dict(); this one has none: resume with the same input source")
    if _restorable(source) and _counted(state) and not _counted(source.state_dict()):
        raise CheckpointError(  # (a source whose own state looks so is left to load it)
            f"input {name!r} was saved as {state}, the count of items read from a source "
            f"without load_state_dict() (a list); this one has load_state_dict(): resume "
            f"with the same input source")
    return state


def _counted(state: Any) -> bool:
    """`state` is what positions() saves for a source without load_state_dict()."""
    return isinstance(state, dict) and "consumed" in state and \
        set(state) <= {"consumed", "item"}


def _skipped(name: str, it: Iterator[Any], state: dict[str, Any], rewind: bool,
             listed: str | None = None) -> Any:
    """The last of the `state["consumed"]` items taken from `it` (None: none), checked
    against the digest `state` saved of it. `listed`: the type of the source where it is a
    list (or another sequence), which gives the same objects each time it is read."""
    last, wanted = None, state["consumed"]
    for taken in range(wanted):
        try:
            last = next(it)
        except StopIteration:
            raise CheckpointError(
                f"input {name!r} ended after {taken} items, but the checkpoint had "
                f"consumed {wanted}; resume with the same input data") from None
    if "item" not in state or _digest(last) == state["item"]:
        return last
    if rewind and listed:  # (the digest was made as the item was read, before its node ran)
        log.warning("asyncrl: input %r gives another item at position %d than before the "
                    "rewind, though it is a %s: a node likely changed that item in place "
                    "(the %s holds the object the node was given), so the steps run again "
                    "see the changed data; copy the item in the node before changing it "
                    "(copy.deepcopy)", name, wanted, listed, listed)
        return last
    if rewind:
        log.warning("asyncrl: input %r gives another item at position %d than before the "
                    "rewind (its order changes each time it is read): the steps run again "
                    "see other data; use a list, a seeded shuffle or a PromptSource",
                    name, wanted)
        return last
    raise CheckpointError(
        f"input {name!r} gave another item at position {wanted} than the run that "
        f"saved the checkpoint: its order changes from run to run (a set, a shuffle "
        f"without a fixed seed), or its data changed, and skipping {wanted} items "
        f"would repeat some and never give others; pass a list (or shuffle with a "
        f"fixed seed: DataLoader(..., shuffle=True, "
        f"generator=torch.Generator().manual_seed(n))), or a source with "
        f"state_dict()/load_state_dict() (a PromptSource)")


def _restorable(source: Any) -> bool:
    """A source that says where it is (`state_dict`) and goes back there (`load_state_dict`);
    others are counted (a position only one of them, saved, could not be resumed from)."""
    return hasattr(source, "state_dict") and hasattr(source, "load_state_dict")


def _generators(source: Any) -> list[Any]:
    """The torch.Generators a counted source (a DataLoader, its sampler) shuffles with."""
    import torch

    if _restorable(source) or not _iterable(source):
        return []
    holders = (source, getattr(source, "sampler", None),
               getattr(getattr(source, "batch_sampler", None), "sampler", None))
    return [g for h in holders if isinstance(g := getattr(h, "generator", None), torch.Generator)]


def _iterate(name: str, source: Any) -> Iterator[Any] | None:
    """An iterator over a source, or None for a constant."""
    if not _iterable(source):
        return None
    try:
        return iter(source)
    except TypeError as e:  # (Iterable says only that it has __iter__)
        raise FlowError(f"input {name!r}: a {type(source).__name__} has __iter__ but cannot "
                        f"be iterated ({e}); pass an iterable that gives one item a "
                        f"step, or a constant that has no __iter__") from e


def _iterable(source: Any) -> bool:
    """Read an item a step (not a constant: strings, dicts, TensorBatches, 0-d tensors and
    arrays... are constants)."""
    if isinstance(source, (str, bytes, dict)) or not isinstance(source, Iterable) \
            or getattr(source, "ndim", None) == 0:  # (iter() of one raises TypeError)
        return False
    from asyncrl.comm.batch import TensorBatch

    return not isinstance(source, TensorBatch)


def _digest(item: Any) -> str | None:
    """A short digest of an item: of its JSON text, else of the tensors and arrays in it (a
    DataLoader's batch: their dtypes, shapes and bytes, through dicts, lists, tuples and
    TensorBatch columns); None for anything else (not checked)."""
    try:
        text = json.dumps(item, sort_keys=True)
    except (TypeError, ValueError):
        tensors = hashlib.sha256(b"tensors\0")
        return tensors.hexdigest()[:16] if _hash_into(tensors, item) else None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hash_into(hasher: Any, item: Any) -> bool:
    """Feed `item` to `hasher`, the same in every process; False where part of it has no
    bytes of its own (an object, a numpy array of objects, a sparse tensor)."""
    import numpy as np
    import torch

    from asyncrl.comm.batch import TensorBatch

    if isinstance(item, TensorBatch):
        item = item.to_dict()
    if isinstance(item, torch.Tensor):
        values = _tensor_bytes(item)
        if values is None:
            return False
        hasher.update(f"tensor {item.dtype} {tuple(item.shape)}\0".encode() + values)
        return True
    if isinstance(item, np.ndarray | np.generic):
        array = np.asarray(item)
        if array.dtype.hasobject:  # (its bytes are addresses)
            return False
        hasher.update(f"array {array.dtype.str} {array.shape}\0".encode())
        hasher.update(np.ascontiguousarray(array).tobytes())
        return True
    if isinstance(item, dict):
        hasher.update(f"dict {len(item)}\0".encode())
        return all(_hash_into(hasher, k) and _hash_into(hasher, v)
                   for k, v in sorted(item.items(), key=lambda kv: repr(kv[0])))
    if isinstance(item, list | tuple):
        hasher.update(f"{type(item).__name__} {len(item)}\0".encode())
        return all(_hash_into(hasher, v) for v in item)
    try:
        hasher.update(json.dumps(item).encode() + b"\0")
    except (TypeError, ValueError):
        return False
    return True


def _tensor_bytes(t: Any) -> bytes | None:
    """A dense tensor's values as bytes (bf16's too, which numpy lacks), wherever it is;
    None for one whose bytes are not its values (sparse, quantized, meta, a subclass)."""
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided \
            or t.is_quantized or t.is_meta:
        return None
    flat = torch.empty(t.numel(), dtype=t.dtype)  # (stride 1, on the CPU: a view of it as
    flat.copy_(t.detach().reshape(-1))  # bytes is its values)
    return bytes(flat.view(torch.uint8).numpy())
