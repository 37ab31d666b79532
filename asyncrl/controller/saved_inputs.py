"""What `asyncrl launch --save-inputs` writes per node and step, for `asyncrl run --node`:
RUN_DIR/inputs/step<t>/<node>.msgpack, {"format", "values": the node's arguments, awaited,
"futures": where the node was given DistFutures (input -> paths of keys and indices into
it; [] for the input itself)}."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.comm import codec
from asyncrl.controller.logs import replace_file
from asyncrl.futures.future import resolved

NODE_INPUTS = "asyncrl-node-inputs/1"


async def save_node_inputs(folder: Path, node: str, kwargs: dict[str, Any]) -> None:
    """Write `node`'s arguments (their values: a DistFuture is awaited) into `folder`."""
    futures: dict[str, list[list[Any]]] = {}
    saved = {k: await resolved(v, found=futures.setdefault(k, [])) for k, v in kwargs.items()}
    data = codec.encode({"format": NODE_INPUTS, "values": saved, "futures": {
        k: paths for k, paths in futures.items() if paths}})
    await asyncio.to_thread(_write, folder / f"{node}.msgpack", data)  # (fsync: off the loop)


def _write(path: Path, data: bytes) -> None:
    """`data` as `path`, whole: a kill mid-write leaves a temporary file, not a cut one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda out: out.write(data))


def load_inputs(path: Path) -> tuple[dict[str, Any], dict[str, list[list[Any]]]]:
    """A node's saved inputs: their values, and where the node was given DistFutures."""
    try:
        saved = codec.decode(path.read_bytes())
    except msgspec.DecodeError as e:  # cut short (a launch killed as it wrote it, before
        # writes were whole), or damaged
        raise ValueError(f"{path} cannot be read as a node's inputs ({e}); save them again "
                         f"with `asyncrl launch FLOW --save-inputs`, or pass another "
                         f"step's file") from None
    if isinstance(saved, dict) and saved.get("format") == NODE_INPUTS:
        values, futures = saved.get("values"), saved.get("futures")
        if isinstance(values, dict) and isinstance(futures, dict):
            return values, futures
        raise ValueError(f"{path} cannot be read as a node's inputs (its values or futures "
                         f"are missing); save them again with `asyncrl launch FLOW "
                         f"--save-inputs`, or pass another step's file")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} does not hold a node's inputs (a dict); write it with "
                         f"`asyncrl launch FLOW --save-inputs`")
    return saved, {}  # written before futures were noted: values only
