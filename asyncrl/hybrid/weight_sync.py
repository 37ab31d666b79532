"""Weights as a TensorBatch, so that a sync is one data-plane transfer, with no copy at
either end beyond the transfer itself (on CPUs).

    trainer rank 0: each parameter, whole (gathered when sharded), as a column of a one-row
                    TensorBatch: views, no packing copy; meta: shapes, version
    rollout ranks:  pull it (the controller sends one command per group; the data plane
                    writes every column into one pooled shared-memory segment on a host,
                    or over TCP) ──unpack──▶ views ──▶ engine.adopt_weights (no copy either)

Views of live parameters must not change while a rollout pulls them: `SyncSource` counts
the packs still held (in the object store, until every consumer pulled and the controller
released them) and the trainer waits for none before its next optimizer step.

On a GPU the parameters are copied into flat buckets of about FLAT_BYTES instead, one per
device and dtype, each parameter dropped once copied (a copy of the weights while the pack is
held, and of at most a bucket more while packing; the wait above then bounds the packs held
to one): CUDA IPC and NCCL cost per column (an IPC export and a mapping each). On an H200 a
pack of one column per parameter moved llama-100m's weights at 17% of one column's speed
(10.9 against 63 GiB/s), flat buckets (copied parameter by parameter, an earlier form of
this code) at 54% (31.8 GiB/s).

Small parameters sharded over several ranks (up to SMALL_BYTES) are gathered together, one
all_gather per bucket (`asyncrl.hybrid.gather`) into one flat buffer whose views are the
pack's columns; large ones one by one, each straight into its own tensor. Each row-sharded
gather's buffers are made first, every rank agreeing they were: an out-of-memory on one
fails all at once, none left in an all_gather (rank 0, which alone holds the pack, runs out
first). A TP weight (a 2-D mesh's) is gathered by DTensor's full_tensor(), unagreed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from asyncrl.actors.protocols import (
    Layout,
    Split,
    _one_to_all_split,
    _rank_zero_collect,
    register_protocol,
)
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.engine import agree
from asyncrl.hybrid.gather import (
    Gatherer,
    attempt,
    full,
    gather_rows,
    plan_gather,
    row_sharded,
    rows_buffers,
)


def _every_rank_zero_answers(layout: Layout, args: tuple, kwargs: dict) -> Split:
    split = _one_to_all_split(layout, args, kwargs)
    split.collect = [0]
    return split


# Every rank runs (the weights are gathered by a collective); only rank 0's result is kept
# and returned: the other ranks hold nothing afterwards.
GATHER_TO_ZERO = register_protocol("gather_to_zero", split=_every_rank_zero_answers,
                                   collect=_rank_zero_collect)
# Every rank runs and answers (the call is done when all are: e.g. all loaded new weights);
# rank 0's answer is the value.
ALL_RANKS = register_protocol("all_ranks_rank_zero_value", split=_one_to_all_split,
                              collect=_rank_zero_collect)


class SyncSource:
    """Packs weights for rollout groups and knows when no pack is held any more."""

    def __init__(self) -> None:
        self._held = 0
        self._cond = threading.Condition()

    def _dropped(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def pack(self, named: Iterable[tuple[str, Any]], version: int,
             flat: bool | None = None) -> TensorBatch:
        """The weights as a one-row TensorBatch: a column per parameter (views), or, `flat`
        (by default where the first is on a GPU), flat buckets of their copies; `named` is
        read once, in order (a generator lets each gathered parameter go once copied), to
        its end where packing fails (its gathers are collectives the other ranks run)."""
        named = iter(named)
        try:
            return self._pack(named, version, flat)
        except BaseException as e:  # noqa: BLE001 - raised below, once `named` is read
            failed = e
            # its frames hold the failed pack's tensors (GBs of buckets on a GPU): freed
            # now, before the gathers below, which would run out of memory again
            traceback.clear_frames(e.__traceback__)
        with contextlib.suppress(Exception):  # (a gather failing now: on every rank)
            for _ in named:
                pass
        raise failed

    def _pack(self, named: Iterator[tuple[str, Any]], version: int,
              flat: bool | None) -> TensorBatch:
        shapes: dict[str, list[int]] = {}
        flattener: _Flattener | None = None
        columns: dict[str, torch.Tensor] = {}
        nbytes = 0
        for name, t in named:
            w = full(t)
            if not shapes and (w.is_cuda if flat is None else flat):  # decided by the first
                flattener = _Flattener()
            shapes[name] = list(w.shape)
            nbytes += w.numel() * w.element_size()
            if flattener is not None:
                flattener.add(name, w)
            else:
                columns[name] = w.reshape(1, -1)  # a view when contiguous, as parameters are
            del w, t
        if not shapes:
            raise ValueError("sync_pack: the model has no parameters to send")
        meta: dict[str, Any] = {"shapes": shapes, "version": version, "nbytes": nbytes}
        if flattener is not None:
            columns, meta["flat"] = flattener.finish()
        pack = TensorBatch(columns, meta=meta)
        with self._cond:
            self._held += 1
        # the store drops the pack when the controller releases it (every consumer pulled)
        weakref.finalize(next(iter(columns.values())), self._dropped)
        return pack

    def wait_released(self, timeout: float) -> float:
        """Block until no pack is held (before the weights change); the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._held == 0, timeout):
                raise TimeoutError(
                    f"the weights sent by sync_pack() are still held after {timeout:.0f} s: "
                    f"a rollout group has not pulled them (pass the sync_pack() future to its "
                    f"load_weights, and do not keep the future alive afterwards)")
        return time.perf_counter() - start


