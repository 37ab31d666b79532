"""What torchrun starts for each rank when ranks are forked from the agent server: a small
stdlib-only program (`python -I -S rank_client.py`, a few ms) that asks the server
(asyncrl.actors.rank_fork) for a rank forked from its warm, torch-imported process, hands it
this process's stdin, stdout, stderr, environment, directory and umask, then stands in for it:
signals torchrun sends are passed on to the rank's process group, and it exits as the rank
exits (a signal as a signal).

Besides the three fds it hands over a lifeline, one end of a socket pair: the rank's process
group is killed when the stand-in dies (as torchrun's SIGKILL of a worker would), and the
stand-in sees the rank end when the lifeline closes, even with the server gone.

Where the server cannot be reached or refuses (an environment variable it read at start-up
differs, ...), it becomes the rank itself: `python -u -m asyncrl.actors.rank_main`, as
torchrun would have started it.
"""

import json
import os
import resource
import signal
import socket
import struct
import sys

SERVER = "ASYNCRL_RANK_SERVER"  # the server's abstract unix socket, in the rank's environment
STAND_IN = "ASYNCRL_STAND_IN"  # in a forked rank's: its stand-in's pid (torchrun's name for it)


def _read_umask() -> int:
    """The umask, set and set back (the only way before Linux 4.7): at import only, while
    no other thread creates files."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _read_umask()


def current_umask() -> int:
    """This process's umask, read from /proc: setting it to read it would, for a moment,
    give files other threads create then (a checkpoint's, on its writer thread) another mode."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return _UMASK_AT_IMPORT  # (an older kernel: the mask as it was at import)


def exec_rank() -> None:
    env = {k: v for k, v in os.environ.items() if k != SERVER}
    os.execve(sys.executable, [sys.executable, "-u", "-m", "asyncrl.actors.rank_main"], env)


def ask(address: str):
    """(the server's connection, its reader, the lifeline, the forked rank's pid), or None:
    refused or unreachable."""
    request = json.dumps({"env": {k: v for k, v in os.environ.items() if k != SERVER},
                          "cwd": os.getcwd(), "umask": current_umask()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lifeline, theirs = socket.socketpair()
    try:
        conn.connect("\0" + address)
        socket.send_fds(conn, [struct.pack("!I", len(request)) + request],
                        [0, 1, 2, theirs.fileno()])
        theirs.close()  # the rank's end is the rank's alone
        reader = conn.makefile("rb")  # one reader: the exit may come in the pid's read
        answer = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        answer = {"error": "the server did not answer"}
    if "pid" not in answer:
        print(f"[asyncrl] rank started anew: {answer.get('error', 'no answer')}",
              file=sys.stderr, flush=True)
        for sock in (conn, lifeline, theirs):
            sock.close()
        return None
    return conn, reader, lifeline, answer["pid"]


def stand_in(conn, reader, lifeline, pid: int) -> None:
    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)  # the rank leads its group, as torchrun's workers do
        except ProcessLookupError:  # not yet: it has not called setsid
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = reader.readline()  # {"exit": code}, or EOF: the server is gone
    try:
        code = json.loads(line)["exit"]
    except (ValueError, KeyError, TypeError):
        while lifeline.recv(1 << 10):  # the rank's end closes when it ends
            pass
        code = 1  # its exit status was the server's to read
    if code < 0:  # died of a signal: so does its stand-in (torchrun reports the signal)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of the stand-in's own
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (these cannot be caught anyway)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # (a signal whose default is to go on: the shell's convention)
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
