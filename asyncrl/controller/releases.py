"""Releases: frees objects on the ranks that own them once no ObjectRef names them.

ObjectRefs die on any thread (GC); their releases are gathered per loop turn and sent as
one Release per rank, or one for the whole group when every rank holds the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.comm import messages
from asyncrl.comm.messages import Release

if TYPE_CHECKING:
    from asyncrl.controller.controller import Controller
    from asyncrl.controller.group import GroupHandle


class Releases:
    def __init__(self, ctl: Controller):
        self._ctl = ctl
        self._pending: dict[GroupHandle, dict[int, list[int]]] = {}  # obj id -> owner ranks

    def later(self, group: GroupHandle, ranks: list[int], obj_id: int) -> None:
        """An ObjectRef is gone (GC, any thread): free its parts, batched per loop turn."""
        try:
            self._ctl.loop.call_soon_threadsafe(self.queue, group, ranks, obj_id)
        except RuntimeError:  # the loop is closed: the ranks are gone with it
            pass

    def queue(self, group: GroupHandle, ranks: list[int], obj_id: int) -> None:
        """Free `obj_id` on `ranks` at the end of this loop turn (on the loop)."""
        if not self._pending:
            self._ctl.loop.call_soon(self.flush)
        self._pending.setdefault(group, {})[obj_id] = ranks

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        box = self._ctl.outbox()
        for group, owners in pending.items():
            if group.closing or group.dead is not None:
                continue
            # objects every rank holds: one message for all
            everywhere: list[int] = []
            by_rank: dict[int, list[int]] = {}
            for obj_id, ranks in owners.items():
                if len(ranks) == group.nprocs:
                    everywhere.append(obj_id)
                else:
                    for rank in ranks:
                        by_rank.setdefault(rank, []).append(obj_id)
            if everywhere:
                group.post_all(box, "io", messages.encode(Release(everywhere)))
            for rank, ids in by_rank.items():
                box.put(group.ranks[rank].identity, messages.encode(Release(ids)))
        box.flush()
