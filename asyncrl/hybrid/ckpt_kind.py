"""Which backend wrote a checkpoint's train/ folder: resuming with the other is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ZERO_TAG = "state"  # the one checkpoint folder DeepSpeed writes into a group's train/ (its tag)


def check_written_by(folder: Any, backend: str) -> None:
    """A checkpoint's train/ folder as `backend` ("fsdp2", "zero2", "zero3") writes it: the
    other's, loaded, failed with a message about a missing file (DeepSpeed's, of a file the
    other ZeRO stage names otherwise: its model states per rank under ZeRO-3)."""
    folder = Path(folder)
    theirs = None
    if (folder / ".metadata").is_file():  # torch.distributed.checkpoint's
        theirs = "fsdp2"
    elif (folder / ZERO_TAG).is_dir():  # DeepSpeed's
        tag = folder / ZERO_TAG
        theirs = "zero3" if any(tag.glob("zero_pp_rank_*_model_states.pt")) else \
            "zero2" if any(tag.glob("mp_rank_*_model_states.pt")) else "zero"
    if theirs is not None and not backend.startswith(theirs):
        names = {"zero": "backend='zero2' or 'zero3'"}
        raise ValueError(f"{folder} was written with {names.get(theirs, f'backend={theirs!r}')}"
                         f"; this group trains with backend={backend!r}: resume with the "
                         f"backend that wrote it, or start a new run from its model (`asyncrl "
                         f"export`, then model={{'path': ...}})")
