"""CUDA IPC: rows of a GPU tensor handed to another process on the same host, device to
device, with no trip through host memory. The same mechanism torch.multiprocessing uses
(`_share_cuda_` / `_new_shared_cuda`), carried in a msgspec struct instead of a pickle.

The producer keeps the tensor in its object store until the controller releases it, which is
after the consumer's call finished; the consumer copies the rows into its own memory at once,
so nothing it keeps points into the producer's allocation. Imports nothing GPU-only until
called. Ran on one H200 in session 26 (tests/test_gpu.py: CUDA IPC between two processes,
74-75 GiB/s); between two GPUs of a host, never.

GPUs are named by UUID between processes: device indices depend on each process's
CUDA_VISIBLE_DEVICES. A consumer opens a handle only if it sees the producer's GPU (the same
one, or a peer in its visible set), and never its own process's handles (CUDA refuses them:
DataClient copies its own rows from its store instead).

torch frees an exported block only once every handle to it was opened and closed (a count
in shared memory the consumer decrements). A consumer that will not copy rows it was sent
(a reply that came after its pull failed) still opens and closes them: `release`.

Where torch cannot export or open rows (memory in expandable segments is shared through
pidfd_getfd, which a container without ptrace rights refuses: pytorch#165685), the call
raises IpcUnavailable; DataClient then pulls the rows through host memory, and this process
uses CUDA IPC no more (`give_up`, said once in the log). An open is taken for that only
where no open ever succeeded in this process, or pidfd may be the cause: otherwise the
rows' producer most likely died or freed them, and only that transfer fails (RuntimeError).
"""

from __future__ import annotations

import logging
import os

import torch

from asyncrl.comm.dtypes import torch_dtype
from asyncrl.comm.messages import IpcRows

log = logging.getLogger("asyncrl")
_visible: list[str] | None = None
_failed: str | None = None  # why CUDA IPC failed in this process: not used again
_open_failed = False  # opening failed here (not a producer's export): releases would too
_opened = False  # an open succeeded here: a later failure is the rows', not the process's


class IpcUnavailable(RuntimeError):
    """torch could not export or open GPU rows for CUDA IPC here."""


def _pidfd(e: RuntimeError) -> bool:
    """Whether `e` may be torch's pidfd_getfd refused (memory in expandable segments)."""
    return "pidfd" in str(e) or "expandable_segments" in os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "")


def _unavailable(what: str, e: RuntimeError) -> IpcUnavailable:
    hint = ""
    if _pidfd(e):
        hint = ("; torch shares memory in expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True) through pidfd_getfd, which a container without "
                "ptrace rights refuses (pytorch#165685): unset expandable_segments in the "
                "producer group's environment to keep CUDA IPC")
    return IpcUnavailable(f"CUDA IPC could not {what} GPU rows ({e}){hint}")


def usable() -> bool:
    """Whether this process still uses CUDA IPC (it stops at its first failure)."""
    return _failed is None


def give_up(e: Exception) -> None:
    """Use CUDA IPC no more in this process: GPU rows go through host memory (logged once)."""
    global _failed
    if _failed is None:
        _failed = str(e)
        log.warning("asyncrl: %s; GPU rows between groups on this host go through host "
                    "memory in this process from now on (slower)", e)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees, by device index ([] without CUDA)."""
    global _visible
    if _visible is None:
        _visible = [device_uuid(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    return _visible


def export_rows(t: torch.Tensor, start: int, stop: int) -> IpcRows:
    rows = t[start:stop]
    try:
        (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle,
         ref_counter_offset, event_handle, event_sync) = rows.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        raise _unavailable("export", e) from e
    return IpcRows(int(device), bytes(handle), int(storage_bytes), int(storage_offset_bytes),
                   bytes(ref_counter_handle), int(ref_counter_offset),
                   None if event_handle is None else bytes(event_handle), bool(event_sync),
                   str(rows.dtype)[6:], tuple(rows.shape), tuple(rows.stride()),
                   int(rows.storage_offset()), device_uuid(int(device)))


def _open(info: IpcRows) -> tuple[int, torch.UntypedStorage]:
    """(this process's index of the producer's GPU, the shared storage)."""
    torch.cuda._lazy_init()
    visible = visible_gpus()
    if info.gpu not in visible:
        raise RuntimeError(f"CUDA IPC: the producer's GPU {info.gpu} is not visible to this "
                           f"process (it sees {visible}); place the groups on the same GPUs "
                           f"(colocate_with) or use Controller(transport='tcp')")
    device = visible.index(info.gpu)  # the producer's index means nothing here
    global _open_failed, _opened
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device, info.handle, info.storage_bytes, info.storage_offset_bytes,
            info.ref_counter_handle, info.ref_counter_offset, info.event_handle,
            info.event_sync)
    except RuntimeError as e:
        if _opened and "pidfd" not in str(e):  # CUDA IPC works here (expandable segments
            # too, if set): these rows are the trouble
            raise RuntimeError(f"CUDA IPC could not open GPU rows of {info.gpu} ({e}); this "
                               f"process opened others before, so their producer most likely "
                               f"died or freed them") from e
        _open_failed = True
        raise _unavailable("open", e) from e
    _opened = True
    return device, storage


def release(info: IpcRows) -> None:
    """Open and close rows this process will not copy, so the producer can free them (not
    once opening failed here: it would fail again; after a producer's export failed, the
    other producers' exported rows are still opened and closed, or their blocks stay)."""
    if not _open_failed and torch.cuda.is_available() and info.gpu in visible_gpus():
        _open(info)  # closed as it is dropped: torch's deleter decrements the count


def copy_rows_into(info: IpcRows, dst: torch.Tensor) -> None:
    """Copy the shared rows into `dst` (a CUDA tensor of the same shape and dtype)."""
    if tuple(info.shape) != tuple(dst.shape) or info.dtype != str(dst.dtype)[6:]:
        raise ValueError(f"CUDA IPC rows of shape {tuple(info.shape)} {info.dtype} for a "
                         f"destination of {tuple(dst.shape)} {str(dst.dtype)[6:]}")
    device, storage = _open(info)
    src = torch.empty(0, dtype=torch_dtype(info.dtype), device=f"cuda:{device}")
    src.set_(storage, info.offset, info.shape, info.stride)
    dst.copy_(src)
    torch.cuda.current_stream(dst.device).synchronize()  # done before the producer may free
