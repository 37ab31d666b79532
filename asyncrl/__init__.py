"""asyncrl: RL post-training of language models on an asyncio single controller, without Ray.

The public API; nothing else is public.
"""

from asyncrl.actors.protocols import Dispatch, Layout, Split, register_protocol
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.controller.controller import Controller
from asyncrl.controller.group import GroupHandle
from asyncrl.controller.runner import run
from asyncrl.errors import (
    AsyncRLError,
    ClosedError,
    EncodeError,
    GroupDeadError,
    RemoteError,
    SpawnError,
    SpawnTimeout,
    TransferTimeout,
)
from asyncrl.futures.future import DistFuture

__version__ = "0.1.0"

__all__ = [
    "AsyncRLError",
    "ClosedError",
    "Controller",
    "Dispatch",
    "DistFuture",
    "EncodeError",
    "GroupDeadError",
    "GroupHandle",
    "Layout",
    "RemoteError",
    "SpawnError",
    "SpawnTimeout",
    "Split",
    "TensorBatch",
    "TransferTimeout",
    "Worker",
    "register",
    "register_protocol",
    "run",
]
