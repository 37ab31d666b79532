"""A user's function of rows in child processes: a reward function (`RewardFn(processes=N,
timeout_s=T)`) or a multi-turn environment (`multi_turn={"env": fn, "processes": N,
"timeout_s": T}`). Rows go N at a time, and a row whose function runs past `timeout_s` is
marked timed out while its process is killed and replaced. A verifier or a tool that hangs
on one row (sympy on a pathological expression, a sandbox that never returns) then costs
that row, not the run. With a timeout the pool keeps one spare process started ahead (its
imports done, ~2 s with torch): a replacement takes it at once, and a new spare starts.

Each child is `python -m asyncrl.hybrid.fn_pool`: it imports the function by reference (its
module, qualname and file, as the ranks import it), says it is ready, then calls it on the
rows it is sent. Frames are length-prefixed msgpack on a pipe of their own (the function's
prints go to stderr, the group's log); nothing is pickled. A child, and what it started,
dies with its rank (a watcher process) and ends when its input closes. The parent watches
each child's process as well as its pipe: a helper the function forked (a multiprocessing
pool) holds the pipe open past the child's death.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

import msgspec

from asyncrl.actors.procs import descendants, kill_pids
from asyncrl.comm.refs import make_ref, resolve_ref
from asyncrl.errors import ClosedError


class PoolClosedError(ClosedError, RuntimeError):
    """The pool was closed (its group closing): a call on it, or one it cut short."""


LENGTH = struct.Struct("<I")
START_TIMEOUT_S = 300.0  # importing the function's module (torch, a flow file) may be slow
POLL_S = 0.5  # without pidfds (Linux < 5.3): how often the children's exits are looked for
CLOSE_WAIT_S = 30.0  # close() waits this long for a call under way to see it and end


def _plain(obj: Any) -> Any:
    """numpy and torch scalars (a reward computed with numpy, meta from a DataFrame) as the
    Python numbers they hold."""
    if getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"a {type(obj).__name__} cannot be sent to or from a function's process; "
                    f"use numbers, strings, lists and dicts")


_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)


def frame(value: Any) -> bytes:
    data = _encoder.encode(value)
    return LENGTH.pack(len(data)) + data


def write_frame(out: IO[bytes], value: Any) -> None:
    out.write(frame(value))
    out.flush()


def read_frame(src: IO[bytes]) -> Any:
    """The next frame's value; None once the other side has closed."""
    head = src.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    size = LENGTH.unpack(head)[0]
    data = src.read(size)
    return None if len(data) < size else msgspec.msgpack.decode(data)


def _child(parent: int) -> None:
    try:  # stopped when the rank that started it dies, even inside a hung function: its
        # watcher then kills it with what it started (dead at once, its descendants would
        # lose their tie to it: a sandbox in a session of its own ran on)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGSTOP)
    except (OSError, AttributeError):  # (not a subreaper: the zombies of what its function
        pass  # left would be its to reap, and reaping them steals its subprocesses' codes)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    src = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints: to the log, not the frames
    # the function's own input() or subprocesses (a tool running code) read nothing, rather
    # than wait on the job pipe, or eat the next job's bytes
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, sys.stdin.fileno())
    os.close(null)
    fn = resolve_ref(*read_frame(src))
    write_frame(out, "ready")
    # one frame answers each one received: the parent never has two to read from a child
    while (job := read_frame(src)) is not None:
        index, prompt, response, meta = job
        try:  # encoded here: a value msgpack refuses is the function's error too
            answer = frame([index, fn(prompt, response, **meta), None])
        except BaseException:  # noqa: BLE001 - the parent raises it, naming the row; a
            # sys.exit() in the function ended this process, with nothing in the log
            answer = frame([index, None, traceback.format_exc()])
        out.write(answer)
        out.flush()


