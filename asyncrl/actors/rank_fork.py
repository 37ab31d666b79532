"""Ranks forked from the agent server (asyncrl.controller.agent_fork), which imported what
every rank imports (torch, asyncrl's rank program, transformers' model code): a rank used to
spend 3-6 s of CPU importing them, for every rank of every group and every restart.

torchrun still starts each rank's process: `rank_client.py`, which connects to the server's
abstract unix socket, hands over its stdin/stdout/stderr and a lifeline (SCM_RIGHTS) with its
environment, directory and umask, and stands in for the rank the server forks. The rank runs
`rank_main.main()` with that environment, in a session of its own, as torchrun's workers do.
The server reports its exit to the stand-in; a stand-in that dies takes the rank's process
group with it (its lifeline closes; the server kills it too).

A rank is refused (and its stand-in runs `python -m asyncrl.actors.rank_main` itself) when
the server would not give it what a new interpreter would: an environment variable read at
start-up differs, its path finds another copy of a package the server imported, or CUDA was
initialised here.
"""

from __future__ import annotations

import errno
import functools
import gc
import importlib
import importlib.machinery
import io
import json
import os
import random
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from asyncrl.actors.rank_client import STAND_IN

# what a rank imports, once here; transformers' for the model presets (asyncrl.hybrid.models)
PRELOAD = ("asyncrl.actors.rank_main", "asyncrl.hybrid.roles", "asyncrl.rl",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")
PACKAGES = ("asyncrl", "torch", "transformers", "numpy", "zmq", "msgspec")  # of PRELOAD's
# read when Python, torch, transformers or the C runtime start, or when torch is imported: the
# same as the server's or the rank starts anew. Not these: read when used (after the fork).
# OMP_*: libgomp reads them as torch loads it; numpy's OpenBLAS OMP_NUM_THREADS as the server
# imports numpy (its threads are not torch.set_num_threads's); XDG_CACHE_HOME and
# HUGGINGFACE_*: huggingface_hub at its import; TZ: Python's time module; GLIBC_TUNABLES: ld.so
START_KEYS = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LANG", "LOGLEVEL", "THP_MEM_ALLOC_ENABLE",
              "GLIBC_TUNABLES", "XDG_CACHE_HOME", "TZ")
START_PREFIXES = ("PYTHON", "LC_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
                  "KMP_", "MKL_", "GOMP_", "OMP_", "OPENBLAS_", "MALLOC_", "TRANSFORMERS_",
                  "HF_", "HUGGINGFACE_")
READ_WHEN_USED = ("PYTHONPATH", "PYTHONUNBUFFERED", "TORCH_NCCL_", "TORCH_DISTRIBUTED_",
                  "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_CUDA_ARCH_LIST",
                  # set by imports (deepspeed's, torch._dynamo's) in the controller too
                  "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")
# Ranks' defaults (the user's environment or a group's env= wins): torch's CPU allocator asks
# for transparent huge pages for its blocks of 2 MiB or more. Where the kernel gives them on
# request only (THP "madvise", as on the CI VMs) a fresh 256 MiB tensor is written at ~8
# GiB/s instead of ~1.5 (numpy asks for them always). Read at torch's first allocation.
RANK_ENV_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def rank_threads(env: Mapping[str, str]) -> str:
    """A rank's OMP_NUM_THREADS (its torch and numpy threads), unless `env` sets one."""
    return env.get("OMP_NUM_THREADS") or env.get("ASYNCRL_THREADS", "1")
REQUEST_LIMIT = 1 << 22  # a rank's environment and directory
FDS = 4  # stdin, stdout, stderr, lifeline


