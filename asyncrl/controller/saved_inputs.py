"""What `asyncrl launch --save-inputs` writes per node and step, for `asyncrl run --node`:
RUN_DIR/inputs/step<t>/<node>.msgpack, {"format", "values": the node's arguments, awaited,
"futures": where the node was given DistFutures (input -> paths of keys and indices into
it; [] for the input itself)}."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.actors.rank_client import current_umask
from asyncrl.comm import codec
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # (a power cut before the rename: the name's empty file)
        os.chmod(tmp, 0o666 & ~current_umask())  # (mkstemp's 0600: as open would make it)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        return saved["values"], saved["futures"]
    if not isinstance(saved, dict):
        raise ValueError(f"{path} does not hold a node's inputs (a dict); write it with "
                         f"`asyncrl launch FLOW --save-inputs`")
    return saved, {}  # written before futures were noted: values only