# A child's watcher: ends the child and what its function started (a sandbox, a tool's
# server, in the child's process group or in a session of its own) when the rank dies: the
# child, stopped by its own death signal, still holds its descendants; each is stopped as
# found (none forks meanwhile), then all are killed. It is the rank's child (the rank reaps
# it), in a session of its own (a kill of the rank's session leaves it to act), told of the
# rank's death by its own death signal; a plain interpreter without site or asyncrl (a few
# ms to start, a few MB), hence its own small /proc scan.
_WATCHER = """
import ctypes, os, signal, sys
rank, child = int(sys.argv[1]), int(sys.argv[2])
def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()
def born(pid):
    try:
        return stat(pid)[19]
    except (OSError, IndexError):
        return None
birth = born(child)
def children():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out.setdefault(int(stat(name)[1]), []).append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out
def kill(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
def end(*_):
    if birth is not None and born(child) == birth:  # (not a pid taken again)
        found, new = [], [child]
        while new:
            kill(new, signal.SIGSTOP)
            found += new
            below = children()
            new = [c for p in found for c in below.get(p, ()) if c not in found]
        kill(found, signal.SIGKILL)
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
signal.signal(signal.SIGTERM, end)
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != rank:
    end()
while True:
    signal.pause()
"""


class _Child:
    def __init__(self, ref: tuple[str, str, str]):
        # a session of its own: a timeout kills what the function started too (a sandbox)
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl.hybrid.fn_pool",
                                      str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        self.pidfd = _pidfd(self.proc.pid)
        self.ref = ref
        self.ready = False
        self.row: int | None = None  # the row it works on
        self.since = self.started = time.monotonic()
        write_frame(self.stdin, list(ref))

    def signal(self) -> None:
        # its descendants first, wherever they went (a sandbox in a session of its own,
        # out of reach of the group's kill), then its group
        kill_pids(descendants(self.proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.watcher.kill()

    def reap(self) -> None:
        self.proc.wait()
        self.watcher.wait()
        for pipe in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when `pid` exits (Linux 5.3+), else None: the
    parent then polls for exits every POLL_S."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pending(pipe: IO[bytes]) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        return bool(sel.select(0))


class FunctionPool:
    """`processes` children running `fn`; `call(jobs)` -> (values, timed-out flags). `what`
    names the function in errors ("reward function", "environment")."""

    def __init__(self, fn: Callable[..., Any], processes: int, timeout_s: float | None,
                 what: str = "reward function"):
        self.ref = make_ref(fn)
        self.name = f"{what} {getattr(fn, '__name__', repr(fn))!r}"
        self.timeout_s = timeout_s
        self.where: list[str] = []
        # close() may come from another thread than a call's (a rank closing under a score)
        self._lock = threading.Condition()
        self._closed = self._calling = False
        self.children = [_Child(self.ref) for _ in range(processes)]
        # a replacement waited for a fresh process's imports: ~2 s a timed-out row
        self._spare = _Child(self.ref) if timeout_s is not None else None
        self._idle_deaths = 0  # in the call under way

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    @property
    def spare_pid(self) -> int | None:
        return None if self._spare is None else self._spare.proc.pid

    def call(self, jobs: list[tuple[Any, Any, dict[str, Any]]], where: list[str] | None = None
             ) -> tuple[list[Any], list[bool]]:
        """Each job's value (None where it timed out) and whether it timed out. On an error
        the children busy with this call's rows are replaced: the next call starts clean."""
        with self._lock:
            if self._closed:  # (it waited for ever: no child would answer)
                raise PoolClosedError(f"{self.name}: call() on a closed pool (its group "
                                      f"closed); make a new one")
            if self._calling:
                raise RuntimeError(f"{self.name}: call() while another call runs; a pool "
                                   f"serves one call at a time")
            self._calling = True
        try:
            return self._call(jobs, where)
        finally:
            with self._lock:
                self._calling = False
                if self._closed:  # close() left its children to this call, which read them
                    self._stop_all()
                self._lock.notify_all()

    def _call(self, jobs: list[tuple[Any, Any, dict[str, Any]]], where: list[str] | None
              ) -> tuple[list[Any], list[bool]]:
        self.where = where or [f"row {i}" for i in range(len(jobs))]  # each job, in errors
        values: list[Any] = [None] * len(jobs)
        timed_out = [False] * len(jobs)
        todo, left = list(range(len(jobs)))[::-1], len(jobs)
        self._idle_deaths = 0
        # those that died since the last call (killed while idle: out of memory): no row lost
        self._replace([i for i, c in enumerate(self.children) if c.proc.poll() is not None])
        try:
            while left:
                if self._closed:
                    raise PoolClosedError(self._cut_short(left, len(jobs)))
                for c in self.children:  # idle and ready: give it the next row
                    if c.ready and c.row is None and todo and c.proc.poll() is not None:
                        self._died_idle(c)  # (its pipe may not say: a helper holds it open)
                    elif c.ready and c.row is None and todo:
                        c.row, c.since = todo.pop(), time.monotonic()
                        if not self._send(c, jobs):  # it died just now: the row goes back
                            todo.append(c.row)
                            c.row = None
                            self._died_idle(c)
                for c in self._woken():
                    left -= self._answer(c, values)
                left -= self._expire(timed_out)
                late = [c.proc.pid for c in self.children if not c.ready and
                        time.monotonic() - c.started > START_TIMEOUT_S]
                if late:
                    raise RuntimeError(f"{self.name}: processes {late} did not import it "
                                       f"within {START_TIMEOUT_S:.0f} s")
        except BaseException as e:
            if self._closed and not isinstance(e, PoolClosedError):  # its children's deaths,
                raise PoolClosedError(self._cut_short(left, len(jobs))) from e  # close()'s doing
            if self._closed:
                raise
            self._replace([i for i, c in enumerate(self.children)
                           if c.row is not None or c.proc.poll() is not None or not c.ready])
            raise
        return values, timed_out

    def _cut_short(self, left: int, rows: int) -> str:
        return (f"{self.name}: the pool was closed (its group closing) while a call ran; "
                f"{left} of its {rows} rows were not done")

    def _send(self, c: _Child, jobs: list[tuple[Any, Any, dict[str, Any]]]) -> bool:
        """Send `c` its row; False where it is gone (its pipe broken)."""
        assert c.row is not None
        try:
            write_frame(c.stdin, [c.row, *jobs[c.row]])
        except (TypeError, ValueError, OverflowError) as e:  # msgpack's: an int past 64 bits,
            row, c.row = c.row, None  # a lone surrogate; nothing went, so `c` is kept
            raise TypeError(f"{self.name}: {self.where[row]}: the prompt, response or meta "
                            f"cannot go to its process: {e}") from None
        except OSError:  # BrokenPipeError: it exited since it last answered
            return False
        return True

    def _woken(self) -> list[_Child]:
        """The children with a frame to read or that exited, each once."""
        polled = [c for c in self.children if c.pidfd is None]
        with selectors.DefaultSelector() as sel:
            for c in self.children:
                sel.register(c.stdout, selectors.EVENT_READ, c)
                if c.pidfd is not None:
                    sel.register(c.pidfd, selectors.EVENT_READ, c)
            woken = [key.data for key, _ in
                     sel.select(min(self._wait(), POLL_S) if polled else self._wait())]
        woken += [c for c in polled if c.proc.poll() is not None]
        return list(dict.fromkeys(woken))

    def _wait(self) -> float:
        """Until the first row could time out or a child be late starting."""
        ends = [c.since + self.timeout_s for c in self.children
                if c.row is not None and self.timeout_s is not None]
        ends += [c.started + START_TIMEOUT_S for c in self.children if not c.ready]
        return max(0.0, min(ends) - time.monotonic()) + 0.01 if ends else START_TIMEOUT_S

    def _answer(self, c: _Child, values: list[Any]) -> int:
        """Read `c`'s frame: ready, or its row's value (1: a row done). One that exited is
        read to its end: what it sent before, then nothing."""
        exited = c.proc.poll() is not None
        if exited:  # its group goes: a helper it forked holds the pipe open, and lives on
            c.signal()
        frame = read_frame(c.stdout) if not exited or _pending(c.stdout) else None
        if frame is None and c.ready and c.row is None:  # died idle: no row lost
            self._died_idle(c)
            return 0
        if frame is None:  # it died, not by our hand
            code = c.proc.wait()
            doing = f"on {self.where[c.row]}" if c.ready and c.row is not None else \
                f"before importing {self.ref[0]}:{self.ref[1]}"
            raise RuntimeError(f"{self.name}: its process {c.proc.pid} exited with {code} "
                               f"{doing}; see the group's log")
        if frame == "ready":
            c.ready = True
            return 0
        index, value, error = frame
        row, c.row = c.row, None
        assert index == row, (index, row)  # one frame answers each one sent
        if error is not None:
            raise ValueError(f"{self.name} failed on {self.where[index]}:\n{error}")
        values[index] = value
        return 1

    def _died_idle(self, c: _Child) -> None:
        """Replace `c`, which exited between rows; again and again in one call is an error
        (replacements that keep exiting would loop for ever)."""
        code = c.proc.wait()
        self._idle_deaths += 1
        if self._idle_deaths > 2 * len(self.children):
            raise RuntimeError(f"{self.name}: its processes keep exiting between rows "
                               f"({self._idle_deaths} in this call, the last with {code}); "
                               f"see the group's log")
        self._replace([self.children.index(c)])

    def _expire(self, timed_out: list[bool]) -> int:
        """Replace the children past the timeout; their rows time out (the count)."""
        if self.timeout_s is None:
            return 0
        now = time.monotonic()
        late = [i for i, c in enumerate(self.children)
                if c.row is not None and now - c.since > self.timeout_s]
        for i in late:
            timed_out[self.children[i].row] = True  # type: ignore[index]
        self._replace(late)
        return len(late)

    def _replace(self, indices: list[int]) -> None:
        """Kill these children (and what they started) and start new ones in their place."""
        _stop([self.children[i] for i in indices])
        for i in indices:
            self.children[i] = self._fresh()

    def _fresh(self) -> _Child:
        """The warm spare where there is one (a new spare started in its place), else a new
        process."""
        with self._lock:  # none starts after close(): nobody would stop it
            if self._closed:
                raise PoolClosedError(f"{self.name}: the pool was closed; no process starts")
            spare = self._spare
            if spare is None:
                return _Child(self.ref)
            if spare.proc.poll() is not None:  # it died waiting (killed: out of memory)
                _stop([spare])
                spare = _Child(self.ref)
            self._spare = _Child(self.ref)
        spare.started = time.monotonic()  # its "ready" is read from now; an old spare is not
        return spare  # late starting (the start timeout counts from its creation)

    def close(self) -> None:
        """Kill the children. A call under way (another thread's) fails, saying the pool
        was closed, and reaps them as it ends: they are its to read until then."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for c in self._everyone():
                c.signal()
            if self._calling:
                self._lock.wait_for(lambda: not self._calling, CLOSE_WAIT_S)
            if not self._calling:
                self._stop_all()

    def _everyone(self) -> list[_Child]:
        return self.children + ([self._spare] if self._spare is not None else [])

    def _stop_all(self) -> None:
        _stop(self._everyone())
        self.children, self._spare = [], None


def pool_settings_ok(processes: Any, timeout_s: Any) -> bool:
    """`processes` an int >= 0 and `timeout_s` None or a finite number > 0 (no bools)."""
    return isinstance(processes, int) and not isinstance(processes, bool) and processes >= 0 \
        and (timeout_s is None or isinstance(timeout_s, int | float) and
             not isinstance(timeout_s, bool) and math.isfinite(timeout_s) and timeout_s > 0)


def pool_for(fn: Callable[..., Any], processes: int, timeout_s: float | None,
             what: str) -> FunctionPool | None:
    """The pool `fn` runs in (settings checked by `pool_settings_ok`), or None: the caller's
    process. A function running in the caller's process cannot be stopped: a timeout needs
    a child, so it starts one at least."""
    processes = max(processes, 1) if timeout_s is not None else processes
    return FunctionPool(fn, processes, timeout_s, what) if processes else None


def _stop(children: list[_Child]) -> None:
    """Kill them all first, then wait for each (no one's wait holds up another's kill)."""
    for c in children:
        c.signal()
    for c in children:
        c.reap()


if __name__ == "__main__":
    _child(int(sys.argv[1]))