def set_title(title: str) -> None:
    """What `ps` shows for this process: a forked one would show the server's command line
    (tools find ranks by theirs). Best effort: without setproctitle, unchanged."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def _start_vars(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if (k in START_KEYS or k.startswith(START_PREFIXES))
            and not k.startswith(READ_WHEN_USED)}


class StartUp:
    """The server's variables read at start-up (a forked process gets the server's), as it
    started and as its imports set them (torch's inductor sets TORCHINDUCTOR_CACHE_DIR)."""

    def __init__(self, started_with: Mapping[str, str]) -> None:
        """`started_with`: the server's environment before its imports; built after them."""
        self.started = _start_vars(started_with)
        self.imported = _start_vars(os.environ)

    def differs(self, env: Mapping[str, str]) -> str | None:
        """Why a process with `env` cannot be forked from the server (None: it can)."""
        theirs = _start_vars(env)
        keys = sorted(k for k in set(theirs) | set(self.started)
                      if theirs.get(k) != self.started.get(k)
                      and theirs.get(k) != self.imported.get(k))
        return f"{', '.join(keys)} differs from the server's (read at start-up)" if keys else None


def preload() -> None:
    """Import what a rank imports, once, in the server."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # (an optional one): the rank imports it if it needs it
    from asyncrl.actors.output import tee_path

    tee_path()  # probed once here: every forked rank has the answer
    # the imports' objects out of the collector's sight: a forked rank's collections would
    # walk them all (tens of thousands of modules' objects) and, writing their headers, copy
    # the pages it shares with the server
    gc.freeze()


def _check(ask: Any) -> dict[str, Any]:
    """The request, its types checked."""
    if not isinstance(ask, dict) or not isinstance(ask.get("cwd"), str) or \
            not isinstance(ask.get("umask"), int) or not isinstance(ask.get("env"), dict) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in ask["env"].items()):
        raise ValueError("a request is {'env': {str: str}, 'cwd': str, 'umask': int}")
    return ask


class RankForker:
    """The server's side: a listening socket, and per forked rank the stand-in's connection
    its exit goes to."""

    def __init__(self, started_with: Mapping[str, str], start_up: StartUp) -> None:
        """`started_with`: the server's environment before its imports (`preload`)."""
        self.start_up = start_up
        given = started_with.get("PYTHONPATH", "").split(os.pathsep)
        self.site_path = [p for p in sys.path[1:] if p not in given]  # sys.path[0]: -c's ''
        self.packages = {name: _location(name, sys.path) for name in PACKAGES
                         if name in sys.modules}
        self.address = f"asyncrl-ranks-{os.getpid()}-{os.urandom(8).hex()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(256)
        self.stand_ins: dict[int, socket.socket] = {}  # rank pid -> its stand-in's connection
        self.by_fd: dict[int, int] = {}  # a connection's fd -> its rank's pid
        self._spare = os.open(os.devnull, os.O_RDONLY)  # room to refuse one when out of fds

    def watched(self) -> list[int]:
        return [self.listener.fileno(), *self.by_fd]

    def readable(self, fd: int, close_in_child: list[int]) -> int | None:
        """Serve what `fd` has: a rank forked (its pid), or a stand-in gone (its rank too)."""
        if fd == self.listener.fileno():
            return self._accept(close_in_child)
        pid = self.by_fd[fd]
        try:
            gone = not self.stand_ins[pid].recv(1 << 10)
        except OSError:
            gone = True
        if gone:  # the stand-in died (torchrun killed it): so does its rank
            _kill_group(pid)
            self._drop(pid)
        return None

    def exited(self, pid: int, code: int) -> bool:
        """Report a forked rank's exit to its stand-in; False: not one of ours."""
        conn = self.stand_ins.get(pid)
        if conn is None:
            return False
        try:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except OSError:
            pass
        self._drop(pid)
        return True

    def _refuse_one(self) -> None:
        """Out of fds: the connection stayed queued (the listener readable for ever: the
        server spun) and its stand-in waited for an answer for ever. The spare fd makes room
        to take it and close it: the stand-in, answered nothing, starts its rank anew."""
        os.close(self._spare)
        try:
            conn, _ = self.listener.accept()
            conn.close()
        except OSError:
            pass
        finally:
            self._spare = os.open(os.devnull, os.O_RDONLY)

    def _drop(self, pid: int) -> None:
        conn = self.stand_ins.pop(pid)
        self.by_fd.pop(conn.fileno(), None)
        conn.close()

    def forget(self) -> None:
        """In a forked child: its copies of the server's sockets closed (the stand-ins must
        see EOF when the server goes)."""
        for sock in (self.listener, *self.stand_ins.values()):
            os.close(sock.detach())
        os.close(self._spare)
        self.stand_ins, self.by_fd = {}, {}

    def _accept(self, close_in_child: list[int]) -> int | None:
        """Fork the rank a stand-in asks for, or answer why not. Nothing a request holds
        may end the server: it serves every group of the process."""
        try:
            conn, _ = self.listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self._refuse_one()
            return None
        fds: list[int] = []
        try:
            conn.settimeout(2)  # a stand-in sends its request at once
            peer, uid, _ = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.getuid():
                raise PermissionError(f"uid {uid} is not the server's")
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, FDS)
            if len(data) < 4 or len(fds) != FDS:
                raise ValueError(f"a request needs its length and {FDS} fds")
            size = struct.unpack("!I", data[:4])[0]
            if size > REQUEST_LIMIT:
                raise ValueError(f"a request of {size} bytes")
            data = data[4:]
            while len(data) < size:
                more = conn.recv(size - len(data))
                if not more:
                    raise ValueError("the request was cut short")
                data += more
            ask = _check(json.loads(data))
            why = self._refusal(ask)
            if why:
                raise ValueError(why)
            ask["stand_in"] = peer
            conn.settimeout(None)
            pid = os.fork()
        except Exception as e:  # noqa: BLE001 - refused: the stand-in starts its rank anew
            try:
                conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        if pid == 0:
            self.forget()
            os.close(conn.detach())
            run_forked(lambda: self._become_rank(ask, fds, close_in_child))
        for fd in fds:
            os.close(fd)
        self.stand_ins[pid] = conn
        self.by_fd[conn.fileno()] = pid
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the stand-in is gone already: the next poll sees it
            pass
        return pid

    def _refusal(self, ask: dict[str, Any]) -> str | None:
        import torch

        if torch.cuda.is_initialized():  # a forked child could not use CUDA
            return "the server initialised CUDA"
        why = self.start_up.differs(ask["env"])
        if why:
            return why
        path = self.rank_path(ask["env"], ask["cwd"])
        for name, ours in self.packages.items():
            if _location(name, path) != ours:
                return f"its path finds another {name} than the server's ({ours})"
        return None

    def rank_path(self, env: Mapping[str, str], cwd: str) -> list[str]:
        """sys.path as `python -m` would make it: the directory, PYTHONPATH, then site's."""
        given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        return [cwd, *given, *self.site_path]

    def _become_rank(self, ask: dict[str, Any], fds: list[int], close: list[int]) -> None:
        """In the forked child: the rank torchrun asked for (run by run_forked)."""
        os.setsid()  # as torchrun starts its workers
        for fd in close:
            os.close(fd)
        *stdio, lifeline = fds
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        os.set_inheritable(lifeline, False)  # the rank's alone: not its children's
        os.register_at_fork(after_in_child=functools.partial(_close_if_same, lifeline,
                                                             _identity(lifeline)))
        threading.Thread(target=_hold_lifeline, args=(lifeline,), daemon=True,
                         name="asyncrl-lifeline").start()
        take_place(ask)
        os.environ[STAND_IN] = str(ask["stand_in"])
        sys.path[:] = self.rank_path(ask["env"], ask["cwd"])
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        random.seed()  # not the server's sequence, nor another rank's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:  # (a fresh process's torch seeds itself at random too)
            sys.modules["torch"].default_generator.seed()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        from asyncrl.actors import rank_main

        sys.argv = [rank_main.__file__]
        rank_main.main()  # ends the process itself