SMALL_BYTES = 1 << 20  # sharded parameters up to this size are gathered together


def gathered(named: list[tuple[str, Any]], bucket_bytes: int
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each parameter, gathered as it is asked for (what the caller
    lets go of is freed before the next): a collective, every rank reading all of it, in
    order. The small sharded ones are gathered together, one all_gather per bucket into new
    flat buffers (views of them): a LoRA model's adapters 9x faster than one collective each.
    The rest one by one, each gathered straight into its own tensor (no extra copy), or a
    view of the live parameter where it is whole on this rank. A row-sharded one's gather
    failing on any rank (no room for its buffers) fails that read on every rank."""
    small: dict[torch.dtype, list[Any]] = {}
    for _, p in named:
        if row_sharded(p) and p.numel() * p.element_size() <= SMALL_BYTES:
            small.setdefault(p.dtype, []).append(p)
    views: dict[int, torch.Tensor] = {}
    gatherer, plans = Gatherer(), []

    def prepare() -> None:  # the flat buffers and the gathers' own, before any collective
        for params in small.values():
            flat = _flat(params)
            at = 0
            for p in params:
                views[id(p)] = flat[at:at + p.numel()].view(p.shape)
                at += p.numel()
            plans.append(plan_gather(((p, views[id(p)]) for p in params), bucket_bytes))
            gatherer.reserve(plans[-1])
    # agreed: out of memory on one rank fails every rank here, none waits in an all_gather
    agree(attempt(prepare), "preparing the weights' gathers")
    failed = None
    for plan in plans:  # (each runs its collectives past a failure: no `or` skips one)
        err = attempt(functools.partial(gatherer.run, plan))
        failed = failed or err
    gatherer.free()  # (not held through the large ones' gathers and the packing)
    agree(failed, "gathering the small weights")
    for n, p in named:
        if id(p) in views:
            yield n, views[id(p)]
        elif row_sharded(p):
            yield n, _gather_large(n, p)
        else:  # (whole here: no collective; else TP's or a 2-D mesh's, by DTensor)
            yield n, full(p)


def _gather_large(name: str, param: Any) -> torch.Tensor:
    """A large row-sharded parameter whole: its buffers made first, every rank agreeing they
    were (one small all_reduce)."""
    made: list[tuple[torch.Tensor, torch.Tensor]] = []
    agree(attempt(lambda: made.append(rows_buffers(param))), f"gathering weight {name!r}")
    return gather_rows(param, *made.pop())


def _flat(params: list[Any]) -> torch.Tensor:
    """One flat tensor for `params` (of one dtype, on one device) side by side."""
    return torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)


FLAT_BYTES = 256 << 20  # a flat pack's buckets: parameters together up to about this size
FLAT_ALIGN = 16  # bytes: each parameter's offset in its bucket (vectorised kernels read it)


class _Flattener:
    """Parameters into flat buckets of one device and dtype each, a concatenation (one
    kernel) per bucket once it is full: at most a bucket's parameters wait, held, at a time."""

    def __init__(self) -> None:
        self.columns: dict[str, torch.Tensor] = {}
        self.placed: dict[str, list[Any]] = {}  # name -> [bucket key, element offset]
        self._open: dict[tuple[torch.device, torch.dtype], list[Any]] = {}  # key, parts, size

    def add(self, name: str, w: torch.Tensor) -> None:
        kind, nbytes = (w.device, w.dtype), w.numel() * w.element_size()
        bucket = self._open.get(kind)
        if bucket is not None and bucket[2] and bucket[2] + nbytes > FLAT_BYTES:
            self._close(kind)
            bucket = None
        if bucket is None:
            bucket = self._open[kind] = [f"flat.{len(self.columns)}", [], 0]
            self.columns[bucket[0]] = torch.empty(0)  # its place in the order, filled later
        key, parts, size = bucket
        pad = -(size // w.element_size()) % max(1, FLAT_ALIGN // w.element_size())
        if pad:
            parts.append(torch.empty(pad, dtype=w.dtype, device=w.device))
        self.placed[name] = [key, size // w.element_size() + pad]
        parts.append(w.reshape(-1))
        bucket[2] = size + pad * w.element_size() + nbytes

    def _close(self, kind: tuple[torch.device, torch.dtype]) -> None:
        key, parts, _ = self._open.pop(kind)
        self.columns[key] = torch.cat(parts).view(1, -1)
        parts.clear()  # the parameters copied: theirs to free

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        for kind in list(self._open):
            self._close(kind)
        return self.columns, self.placed


def unpack(pack: TensorBatch) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a pulled pack."""
    flat = pack.meta.get("flat", {})
    for name, shape in pack.meta["shapes"].items():
        if name not in flat:
            yield name, pack.tensor(name).view(shape)
            continue
        key, offset = flat[name]
        bucket, numel = pack.tensor(key).view(-1), math.prod(shape)
        if not 0 <= offset <= offset + numel <= bucket.numel():
            raise ValueError(f"weight pack: parameter {name!r} ({numel} values from {offset}) "
                             f"lies outside its bucket {key!r} of {bucket.numel()} values")
        yield name, bucket[offset:offset + numel].view(shape)


def version_of(pack: TensorBatch) -> int:
    return int(pack.meta["version"])
