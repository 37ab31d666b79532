"""What torchrun starts for each rank when ranks are forked from the agent server: a small
stdlib-only program (`python -I -S rank_client.py`, a few ms) that asks the server
(asyncrl.actors.rank_fork) for a rank forked from its warm, torch-imported process, hands it
this process's stdin, stdout, stderr, environment, directory and umask, then stands in for it:
signals torchrun sends are passed on, and it exits as the rank exits (a signal as a signal).

Where the server cannot be reached or refuses (an environment variable it read at import
differs, ...), it becomes the rank itself: `python -u -m asyncrl.actors.rank_main`, as
torchrun would have started it.
"""

import json
import os
import signal
import socket
import struct
import sys
import time

SERVER = "ASYNCRL_RANK_SERVER"  # the server's abstract unix socket, in the rank's environment
STAND_IN = "ASYNCRL_STAND_IN"  # in a forked rank's: its stand-in's pid (torchrun's name for it)


def exec_rank() -> None:
    env = {k: v for k, v in os.environ.items() if k != SERVER}
    os.execve(sys.executable, [sys.executable, "-u", "-m", "asyncrl.actors.rank_main"], env)


def ask(address: str) -> tuple[socket.socket, int] | None:
    """The forked rank's pid and the connection its exit comes on; None: refused."""
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({"env": {k: v for k, v in os.environ.items() if k != SERVER},
                          "cwd": os.getcwd(), "umask": umask}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + address)
        socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [0, 1, 2])
        answer = json.loads(conn.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in answer:
        print(f"[asyncrl] rank started anew: {answer.get('error', 'no answer')}",
              file=sys.stderr, flush=True)
        conn.close()
        return None
    return conn, answer["pid"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def stand_in(conn: socket.socket, pid: int) -> None:
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = conn.makefile("rb").readline()  # {"exit": code}, or EOF: the server is gone
    try:
        code = json.loads(line)["exit"]
    except (ValueError, KeyError):
        while alive(pid):  # not our child: its status is the server's, which is gone
            time.sleep(0.1)
        code = 1
    if code < 0:  # died of a signal: so does its stand-in (torchrun reports the signal)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (these cannot be caught anyway)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main() -> None:
    address = os.environ.get(SERVER)
    forked = ask(address) if address else None
    if forked is None:
        exec_rank()
    else:
        stand_in(*forked)


if __name__ == "__main__":
    main()