def _location(package: str, path: list[str]) -> str | None:
    spec = importlib.machinery.PathFinder.find_spec(package, path)
    found = spec.submodule_search_locations if spec is not None else None
    return os.path.realpath(list(found)[0]) if found else None


def _kill_group(pid: int) -> None:
    """SIGKILL to a rank and what it started (it leads its process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve_ranks(started_with: Mapping[str, str], start_up: StartUp) -> RankForker | None:
    """The server's rank forker, or None where it cannot fork ranks safely (a thread of
    Python's running: fork keeps only the caller's)."""
    forker = RankForker(started_with, start_up)
    if threading.active_count() > 1:
        forker.forget()
        return None
    return forker


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _close_if_same(fd: int, identity: tuple[int, int]) -> None:
    """Close `fd` in a child if it is still the file it was: the hook stays registered in
    the child's own children, where that number may be a file the child opened since."""
    try:
        if _identity(fd) == identity:
            os.close(fd)
    except OSError:
        pass


def _hold_lifeline(fd: int) -> None:
    """The stand-in's end closes when it dies: the rank's group goes too."""
    try:
        while os.read(fd, 1 << 10):
            pass
    except OSError:
        pass
    from asyncrl.comm.dataplane import unlink_own_segments  # (imported: it runs the rank)

    try:
        unlink_own_segments()  # a SIGKILL leaves them: RAM until a reboot
    finally:
        _kill_group(os.getpid())


def take_place(ask: dict[str, Any]) -> None:
    """A forked child takes the directory, umask and environment it was asked for."""
    os.chdir(ask["cwd"])
    os.umask(ask["umask"])
    os.environ.clear()
    os.environ.update(ask["env"])
    tempfile.tempdir = None  # from this environment's TMPDIR


def run_forked(body: Callable[[], None]) -> NoReturn:
    """A forked child's life: `body`, then the exit Python would give it, without the
    interpreter's teardown (the server's state is not the child's to finalise)."""
    code, sig = 1, None
    try:
        body()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # sys.exit("why"): printed, exit code 1
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python: the traceback, then death by SIGINT
        traceback.print_exc()
        sig = signal.SIGINT
    except BaseException:  # as Python reports it, exit code 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if sig is not None:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
        finally:
            os._exit(code & 0xFF)
