"""asyncrl: RL post-training of language models on an asyncio single controller, without Ray.

The public API; nothing else is public.
"""

from asyncrl.actors.debugger import breakpoint
from asyncrl.actors.protocols import Dispatch, Layout, Split, register_protocol
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.compat import print_notes_on_310
from asyncrl.controller.controller import Controller
from asyncrl.controller.declare import config, group
from asyncrl.controller.flow import DataFlow
from asyncrl.controller.group import GroupHandle
from asyncrl.controller.nodes import FlowError, NodeError, node
from asyncrl.controller.placement import (
                                          PlacementError,
                                          colocate_with,
                                          nvlink_group,
                                          same_host_as,
                                          separate_from,
                                          share_gpus,
)
from asyncrl.controller.runner import run
from asyncrl.errors import (
                                          AsyncRLError,
                                          CheckpointError,
                                          ClosedError,
                                          EncodeError,
                                          GroupDeadError,
                                          InputLostError,
                                          InputsExhausted,
                                          RecoveryError,
                                          RemoteError,
                                          SpawnError,
                                          SpawnTimeout,
                                          TransferTimeout,
)
from asyncrl.futures.future import DistFuture, Rows, concat

__version__ = "0.1.0"
print_notes_on_310()  # (3.11 prints an uncaught error's notes itself)

__all__ = [
    "AsyncRLError",
    "CheckpointError",
    "ClosedError",
    "Controller",
    "DataFlow",
    "Dispatch",
    "DistFuture",
    "EncodeError",
    "FlowError",
    "GroupDeadError",
    "GroupHandle",
    "InputLostError",
    "InputsExhausted",
    "Layout",
    "NodeError",
    "PlacementError",
    "RecoveryError",
    "RemoteError",
    "Rows",
    "SpawnError",
    "SpawnTimeout",
    "Split",
    "TensorBatch",
    "TransferTimeout",
    "Worker",
    "breakpoint",
    "colocate_with",
    "concat",
    "config",
    "group",
    "node",
    "nvlink_group",
    "register",
    "register_protocol",
    "run",
    "same_host_as",
    "separate_from",
    "share_gpus",
]
