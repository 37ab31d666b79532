"""Worker: the base class of a group's SPMD code. One instance per rank."""

from __future__ import annotations

from typing import Any

from asyncrl.actors.protocols import DP_AXIS


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


def construct(cls: type, args: list, kwargs: dict[str, Any], attrs: dict[str, Any]) -> Any:
    """Build `cls` with the rank attributes set before its ``__init__`` runs."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"{cls!r} is not a subclass of asyncrl.Worker")
    obj = cls.__new__(cls)
    for name, value in attrs.items():
        setattr(obj, name, value)
    cls.__init__(obj, *args, **kwargs)
    return obj
