"""The optimizer step of the training backends: AdamW, with weight decay on the matrices
only (not on norms' gains or biases, as OpenRLHF and transformers' Trainer decay), a warmup
then constant, cosine or linear lr by optimizer steps (both backends), the clipping of
gradients sharded over several meshes (FSDP2's; DeepSpeed clips its own), and a step's
statistics averaged over the ranks, which must agree on their keys."""

from __future__ import annotations

import functools
import math
import weakref
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from asyncrl.hybrid.fsdp import TrainConfig

# which of an optimizer's parameter groups `adamw` made to decay (ZeRO replaces the groups'
# parameters by flat partitions, which no longer say their shapes)
_DECAYED: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[bool]] = \
    weakref.WeakKeyDictionary()


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The multiplier of `cfg.lr` at optimizer step `step` (from 0), as transformers'
    get_{constant,cosine,linear}_schedule_with_warmup (verl's) define it (the first warmup
    step at 0), with a floor of min_lr_ratio for the decays, held after total_steps (where
    transformers' cosine rises again). A constant schedule has no floor."""
    if step < cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" \
        else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def adamw(params: Any, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with its fused kernel where the parameters' device has one (CPU, CUDA). On CPU
    torch otherwise picks its per-tensor loop: 8x slower for a tiny model, 7x for ~100M.
    Two parameter groups (an empty one left out): the matrices (ndim >= 2: projections,
    embeddings, LoRA's factors) with `cfg.weight_decay`, the rest (norms' gains, biases) with
    none, which would otherwise pull an RMSNorm's gain toward 0."""
    params = list(params)
    if not params:  # (torch takes an empty group and steps nothing, unsaid)
        raise ValueError("the trainer has no parameters to train (every one frozen): unfreeze "
                         "some, or give a LoRA config whose target modules the model has")
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    groups = [{"params": [p for p in params if (p.ndim >= 2) == decayed],
               "weight_decay": cfg.weight_decay if decayed else 0.0} for decayed in (True, False)]
    kept = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(kept, lr=cfg.lr, fused=fused or None)
    _DECAYED[opt] = [g is groups[0] for g in kept]
    return opt


def lr_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> Any:
    """A LambdaLR of `lr_factor`; stepped after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg))


def resume_schedule(sched: Any, opt: torch.optim.Optimizer, cfg: TrainConfig, steps: int) -> None:
    """Put a loaded trainer's schedule at `steps` optimizer steps, with this config's lr and
    weight decay (a resumed run may change them: the optimizer's state dict brought back the
    saved ones; both backends then agree), the decay on the group `adamw` made to decay."""
    decayed = _DECAYED.get(opt, [True] * len(opt.param_groups))
    sched.last_epoch = steps
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    for group, decays in zip(opt.param_groups, decayed, strict=True):
        group["lr"] = cfg.lr * lr_factor(cfg, steps)
        group["weight_decay"] = cfg.weight_decay if decays else 0.0
    sched._last_lr = [group["lr"] for group in opt.param_groups]


def clip_grad_norm(params: Any, max_norm: float | None) -> float:
    """Clip the global gradient norm of parameters that may live on different meshes (FSDP
    on dp, FSDP+TP on (dp, tp)): a norm per mesh, combined, then one scale for all."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    total_sq = 0.0
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += float(norm) ** 2
    total = total_sq ** 0.5
    if max_norm and total > max_norm:  # 0 or None: no clipping, as DeepSpeed reads it
        scale = max_norm / (total + 1e-6)
        for group in by_mesh.values():  # one foreach op per mesh, not one op per tensor
            torch._foreach_mul_(group, scale)
    return total


def rank_means(sums: dict[str, float], group: Any) -> dict[str, float]:
    """Each statistic's mean over the ranks of `group` (one all-reduce of all of them), the
    ranks agreed on which there are (`agree_keys`: a loss's keys that depend on its data
    would sum one rank's "a" with another's "b", or hang NCCL with vectors of other
    lengths)."""
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    size = dist.get_world_size(group)
    return {k: float(v) / size for k, v in zip(keys, totals, strict=True)}


def agree_keys(names: Any, group: Any) -> list[str]:
    """`names` sorted, the same on every rank of `group`, or a ValueError on every rank."""
    keys = sorted(set(names))
    digest = float(zlib.crc32("\0".join(keys).encode()))
    seen = torch.tensor([digest, -digest], dtype=torch.float64)  # the largest, the smallest
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if seen[0] != -seen[1]:  # (every rank sees it: all of them raise)
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, keys, group=group)
        raise ValueError(f"the loss's statistics have other keys on other ranks ("
                         f"{', '.join(f'rank {r}: {k}' for r, k in enumerate(every))}): a "
                         f"LossFn's stats must have the same keys on every rank (report 0.0 "
                         f"where a statistic has nothing to measure, e.g. no masked token)")
    return keys
