"""NCCL links between groups, set up by the controller the first time a call needs one.

A call of group B whose input is a result of group A, with GPU columns that cross hosts or
GPUs (or any tensor columns under `Controller(transport="nccl")`), needs a communicator in which A's
ranks send and B's ranks receive. A's rank 0 makes a unique id; the controller calls the built-in
concurrent method `Worker._nccl_join` on every rank of both groups (they join together;
A's ranks are 0..|A|-1, B's follow), within the transfer timeout. The link is kept for that
pair of running groups. A rank that aborted its end (a transfer past the timeout, a pull
that failed) names it in its error reply, with the unique id it was made from: that making
of the link is dropped and set up again for the next call; a failed call's other links are
kept (a new communicator would abort the old one under calls still receiving on it). A group
that is respawned gets new links.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from asyncrl.controller.placement import PlacementError
from asyncrl.errors import RemoteError, TransferTimeout

if TYPE_CHECKING:
    from asyncrl.controller.group import GroupHandle

log = logging.getLogger("asyncrl")


class Links:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self._made: dict[str, tuple[GroupHandle, GroupHandle, bytes]] = {}  # with the uid
        self._locks: dict[str, asyncio.Lock] = {}
        # one set-up at a time in the job: a rank's NCCL groups hold a lock of its process
        # (NCCL's thread safety), and a set-up's groupEnd waits there for the peer ranks to
        # connect: A->B and B->A set up at once would each hold one end's lock, waiting for
        # the other's (until the transfer timeout aborted both)
        self._setting_up = asyncio.Lock()
        self.setups = 0  # communicators made
        self._without: set[str] = set()  # pairs where a group has no NCCL: host memory

    @staticmethod
    def key(producer: GroupHandle, consumer: GroupHandle) -> str:
        return f"{producer.name}->{consumer.name}"

    def needed(self, ref: Any, consumer: GroupHandle, transport: str) -> bool:
        """Whether the consumer's ranks pull some of `ref`'s columns by NCCL: every tensor
        column under transport="nccl"; GPU columns from another host, or from a GPU the
        consumer's ranks do not have (groups placed apart on one host: CUDA IPC cannot
        open it). Groups that share a GPU cannot have a communicator: their GPU columns go
        through host memory instead."""
        if ref.group is consumer or transport == "tcp":
            return False
        if transport == "nccl":
            return any(col.dtype != "list" for _, schema in ref.parts()
                       for col in schema.columns)
        hosts = {info.host for info in consumer.ranks.values()}
        gpus = {info.gpu for info in consumer.ranks.values()}
        if {(i.host, i.gpu) for i in consumer.ranks.values() if i.gpu} & \
                {(i.host, i.gpu) for i in ref.group.ranks.values()}:
            return False
        return any(col.device == "cuda" and (hosts != {shard.host} or shard.gpu not in gpus)
                   for shard, schema in ref.parts() for col in schema.columns)

    async def ensure(self, producer: GroupHandle, consumer: GroupHandle,
                     required: bool = False) -> str | None:
        """The key of the producer -> consumer link, set up if this pair has none. None: a
        group has no NCCL through CuPy (unless `required`: then that ImportError)."""
        key = self.key(producer, consumer)
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key in self._without and not required:
                return None
            made = self._made.get(key)
            if made is not None and made[0] is producer and made[1] is consumer:
                return key
            _check_gpus(producer, consumer)
            async with self._setting_up:  # (a link made already goes by at once)
                return await self._set_up(key, producer, consumer, required)

    async def _set_up(self, key: str, producer: GroupHandle, consumer: GroupHandle,
                      required: bool) -> str | None:
        try:  # both ends must have NCCL through CuPy; the producer's rank 0 makes the id
            uid, _ = await asyncio.wait_for(asyncio.gather(
                producer.call("_nccl_unique_id"), consumer.call("_nccl_unique_id", False)),
                self.timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"rank 0 of groups {producer.name!r} and "
                                  f"{consumer.name!r} did not answer whether they have NCCL "
                                  f"within {self.timeout:g} s (transfer_timeout)") from None
        except RemoteError as e:
            if e.exc_type != "ImportError" or required:
                raise
            log.warning("asyncrl: GPU rows from group %r to group %r go through host "
                        "memory: %s", producer.name, consumer.name, e.remote_message)
            self._without.add(key)
            return None
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
        self._made[key] = (producer, consumer, uid)
        self.setups += 1
        return key

    def aborted(self, ends: dict[str, bytes]) -> None:
        """A rank aborted its ends of these links (key -> the uid they were made from):
        drop them, unless they were set up again since."""
        for key, uid in ends.items():
            made = self._made.get(key)
            if made is not None and made[2] == uid:
                del self._made[key]


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
