"""CUDA IPC: rows of a GPU tensor handed to another process on the same host, device to
device, with no trip through host memory. The same mechanism torch.multiprocessing uses
(`_share_cuda_` / `_new_shared_cuda`), carried in a msgspec struct instead of a pickle.

The producer keeps the tensor in its object store until the controller releases it, which is
after the consumer's call finished; the consumer copies the rows into its own memory at once,
so nothing it keeps points into the producer's allocation. Imports nothing GPU-only until
called. Never run yet: no GPU machine was lent to the session that wrote it.
"""

from __future__ import annotations

import torch

from asyncrl.comm.messages import IpcRows


def export_rows(t: torch.Tensor, start: int, stop: int) -> IpcRows:
    rows = t[start:stop]
    (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync) = rows.untyped_storage()._share_cuda_()
    return IpcRows(int(device), bytes(handle), int(storage_bytes), int(storage_offset_bytes),
                   bytes(ref_counter_handle), int(ref_counter_offset),
                   None if event_handle is None else bytes(event_handle), bool(event_sync),
                   str(rows.dtype)[6:], tuple(rows.shape), tuple(rows.stride()),
                   int(rows.storage_offset()))


def copy_rows_into(info: IpcRows, dst: torch.Tensor) -> None:
    """Copy the shared rows into `dst` (a CUDA tensor of the same shape and dtype)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        info.device, info.handle, info.storage_bytes, info.storage_offset_bytes,
        info.ref_counter_handle, info.ref_counter_offset, info.event_handle, info.event_sync)
    src = torch.empty(0, dtype=getattr(torch, info.dtype), device=f"cuda:{info.device}")
    src.set_(storage, info.offset, info.shape, info.stride)
    dst.copy_(src)
    torch.cuda.current_stream(dst.device).synchronize()  # done before the producer may free
