"""Which GPUs a rank of a cluster group uses, decided on its own host.

The controller gives each host's agent slots, GPUs 0..n-1 of that host (ASYNCRL_GPU_SLOTS).
What "GPU 0" is there, the controller cannot tell: SLURM hands a step "4,5,6,7", a user may
set CUDA_VISIBLE_DEVICES on a node. The rank picks its slots out of the CUDA_VISIBLE_DEVICES
it finds at start-up (GPU d is the d-th entry; without one, GPU d), before CUDA reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

GPU_SLOTS = "ASYNCRL_GPU_SLOTS"


def select_gpus(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Turn the agent's slots into this rank's CUDA_VISIBLE_DEVICES (consumed: a process the
    rank starts inherits the result, not the slots to map again). Returns the slots (none:
    not a cluster group's rank, or one on a CPU host)."""
    slots = env.pop(GPU_SLOTS, None)
    if not slots:
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    # (set but empty: this host hides its GPUs from the rank, none to pick)
    ids = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    chosen = []
    for slot in slots.split(","):
        d = int(slot)
        if ids is None:
            chosen.append(slot)
        elif d < len(ids):
            chosen.append(ids[d])
        else:
            raise RuntimeError(
                f"host {env.get('ASYNCRL_HOST_NAME', '?')}: the group was given its GPU {d}, "
                f"but CUDA_VISIBLE_DEVICES={visible} here shows "
                f"{len(ids)}: give the host its real number of GPUs in the hosts file "
                f"(\"gpus\"), or its allocation more")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
    return slots.split(",")


def check_gpus(slots: list[str], env: Mapping[str, str] = os.environ) -> None:
    """Refuse to start a rank given GPU slots its host does not have: a hosts file claiming
    8 GPUs on a host of 4 made slot 5 CUDA_VISIBLE_DEVICES=5, which CUDA found no device
    behind, and the rank ran gloo on the CPU without a word."""
    import torch  # (here: after select_gpus chose the list CUDA reads)

    if slots and torch.cuda.device_count() < len(slots):
        raise RuntimeError(
            f"host {env.get('ASYNCRL_HOST_NAME', '?')}: the group was given {len(slots)} of "
            f"its GPU(s) ({','.join(slots)}, CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES')} here), but CUDA sees "
            f"{torch.cuda.device_count()}, and the ranks would run on the CPU: give the host "
            f"its real number of GPUs in the hosts file (\"gpus\"; \"cpus\" for a host "
            f"without), or check its driver")


def bind_gpu() -> None:
    """Make this thread use the rank's GPU: the current CUDA device is per thread, and user
    code runs on the exec and pool threads, not on the one that initialised the rank."""
    import torch  # (here: CUDA_VISIBLE_DEVICES is chosen before torch reads it)

    if torch.cuda.is_available():
        torch.cuda.set_device(gpu_index())


def gpu_index() -> int:
    """The rank's GPU among those it sees: ranks beyond their count share them (a group
    placed with share_gpus)."""
    import torch

    return int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()


def require_own_gpu(needs: str) -> None:
    """Refuse a rank that would share a GPU (share_gpus) where an engine binds
    cuda:LOCAL_RANK itself; `needs` says which, e.g. "vLLM needs a GPU per rank (...)"."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and local >= torch.cuda.device_count():
        raise ValueError(f"{needs}, but local rank {local} sees {torch.cuda.device_count()} "
                         f"GPU(s): do not place this group with share_gpus, or give it fewer "
                         f"ranks")
