"""Sharded parameters gathered whole into given tensors, bucket by bucket: one all_gather per
~`bucket_bytes` of row-sharded parameters (FSDP2 alone) through reused buffers (warm memory);
DeepSpeed ZeRO-3's in groups of ~`bucket_bytes` (one coalesced all_gather each, in place);
those of a one-rank mesh (whole on their rank) by one multi-tensor copy; the rest (TP's
DTensors, unsharded ones) one by one. The hybrid engine gathers into its
engine's weights; a weight sync into the pack it sends.

    plan = plan_gather([(param, target), ...], bucket_bytes)   # once: the shards stay put
    gatherer.run(plan)                                          # each time
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

# one collective into one flat tensor (renamed all_gather_single in newer torch releases)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def full(param: Any) -> torch.Tensor:
    """A parameter as one tensor, detached: a DTensor gathered (a collective), or its local
    tensor on a one-rank mesh (a view of the live parameter)."""
    if not hasattr(param, "full_tensor"):
        return param.detach()
    if whole_here(param):  # (a DTensor's own detach costs ~10x a tensor's)
        return param.to_local().detach()
    return param.detach().full_tensor()


def rows_buffers(param: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What a row-sharded parameter's all_gather (`gather_rows`) needs, made apart from it
    (out of memory here, not with the peers in the collective): the output, ceil(rows /
    ranks) rows from each rank (the parameter, then the last ranks' padding), and this
    rank's shard, flat, padded to that width (in a new tensor) where it falls short."""
    world, rows = param.device_mesh.size(), param.shape[0]
    width = -(-rows // world) * (param.numel() // max(1, rows))
    shard = param.to_local().detach().reshape(-1)
    if shard.numel() < width:
        shard = torch.cat([shard, shard.new_zeros(width - shard.numel())])
    return torch.empty(width * world, dtype=param.dtype, device=param.device), shard


def gather_rows(param: Any, out: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """A row-sharded parameter whole: gathered straight into `out` (`rows_buffers`), a view
    of it (the padding all after the real rows: torch.chunk's shards)."""
    _all_gather(out, shard, group=param.device_mesh.get_group())
    return out[:param.numel()].view(param.shape)


def whole_here(p: Any) -> bool:
    """A DTensor on a one-rank mesh: its local tensor is the whole parameter."""
    return hasattr(p, "device_mesh") and p.device_mesh.size() == 1


def row_sharded(p: Any) -> bool:
    """A DTensor sharded by rows over a 1-D mesh of several ranks (FSDP without TP) on the
    CPU or a GPU."""
    from torch.distributed.tensor import Shard

    placements = getattr(p, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0] == Shard(0) \
        and p.dim() >= 1 and not whole_here(p)


class Bucket:
    """Row-sharded parameters gathered by one collective. Each rank's shard takes
    ceil(rows / ranks) rows in the buffer (rank r holds rows [r*per, (r+1)*per), as
    torch.chunk splits them), so every rank contributes the same width."""

    def __init__(self, mesh: Any, dtype: torch.dtype, device: torch.device):
        self.device, self.mesh = device, mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.items: list[tuple[Any, torch.Tensor, int]] = []  # param, target, offset
        self.width = 0
        self.nbytes = 0
        self.dtype = dtype

    def add(self, param: Any, target: torch.Tensor) -> None:
        per = -(-param.shape[0] // self.world)
        self.items.append((param, target, self.width))
        self.width += per * (param.numel() // max(1, param.shape[0]))
        self.nbytes += param.numel() * param.element_size()


class Local:
    """Parameters whole on their rank (a one-rank mesh): copied by one multi-tensor copy,
    no collective (where a GPU launches one kernel per few dozen tensors, not one each)."""

    def __init__(self) -> None:
        self.params: list[Any] = []
        self.targets: list[torch.Tensor] = []


def plan_gather(pairs: Iterable[tuple[Any, torch.Tensor]], bucket_bytes: int,
                together: bool = False) -> list[Any]:
    """Buckets of the row-sharded parameters in order, one Local of those whole on this
    rank, and groups of [(param, target)] for the rest: one each, or (`together`: the
    Gatherer's `whole` gathers many at once, as DeepSpeed does) up to `bucket_bytes` each."""
    plan: list[Any] = []
    bucket: Bucket | None = None
    local: Local | None = None
    group: list[tuple[Any, torch.Tensor]] | None = None
    group_bytes = 0
    for param, target in pairs:
        if whole_here(param):  # no collective: its place in the order does not matter
            if local is None:
                local = Local()
                plan.append(local)
            local.params.append(param)
            local.targets.append(target)
            continue
        if not row_sharded(param):
            # the parameter's whole size, not its own numel(): a ZeRO-3 partition's is 0
            size = (getattr(param, "ds_numel", 0) or param.numel()) * param.element_size()
            if group is None or not together or group_bytes + size > bucket_bytes:
                group, group_bytes = [], 0
                plan.append(group)
            group.append((param, target))
            group_bytes += size
            continue
        group = None
        if bucket is None or bucket.nbytes >= bucket_bytes or bucket.dtype != param.dtype \
                or bucket.device != param.device or bucket.mesh is not param.device_mesh:
            bucket = Bucket(param.device_mesh, param.dtype, param.device)
            plan.append(bucket)
        bucket.add(param, target)
    return plan


@contextmanager
def whole_each(params: list[Any]) -> Iterator[list[torch.Tensor]]:
    """Each parameter whole, in a new tensor (a DTensor's full_tensor())."""
    yield [full(p) for p in params]


class Gatherer:
    """Runs gather plans through its buffers, sized for the widest bucket it met. `whole`
    makes a group of parameters of no bucket whole for a moment (DeepSpeed ZeRO-3 gathers
    them in place, together); by default each a DTensor's full_tensor()."""

    def __init__(self, whole: Callable[[list[Any]], AbstractContextManager[list[torch.Tensor]]]
                 = whole_each):
        self._whole = whole
        # (dtype, device) -> this rank's staging buffer and the gathered one, each sized for
        # the plan's widest bucket of them: kept for every dtype a plan holds (a LoRA plan's
        # bf16 base and fp32 adapters), reserved before the gathers, reused (warm memory)
        self._buffers_of: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor,
                                                                        torch.Tensor]] = {}
        self.peak_bytes = 0  # the largest gathered tensor alive at once, last run

    @torch.no_grad()
    def run(self, plan: list[Any]) -> None:
        """Gather `plan` into its targets. A failure of this rank's own part (a copy, a
        bucket's staging) does not leave the peers in a collective: past it, this rank still
        takes part in every collective of the plan, copies nothing more, and raises the
        failure after the last one."""
        self.peak_bytes = 0
        failed: BaseException | None = None
        for item in plan:
            if isinstance(item, Bucket):
                failed = self._bucket(item, plan, failed)
            elif isinstance(item, Local):  # (no_grad: to_local's tensors track nothing)
                failed = failed or attempt(functools.partial(
                    torch._foreach_copy_, item.targets, [p.to_local() for p in item.params]))
            else:
                with self._whole([param for param, _ in item]) as wholes:  # one group at a
                    failed = failed or attempt(functools.partial(_copy, item, wholes))  # time
                    self.peak_bytes = max(self.peak_bytes,
                                          sum(w.numel() * w.element_size() for w in wholes))
        if failed is not None:
            raise failed

    def reserve(self, plan: list[Any]) -> None:
        """The buffers of `plan`'s widest buckets, now: out of memory here, not in the midst
        of the gathers (peers in a collective this rank would not reach)."""
        for bucket in plan:
            if isinstance(bucket, Bucket):
                self._buffers(bucket, plan)

    def _buffers(self, bucket: Bucket, plan: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's staging slice and the gathered slice for `bucket`, in the buffers of
        its dtype and device, sized for the plan's widest bucket of them."""
        world, width, kind = bucket.world, bucket.width, (bucket.dtype, bucket.device)
        local, out = self._buffers_of.get(kind, (None, None))
        if local is None or out is None or local.numel() < width or \
                out.numel() < width * world:
            self._buffers_of.pop(kind, None)  # before the new ones: never both alive
            widest = max(b.width for b in plan if isinstance(b, Bucket) and
                         (b.dtype, b.device) == kind)
            local = torch.zeros(widest, dtype=bucket.dtype, device=bucket.device)
            out = torch.empty(widest * world, dtype=bucket.dtype, device=bucket.device)
            self._buffers_of[kind] = (local, out)
        return local[:width], out[:width * world]

    def _bucket(self, bucket: Bucket, plan: list[Any], failed: BaseException | None
                ) -> BaseException | None:
        """One all_gather for the bucket's parameters, then each rank's real rows copied
        straight into the targets; the first failure so far (past one, only the
        all_gather)."""
        local, out = self._buffers(bucket, plan)
        failed = failed or attempt(functools.partial(_stage, bucket, local))
        _all_gather(out, local, group=bucket.group)
        self.peak_bytes = max(self.peak_bytes, out.numel() * out.element_size())
        return failed or attempt(functools.partial(_spread, bucket, out))

    def free(self) -> None:
        self._buffers_of = {}

    @property
    def buffer_bytes(self) -> int:
        """What the buffers hold now."""
        return sum(t.numel() * t.element_size() for pair in self._buffers_of.values()
                   for t in pair)


def _stage(bucket: Bucket, local: torch.Tensor) -> None:
    """This rank's shards of the bucket's parameters, side by side in `local`."""
    for param, _, at in bucket.items:  # (no_grad: to_local's tensor tracks nothing)
        shard = param.to_local().reshape(-1)
        local[at:at + shard.numel()] = shard


def _spread(bucket: Bucket, out: torch.Tensor) -> None:
    """Each rank's real rows of the gathered `out` into the parameters' targets."""
    world, width = bucket.world, bucket.width
    per_rank = out.view(world, width)
    for param, target, at in bucket.items:
        rows = param.shape[0]
        per, row = -(-rows // world), param.numel() // max(1, rows)
        flat = target.view(-1)
        for r in range(world):
            real = max(0, min(per, rows - r * per)) * row
            flat[r * per * row:r * per * row + real].copy_(per_rank[r, at:at + real])


def _copy(group: list[tuple[Any, torch.Tensor]], wholes: list[torch.Tensor]) -> None:
    for (_, target), whole in zip(group, wholes, strict=True):
        target.copy_(whole)


def attempt(step: Callable[[], Any]) -> BaseException | None:
    """What `step()` raised (None: it went through): raised later, once the collectives
    the peers wait in are done (the rest of a plan; engine.agree)."""
    try:
        step()
    except BaseException as e:  # noqa: BLE001 - raised by the caller, after them
        return e
    return None
