"""What `asyncrl launch --save-inputs` writes per node and step, for `asyncrl run --node`:
RUN_DIR/inputs/step<t>/<node>.msgpack, {"format", "values": the node's arguments, awaited,
"futures": where the node was given DistFutures (input -> paths of keys and indices into
it; [] for the input itself)}."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.comm import codec
from asyncrl.futures.future import resolved

NODE_INPUTS = "asyncrl-node-inputs/1"


async def save_node_inputs(folder: Path, node: str, kwargs: dict[str, Any]) -> None:
    """Write `node`'s arguments (their values: a DistFuture is awaited) into `folder`."""
    futures: dict[str, list[list[Any]]] = {}
    saved = {k: await resolved(v, found=futures.setdefault(k, [])) for k, v in kwargs.items()}
    _write(folder / f"{node}.msgpack", {"format": NODE_INPUTS, "values": saved, "futures": {
        k: paths for k, paths in futures.items() if paths}})


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(codec.encode(record))
