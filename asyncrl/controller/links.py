"""NCCL links between groups, set up by the controller the first time a call needs one.

A call of group B whose input is a result of group A, with GPU columns that cross hosts (or
any tensor columns under `Controller(transport="nccl")`), needs a communicator in which A's
ranks send and B's ranks receive. A's rank 0 makes a unique id; the controller calls the built-in
concurrent method `Worker._nccl_join` on every rank of both groups (they join together;
A's ranks are 0..|A|-1, B's follow), within the transfer timeout. The link is kept for that
pair of running groups; a call that failed while using it drops it (its ranks may have
aborted their ends), and a group that is respawned gets new links.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from asyncrl.controller.placement import PlacementError
from asyncrl.errors import TransferTimeout

if TYPE_CHECKING:
    from asyncrl.controller.group import GroupHandle


class Links:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self._made: dict[str, tuple[GroupHandle, GroupHandle]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.setups = 0  # communicators made

    @staticmethod
    def key(producer: GroupHandle, consumer: GroupHandle) -> str:
        return f"{producer.name}->{consumer.name}"

    def needed(self, ref: Any, consumer: GroupHandle, transport: str) -> bool:
        """Whether the consumer's ranks pull some of `ref`'s columns by NCCL."""
        if ref.group is consumer:
            return False
        hosts = {info.host for info in consumer.ranks.values()}
        for shard, schema in ref.parts():
            for col in schema.columns:
                if col.dtype == "list":
                    continue
                if transport == "nccl" or (col.device == "cuda" and hosts != {shard.host}):
                    return True
        return False

    async def ensure(self, producer: GroupHandle, consumer: GroupHandle) -> str:
        """The key of the producer -> consumer link, set up if this pair has none."""
        key = self.key(producer, consumer)
        async with self._locks.setdefault(key, asyncio.Lock()):
            made = self._made.get(key)
            if made is not None and made[0] is producer and made[1] is consumer:
                return key
            _check_gpus(producer, consumer)
            try:
                uid = await asyncio.wait_for(producer.call("_nccl_unique_id"), self.timeout)
            except asyncio.TimeoutError:
                raise TransferTimeout(f"rank 0 of group {producer.name!r} did not make an "
                                      f"NCCL unique id within {self.timeout:g} s "
                                      f"(transfer_timeout)") from None
            offsets = {producer.name: 0, consumer.name: producer.nprocs}
            world = producer.nprocs + consumer.nprocs
            joins = [g.call("_nccl_join", key, uid, world, offsets)
                     for g in (producer, consumer)]
            try:
                await asyncio.wait_for(asyncio.gather(*joins), self.timeout)
            except asyncio.TimeoutError:
                raise TransferTimeout(
                    f"setting up NCCL between groups {producer.name!r} and {consumer.name!r}"
                    f" ({world} ranks) took longer than {self.timeout:g} s (transfer_timeout)"
                ) from None
            self._made[key] = (producer, consumer)
            self.setups += 1
            return key

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self._made.pop(key, None)


def _check_gpus(producer: GroupHandle, consumer: GroupHandle) -> None:
    """NCCL refuses a communicator with two ranks on one GPU: say so before trying."""
    seen: dict[str, str] = {}
    for group in (producer, consumer):
        for rank, info in sorted(group.ranks.items()):
            if not info.gpu:
                continue
            first = seen.setdefault(info.gpu, f"{group.name}:{rank}")
            if first != f"{group.name}:{rank}":
                raise PlacementError(
                    f"NCCL between groups {producer.name!r} and {consumer.name!r}: ranks "
                    f"{first} and {group.name}:{rank} are on the same GPU ({info.gpu}), and "
                    f"NCCL refuses two ranks of one communicator on one GPU; place the groups "
                    f"apart (separate_from), or on one host leave Controller(transport='auto') "
                    f"(CUDA IPC)")
