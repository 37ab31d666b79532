"""The torchrun agent on a host that does not share this machine's files (ssh, srun hosts):
``python -m asyncrl.actors.agent_main <torchrun args>``.

torchrun keeps its own folders (per-rank error files) in a new ``torchelastic_*`` folder of
/tmp unless given ``--log-dir``, and never removes it. On hosts that share this machine's files
the controller passes a folder of its own, removed at close; elsewhere it cannot, so this runs
torchrun in-process inside a temporary folder that goes when torchrun exits (normally, on an
error, or on the SIGTERM/SIGINT/SIGHUP torchrun turns into an exception; a SIGKILL leaves it).
"""

from __future__ import annotations

import sys
import tempfile


def main(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun

    with tempfile.TemporaryDirectory(prefix="asyncrl-torchrun-") as scratch:
        torchrun(["--log-dir", scratch, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
