"""`asyncrl export RUN_DIR OUT`: a run's trained policy as a Hugging Face model (see
asyncrl/hybrid/export.py), from a checkpoint checked to be this user's first."""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.errors import CheckpointError


def export(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    from asyncrl.controller import checkpoint
    from asyncrl.controller.launch import sigterm_raises
    from asyncrl.hybrid.export import checkpoint_folder
    from asyncrl.hybrid.export import export as write

    logging.disable_progress_bar()  # one line says what was written
    try:  # (SIGTERM raises: its half-written folder is removed, as on any failure)
        # another user's checkpoint runs their code: its metadata is unpickled, its
        # model.json may ask for trust_remote_code; refused as --resume refuses it
        try:
            path = checkpoint_folder(Path(args.path))  # (the one checked is the one read)
        except (OSError, ValueError):  # none there: the export says so
            path = Path(args.path)
        else:
            checkpoint._own(path, "asyncrl export", "exported")
        with sigterm_raises():
            done = write(path, Path(args.out), args.group, args.dtype)
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    except (OSError, ValueError) as e:  # (a checkpoint file unreadable, OUT not writable)
        raise SystemExit(f"asyncrl export: {e}") from None
    print(f"asyncrl export: wrote {done['out']}: group {done['group']!r} of "
          f"{done['checkpoint']}, {done['parameters']:,} parameters in {done['dtype']}")
    for note in done["notes"]:
        print(f"asyncrl export: note: {note}")
    return 0
