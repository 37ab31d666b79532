"""Torch dtypes by the names peers send ("float32", "bfloat16"...).

A name from the wire is looked up in torch's own dtypes, never with getattr(torch, name):
torch's module __getattr__ imports submodules by name ("_inductor", "onnx"...), which would
let a peer make this process run their import (seconds and tens of MB) before the name is
refused.
"""

from __future__ import annotations

from typing import Any

import torch

# every dtype torch names at its top level (and aliases: "half", "long"...), read once
_BY_NAME: dict[str, torch.dtype] = {
    name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype called `name`; ValueError for anything that names none."""
    dtype = _BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {name!r}: torch {torch.__version__} has no "
                         f"dtype of that name (was it sent by a newer torch, or not by asyncrl?)")
    return dtype
