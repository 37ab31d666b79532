"""Worker: the base class of a group's SPMD code. One instance per rank."""

from __future__ import annotations

import errno
import inspect
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncrl.actors.protocols import DP_AXIS, Dispatch
from asyncrl.actors.register import check_method_names, register


class Worker:
    """Subclass it and mark methods with ``@asyncrl.register``.

    Before your ``__init__`` runs (no ``super().__init__()`` needed), torch.distributed is
    initialised and these are set: ``rank``, ``world_size``, ``local_rank``, ``group_name``,
    ``mesh`` (axis -> size) and ``coords`` (axis -> this rank's coordinate)."""

    rank: int
    world_size: int
    local_rank: int
    group_name: str
    mesh: dict[str, int]
    coords: dict[str, int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_method_names(cls)  # at class definition, before any group is spawned

    @property
    def dp_rank(self) -> int:
        return self.coords.get(DP_AXIS, 0)

    @property
    def dp_size(self) -> int:
        return self.mesh.get(DP_AXIS, 1)

    @property
    def device_mesh(self) -> Any:
        """The group's mesh as a torch DeviceMesh (built on first use: it creates groups)."""
        mesh = self.__dict__.get("_asyncrl_device_mesh")
        if mesh is None:
            import torch
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device, tuple(self.mesh.values()),
                                    mesh_dim_names=tuple(self.mesh))
            self.__dict__["_asyncrl_device_mesh"] = mesh
        return mesh

    # -- checkpoints: the flow calls save_checkpoint / load_checkpoint; you override the hooks
    # (each may be `async def`, as a method may: it runs to its end on the call's loop)
    def save_state(self, folder: Path) -> Awaitable[None] | None:
        """Write this rank's state (weights, optimizer...) into `folder`, which the group's
        ranks share: name files by rank. The default saves nothing."""

    def load_state(self, folder: Path) -> Awaitable[None] | None:
        """Read back what `save_state` wrote into `folder`. The default loads nothing."""

    def on_close(self) -> Awaitable[None] | None:
        """Called on each rank as its group closes, after its last call: release what the
        worker holds outside its process (child processes, say). The default does nothing;
        a rank that dies runs no hook. `async def`: on the in-order calls' loop."""

    @register(concurrent=True, dispatch=Dispatch.RANK_ZERO)
    def _nccl_unique_id(self, make: bool = True) -> bytes:
        """Raises ImportError without NCCL through CuPy; else, if `make`, a unique id for a
        communicator with this group's ranks first: made here, not on the controller
        (NCCL's bootstrap root runs where it is made)."""
        from asyncrl.comm import nccl

        if not make:
            nccl.backend()  # the ImportError, if there is no NCCL
            return b""
        return nccl.new_unique_id()

    @register(concurrent=True)
    def _nccl_join(self, key: str, uid: bytes, world: int, offsets: dict[str, int]) -> None:
        """Join the NCCL communicator `key` the controller sets up (asyncrl/controller/links.py)."""
        from asyncrl.comm import nccl

        nccl.join(key, uid, world, offsets[self.group_name] + self.rank, offsets)

    @register
    def save_checkpoint(self, path: str) -> Any:
        """Save this rank's RNG states and `save_state` into ``path/<group name>/``."""
        import torch

        folder = Path(path) / self.group_name
        folder.mkdir(parents=True, exist_ok=True)

        def rest() -> None:
            # the RNG after save_state, restored after load_state: draws either makes (a
            # data loader's seed, a head made anew) do not shift the resumed run's numbers
            torch.save(rng_state(), folder / f"rng_rank{self.rank}.pt")
            sync_tree(folder)  # on disk before the controller marks the checkpoint complete
        return after(self.save_state(folder), rest)

    @register
    def load_checkpoint(self, path: str) -> Any:
        """Restore what `save_checkpoint(path)` saved on this rank."""
        import torch

        folder = Path(path) / self.group_name
        rng = folder / f"rng_rank{self.rank}.pt"
        if not rng.is_file():
            raise FileNotFoundError(
                f"{rng} does not exist: the checkpoint at {path} has no state for rank "
                f"{self.rank} of group {self.group_name!r} (was it written by a group with "
                f"{self.world_size} ranks?); resume with the group sizes that wrote it")
        state = torch.load(rng, weights_only=True)  # (read first: a bad file fails here)
        # the RNG set after load_state: see save_checkpoint
        return after(self.load_state(folder), lambda: set_rng_state(state))


def after(hooked: Any, rest: Callable[[], None]) -> Any:
    """`rest()` once a hook that returned `hooked` is done: at once, or, for an `async def`
    hook, in a coroutine awaiting it first, which the rank runs as it runs an async method's
    (dropped, the hook never ran: a checkpoint complete without the weights)."""
    if not inspect.isawaitable(hooked):
        return rest()

    async def awaited() -> None:
        await hooked
        rest()
    return awaited()


def sync_tree(path: Path) -> None:
    """fsync every file and folder under `path`: a power cut after a checkpoint is marked
    complete must not leave its files empty or cut short."""
    for root, _, files in os.walk(path):
        for name in files:
            sync_file(Path(root, name))
        sync_dir(Path(root))


# what a file system that cannot fsync a file (or a folder) says; anything else is an error
NO_FSYNC = frozenset({errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.ENOSYS, errno.EPERM,
                      errno.EACCES})


def sync_file(path: Path) -> None:
    """fsync a regular file (opened for writing where allowed: some filesystems refuse a
    read-only descriptor's fsync); one gone meanwhile (a peer's temporary) is skipped."""
    try:
        if not path.is_file():
            return
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in NO_FSYNC:  # cannot be synced (a pipe, some FUSE mounts), as
            raise  # sync_dir; a failed write-back is an error
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """fsync a folder (what was created or renamed in it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # gone meanwhile (another rank's sync_tree of the folder)
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some shared and FUSE filesystems refuse a folder's fsync: the
        if e.errno not in NO_FSYNC:  # rename stands; an I/O error does not pass
            raise
    finally:
        os.close(fd)


def not_yours(path: Path) -> str | None:
    """Why another user could change what is in the folder `path` (it is theirs, or every
    user can write it), or None."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"owned by user {st.st_uid}"
    if st.st_mode & 0o002:
        return "writable by every user"
    return None


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, in a form torch.load(weights_only=True) reads back
    (numpy's key as a list: no pickled arrays)."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # (a process that never
        state["cuda"] = torch.cuda.get_rng_state_all()  # used CUDA: not made to, for this)
    try:
        import numpy as np
    except ImportError:
        return state
    np_state = np.random.get_state(legacy=False)
    state["numpy"] = {**np_state, "state": {"key": np_state["state"]["key"].tolist(),
                                             "pos": int(np_state["state"]["pos"])}}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np_state = dict(state["numpy"])
        np_state["state"] = {"key": np.array(np_state["state"]["key"], dtype=np.uint32),
                             "pos": np_state["state"]["pos"]}
        np.random.set_state(np_state)


def construct(cls: type, args: list, kwargs: dict[str, Any], attrs: dict[str, Any]) -> Any:
    """Build `cls` with the rank attributes set before its ``__init__`` runs."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"{cls!r} is not a subclass of asyncrl.Worker")
    obj = cls.__new__(cls)
    for name, value in attrs.items():
        setattr(obj, name, value)
    cls.__init__(obj, *args, **kwargs)
    return obj
