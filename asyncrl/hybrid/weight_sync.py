"""Weights as a TensorBatch, so that a sync is one data-plane transfer.

    trainer rank 0: full weights ──pack──▶ TensorBatch {"flat": uint8 [rows, ROW_BYTES]}
                                           meta: names, dtypes, shapes, offsets, version
    rollout ranks:  pull it (the controller sends one command; the data plane moves the rows
                    in ~32 MiB buckets, pipelined: shared memory on a host, TCP else)
                    ──unpack──▶ views into the pulled buffer ──▶ engine.load_weights

Packing reuses its buffers (warm memory: writing into fresh pages costs ~10x here): a buffer
is written again only once the batch made from it has been released everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from asyncrl.actors.protocols import Layout, Split, register_protocol
from asyncrl.comm.batch import TensorBatch

ROW_BYTES = 1 << 20  # rows of 1 MiB: transfers split into buckets along rows
ALIGN = 64  # every tensor starts on a 64-byte boundary, so its view needs no copy


def _every_rank_zero_answers(layout: Layout, args: tuple, kwargs: dict) -> Split:
    ranks = range(layout.world_size)
    return Split({r: (args, kwargs) for r in ranks}, [0])


def _every_rank_answers(layout: Layout, args: tuple, kwargs: dict) -> Split:
    ranks = range(layout.world_size)
    return Split({r: (args, kwargs) for r in ranks}, list(ranks))


def _rank_zero(layout: Layout, results: dict[int, Any], state: Any) -> Any:
    return results[0]


# Every rank runs (the weights are gathered by a collective); only rank 0's result is kept
# and returned: the other ranks hold nothing afterwards.
GATHER_TO_ZERO = register_protocol("gather_to_zero", split=_every_rank_zero_answers,
                                   collect=_rank_zero)
# Every rank runs and answers (the call is done when all are: e.g. all loaded new weights);
# rank 0's answer is the value.
ALL_RANKS = register_protocol("all_ranks_rank_zero_value", split=_every_rank_answers,
                              collect=_rank_zero)


class Packer:
    """Packs named tensors into reused uint8 buffers."""

    def __init__(self) -> None:
        self._packs: list[TensorBatch] = []

    def _free_buffer(self, nbytes: int) -> torch.Tensor | None:
        for pack in self._packs:
            # only this list, the loop variable and getrefcount's argument refer to it: the
            # object store released it, nobody can still be reading it
            flat = pack.tensor("flat")
            if sys.getrefcount(pack) <= 3 and flat.numel() >= nbytes:
                self._packs.remove(pack)
                return flat
        return None

    def pack(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> TensorBatch:
        items = [(name, t.detach()) for name, t in named]
        layout, offset = [], 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            layout.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset,
                           nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        rows = max(1, -(-offset // ROW_BYTES))
        flat = self._free_buffer(rows * ROW_BYTES)
        if flat is None:
            flat = torch.empty((rows, ROW_BYTES), dtype=torch.uint8)
        data = flat.view(-1)
        for (_, _, _, at, nbytes), (_, t) in zip(layout, items, strict=True):
            data[at:at + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        pack = TensorBatch({"flat": flat[:rows] if flat.shape[0] > rows else flat},
                           meta={"weights": layout, "version": version, "nbytes": offset})
        self._packs.append(pack)
        return pack


def unpack(pack: TensorBatch) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a pulled pack, in packing order."""
    data = pack.tensor("flat").reshape(-1)
    for name, dtype, shape, at, nbytes in pack.meta["weights"]:
        yield name, data[at:at + nbytes].view(getattr(torch, dtype)).view(shape)


def version_of(pack: TensorBatch) -> int:
    return int(pack.meta["version"])
