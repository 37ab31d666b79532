"""The torchrun agent on a host that does not share this machine's files (ssh, srun hosts):
``python -m asyncrl.actors.agent_main <torchrun args>``.

torchrun keeps its own folders (per-rank error files) in a new ``torchelastic_*`` folder of
/tmp unless given ``--log-dir``, and never removes it. On hosts that share this machine's files
the controller passes a folder of its own, removed at close; elsewhere it cannot, so this runs
torchrun in-process inside a temporary folder that goes when torchrun exits (normally, on an
error, or on the SIGTERM/SIGINT/SIGHUP torchrun turns into an exception; a SIGKILL leaves it).
Then it unlinks what its killed ranks left in this host's /dev/shm.

Its lifeline (ASYNCRL_AGENT_LIFELINE=1): stdin, a pipe the controller's end of ssh or srun
keeps open. Its first line is a JSON object of environment variables for the ranks (the
group's `env=` over ssh: on ssh's command line any user of the controller's machine could
read them with `ps`). Killing that local process stops nothing on the host by itself; its end of the
pipe closing does: on EOF the agent sends itself SIGTERM, and torchrun stops its ranks (a
respawn would otherwise find the old ranks on its GPUs until their collective timeout).
While it holds, the agent stands in for the controller's process, which the ranks check
before taking a silent controller for gone (rank_main.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping

from asyncrl.actors.procs import PROCESS_ENV, pid_alive, this_process
from asyncrl.comm.dataplane import run_prefix
from asyncrl.comm.shm import cleanup

LIFELINE = "ASYNCRL_AGENT_LIFELINE"


def read_env_line(fd: int = 0) -> dict[str, str]:
    """The environment sent as the lifeline's first line (a JSON object of strings)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)  # (nothing follows the line: no read goes past it)
        if not chunk:
            sys.exit("asyncrl agent: the controller's end of the lifeline closed before it "
                     "sent the ranks' environment")
        line += chunk
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        sys.exit(f"asyncrl agent: the lifeline's first line is not an environment: "
                 f"{line[:80]!r}")
    return env


def watch_lifeline() -> None:
    """SIGTERM to this process once stdin reaches its end (its sender is gone)."""
    def wait() -> None:
        while os.read(0, 1 << 16):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=wait, daemon=True, name="asyncrl-lifeline").start()


def main(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun

    if os.environ.get(LIFELINE) == "1":
        os.environ.update(read_env_line())
        watch_lifeline()
        # the ranks' stand-in for the controller's process, which they cannot see from this
        # host: this agent runs while the lifeline holds. A silent controller that runs is
        # busy (a node's own work on its loop), and its ranks wait for it
        os.environ[PROCESS_ENV] = this_process()
    # torchrun turns these into an exception once its ranks start; before (waiting at the
    # rendezvous for another host that failed) they killed it with its folder left
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_by_signal)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-torchrun-") as scratch:
            torchrun(["--log-dir", scratch, *argv])
    finally:
        sweep_segments(os.environ)


def _exit_by_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def sweep_segments(env: Mapping[str, str]) -> list[str]:
    """Unlink the shared-memory pools this host's ranks of the group left behind, those of
    ranks whose process is gone (a killed rank leaves its pool; the controller sweeps its
    own machine's /dev/shm, not this host's). Returns the names removed."""
    run_id, group = env.get("ASYNCRL_RUN_ID"), env.get("ASYNCRL_GROUP")
    if not run_id or not group:
        return []
    prefix = f"{run_prefix(run_id)}{group}+"  # then "<rank>-<pid>-<n>" (pool_prefix)

    def gone(name: str) -> bool:
        fields = name[len(prefix):].split("-")
        return len(fields) > 1 and fields[1].isdigit() and not pid_alive(int(fields[1]))
    return cleanup(prefix, gone)


if __name__ == "__main__":
    main(sys.argv[1:])
