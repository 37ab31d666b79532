"""A user's function of rows in child processes: a reward function (`RewardFn(processes=N,
timeout_s=T)`) or a multi-turn environment (`multi_turn={"env": fn, "processes": N,
"timeout_s": T}`). Rows go N at a time, and a row whose function runs past `timeout_s` is
marked timed out while its process is killed and replaced. A verifier or a tool that hangs
on one row (sympy on a pathological expression, a sandbox that never returns) then costs
that row, not the run; so does a row whose process a signal kills (a segfault, the OOM
killer): it counts as timed out, and as crashed. With a timeout the pool keeps one spare
process started ahead (its imports done, ~2 s with torch): a replacement takes it at once,
and a new spare starts.

Each child is `python -m asyncrl.hybrid.fn_pool`: it imports the function by reference (its
module, qualname and file, as the ranks import it), says it is ready, then calls it on the
rows it is sent. Frames (`fn_wire`) are length-prefixed msgpack on a pipe of their own
(the function's prints go to stderr, the group's log); nothing is pickled. Its environment
lacks the run's secret. A small watcher starts it and holds it:

    rank --Popen--> watcher (subreaper, own session) --fork+exec--> child (own session)
      ^                 | orphans of the child's tree come to it       | jobs in, frames out:
      +-- pid, status --+ (the child's pid, then its exit status)      +-- pipes to the rank

It ends the child with everything under it (stopped as found, none forking meanwhile, then
killed: a sandbox in a session of its own whose parent died included) on a timeout or a
close (the rank's SIGTERM), when the child dies, and when the rank dies (watched by pid:
a death signal would fire with the thread that made it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

from asyncrl.comm.refs import function_ref, resolve_ref
from asyncrl.compat import add_note
from asyncrl.errors import ClosedError
from asyncrl.hybrid.fn_wire import frame, read_frame, write_frame

log = logging.getLogger("asyncrl")


class PoolClosedError(ClosedError, RuntimeError):
    """The pool was closed (its group closing): a call on it, or one it cut short."""


START_TIMEOUT_S = 300.0  # importing the function's module (torch, a flow file) may be slow
CLOSE_WAIT_S = 30.0  # close() waits this long for a call under way to see it and end
SECRET_WORDS = ("SECRET", "TOKEN", "KEY", "PASSWORD")  # in ASYNCRL_ names the children lack


def _no_debugger(*args: Any, **kwargs: Any) -> Any:
    """sys.breakpointhook in a child: pdb read the empty stdin and failed the call
    (bdb.BdbQuit), so breakpoint() is said once and the call goes on. PYTHONBREAKPOINT as
    Python reads it: "0" turns it off, another hook (a remote debugger) is called."""
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    if chosen:
        return None if chosen == "0" else sys.__breakpointhook__(*args, **kwargs)
    at = sys._getframe(1)
    print(f"[asyncrl] breakpoint() at {at.f_code.co_filename}:{at.f_lineno} ignored: a pool's "
          f"process (processes > 0) cannot attach a debugger; debug with processes=0, "
          f"where breakpoint() waits for `asyncrl attach`", file=sys.stderr, flush=True)
    sys.breakpointhook = lambda *args, **kwargs: None  # (once a process)
    return None


def _child(watcher: int) -> None:
    if os.getppid() != watcher:  # it died before its death signal was set (in the fork)
        os._exit(1)
    sys.breakpointhook = _no_debugger
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
    me = os.getpid()
    # one frame answers each one received: the parent never has two to read from a child
    while (job := read_frame(src)) is not None:
        index, prompt, response, meta = job
        try:  # encoded here: a value msgpack refuses is the function's error too
            answer = frame([index, fn(prompt, response, **meta), None])
        except BaseException:  # noqa: BLE001 - the parent raises it, naming the row; a
            # sys.exit() in the function ended this process, with nothing in the log
            answer = b"" if os.getpid() != me else frame([index, None, traceback.format_exc()])
        if os.getpid() != me:  # a process the function forked, returned or raised (not
            os._exit(1)  # os._exit()): it answered rows and read jobs as this one
        out.write(answer)
        out.flush()


# A child's watcher (see the diagram above): the rank's child, in a session of its own (a
# kill of the rank's session leaves it to act), a child subreaper (what the child's tree
# orphans, a sandbox whose parent exited, stays under it). argv: the rank's pid, the job
# pipe's and the frame pipe's ends for the child, the child's command. It says the child's
# pid, then its exit status. Ends the tree on SIGTERM, on the child's death, on the rank's.
# A plain interpreter without site or asyncrl (a few ms to start, a few MB), hence its own
# small /proc scan.
_WATCHER = """
import ctypes, os, select, signal, sys
rank, job, out, command = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None)
try:
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
except AttributeError:
    pass
wake, woken = os.pipe()
os.set_blocking(wake, False)
os.set_blocking(woken, False)
signal.set_wakeup_fd(woken)
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
signal.signal(signal.SIGCHLD, lambda *_: None)
try:
    died = os.pidfd_open(rank)  # (readable once the rank is gone; opened before the check)
except (AttributeError, OSError):
    died = None  # (Linux < 5.3: its parent pid is polled)
me = os.getpid()  # (taken before the fork: the child compares its parent with it)
child = os.fork()
if child == 0:
    try:
        libc.prctl(1, signal.SIGKILL)  # the watcher killed outright: the child goes too
        os.setsid()
        os.dup2(job, 0)
        os.dup2(out, 1)
        os.close(job)
        os.close(out)
        for s in (signal.SIGPIPE, signal.SIGXFSZ):  # as Popen leaves them
            signal.signal(s, signal.SIG_DFL)
        os.execv(command[0], [*command, str(me)])
    finally:
        os._exit(127)
def say(number):  # (to a rank gone: nobody listens)
    try:
        os.write(1, b"%d\\n" % number)
    except OSError:
        pass
os.close(job)
os.close(out)
say(child)
def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()
def children():
    below = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                below.setdefault(int(stat(name)[1]), []).append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return below
def kill(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
def reap(block):
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == child:
            say(os.waitstatus_to_exitcode(status))
            asked.append(0)
def end():
    # all under it: each stopped as found, until a scan finds none new, then all killed
    me = os.getpid()
    found, new = {me}, [me]
    while new:
        below = children()
        new = [c for p in found for c in below.get(p, ()) if c not in found]
        kill(new, signal.SIGSTOP)
        found.update(new)
    found.discard(me)
    kill(found, signal.SIGKILL)
    signal.alarm(10)  # (its default ends this one: a process stuck in the kernel)
    reap(True)
    os._exit(0)
while True:
    reap(False)
    if asked or os.getppid() != rank:
        end()
    ready = select.select([wake] + ([died] if died is not None else []), [], [],
                          None if died is not None else 0.5)[0]
    if died in ready:
        end()
    try:
        os.read(wake, 512)
    except BlockingIOError:
        pass
"""


def _child_env() -> dict[str, str]:
    """This process's environment less the run's secrets (their files' paths): the function
    may run model-written code."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("ASYNCRL_") and any(w in k for w in SECRET_WORDS))}


class _Child:
    """A child process and its watcher, which says the child's pid, then its exit status
    (the child is the watcher's to reap)."""

    def __init__(self, ref: tuple[str, str, str]):
        job, self_in = os.pipe()
        self_out, out = os.pipe()
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()), str(job),
                 str(out), sys.executable, "-m", "asyncrl.hybrid.fn_pool"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0,
                pass_fds=(job, out), start_new_session=True, env=_child_env())
        except BaseException:
            for fd in (self_in, self_out):
                os.close(fd)
            raise
        finally:
            os.close(job)
            os.close(out)
        self.stdin, self.stdout = os.fdopen(self_in, "wb"), os.fdopen(self_out, "rb")
        assert self.watcher.stdout is not None
        self.status = self.watcher.stdout
        self._said = b""
        self.code: int | None = None  # the child's exit status, once the watcher said it
        self.ref = ref
        self.ready = False
        self.row: int | None = None  # the row it works on
        self.since = self.started = time.monotonic()
        try:
            pid = self._line(wait=True)
        except EOFError:
            self.reap()
            raise RuntimeError(f"the watcher of a function's process exited with "
                               f"{self.watcher.returncode} before starting it; see the "
                               f"log") from None
        assert pid is not None  # (waited for)
        self.pid = pid
        with contextlib.suppress(BrokenPipeError):  # (it died at once: read as it exits)
            write_frame(self.stdin, list(ref))

    def _line(self, wait: bool) -> int | None:
        """The watcher's next number; None where none came yet (wait: until one comes).
        EOFError: the watcher ended without one."""
        while b"\n" not in self._said:
            if not wait and not _pending(self.status):
                return None
            data = os.read(self.status.fileno(), 64)
            if not data:
                raise EOFError
            self._said += data
        line, _, self._said = self._said.partition(b"\n")
        return int(line)

    def poll(self, wait: bool = False) -> int | None:
        """The child's exit status once it ended, else None (wait: until it ends)."""
        if self.code is None:
            try:
                self.code = self._line(wait)
            except EOFError:  # its watcher was killed, and the child with it (its death
                self.code = self.watcher.wait()  # signal)
        return self.code

    def wait(self) -> int:
        code = self.poll(wait=True)
        assert code is not None
        return code

    def signal(self) -> None:
        """Have the watcher stop and kill the child and everything under it."""
        with contextlib.suppress(ProcessLookupError):
            self.watcher.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        self.watcher.wait()  # (it exits once all under it are dead)
        if self.code is None:  # left in a pool where its replacement failed to start: it
            self.code = self.watcher.returncode  # reads as exited, and the next call retries
        for pipe in (self.stdin, self.stdout, self.status):
            with contextlib.suppress(OSError):
                pipe.close()


def _signal_name(code: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def _pending(pipe: IO[bytes]) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        return bool(sel.select(0))


class FunctionPool:
    """`processes` children running `fn`; `call(jobs)` -> (values, timed-out flags). `what`
    names the function in errors ("reward function", "environment")."""

    def __init__(self, fn: Callable[..., Any], processes: int, timeout_s: float | None,
                 what: str = "reward function"):
        self.name = f"{what} {getattr(fn, '__name__', repr(fn))!r}"
        self.ref = function_ref(fn, what)
        self.timeout_s = timeout_s
        self.where: list[str] = []
        self.crashed: list[bool] = []  # the last call's rows whose process a signal killed
        self._signals: dict[int, int] = {}  # row -> the negative exit code, in the call
        # close() may come from another thread than a call's (a rank closing under a score)
        self._lock = threading.Condition()
        self._closed = self._calling = False
        self.children: list[_Child] = []
        self._spare: _Child | None = None
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if processes > len(cores) > 0:  # a rank on a CPU-only host is pinned to its cores
            log.warning("asyncrl: %s: its %d processes share the %d core(s) this rank may use "
                        "%s%s; use processes <= %d%s, or give the group more cores: more ranks "
                        "(nprocs=K: on a CPU-only host each rank gets a core, and the rows "
                        "are split among them)", self.name, processes, len(cores), cores,
                        f"; timeout_s={timeout_s} counts wall time, so a row waiting for a "
                        f"core can time out" if timeout_s is not None else "", len(cores),
                        ", a larger timeout_s" if timeout_s is not None else "")
        try:
            for _ in range(processes):
                self.children.append(_Child(self.ref))
            # a replacement waited for a fresh process's imports: ~2 s a timed-out row
            self._spare = _Child(self.ref) if timeout_s is not None else None
        except BaseException:
            self._stop_all()
            raise
        self._idle_deaths = 0  # in the call under way

    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    @property
    def spare_pid(self) -> int | None:
        return None if self._spare is None else self._spare.pid

    def call(self, jobs: list[tuple[Any, Any, dict[str, Any]]], where: list[str] | None = None
             ) -> tuple[list[Any], list[bool]]:
        """Each job's value (None where it timed out) and whether it timed out; a row whose
        process a signal killed (a segfault, the OOM killer) counts as timed out, and is
        marked in `crashed`. On an error the children busy with this call's rows are
        replaced: the next call starts clean."""
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
        self.crashed, self._signals = [False] * len(jobs), {}
        todo, left = list(range(len(jobs)))[::-1], len(jobs)
        self._idle_deaths = 0
        # those that died since the last call (killed while idle: out of memory): no row lost
        self._replace([i for i, c in enumerate(self.children) if c.poll() is not None])
        try:
            while left:
                if self._closed:
                    raise PoolClosedError(self._cut_short(left, len(jobs)))
                for c in self.children:  # idle and ready: give it the next row
                    if c.ready and c.row is None and todo and c.poll() is not None:
                        self._died_idle(c)  # (its pipe may not say: a helper holds it open)
                    elif c.ready and c.row is None and todo:
                        c.row, c.since = todo.pop(), time.monotonic()
                        if not self._send(c, jobs):  # it died just now: the row goes back
                            todo.append(c.row)
                            c.row = None
                            self._died_idle(c)
                for c in self._woken():
                    left -= self._answer(c, values, timed_out)
                left -= self._expire(timed_out)
                late = [c.pid for c in self.children if not c.ready and
                        time.monotonic() - c.started > START_TIMEOUT_S]
                if late:
                    raise RuntimeError(f"{self.name}: processes {late} did not import it "
                                       f"within {START_TIMEOUT_S:.0f} s")
        except BaseException as e:
            if self._closed and not isinstance(e, PoolClosedError):  # its children's deaths,
                raise PoolClosedError(self._cut_short(left, len(jobs))) from e  # close()'s doing
            if self._closed:
                raise
            try:  # (a start failing here, EAGAIN at a pids limit, hides not the call's error)
                self._replace([i for i, c in enumerate(self.children)
                               if c.row is not None or c.poll() is not None or not c.ready])
            except Exception as failed:
                add_note(e, f"{self.name}: replacing this call's processes failed too "
                            f"({failed!r}); the next call starts them again")
            raise
        if self._signals:  # (said once a call: the caller counts them as timed out)
            log.warning("asyncrl: %s: a process died by a signal on %s; scored as timed out "
                        "(crashed)", self.name, ", ".join(
                            f"{self.where[i]} ({_signal_name(code)})"
                            for i, code in sorted(self._signals.items())))
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
        """The children with a frame to read or that exited (their watchers say), each once."""
        with selectors.DefaultSelector() as sel:
            for c in self.children:
                sel.register(c.stdout, selectors.EVENT_READ, c)
                sel.register(c.status, selectors.EVENT_READ, c)
            woken = [key.data for key, _ in sel.select(self._wait())]
        return list(dict.fromkeys(woken))

    def _wait(self) -> float:
        """Until the first row could time out or a child be late starting."""
        ends = [c.since + self.timeout_s for c in self.children
                if c.row is not None and self.timeout_s is not None]
        ends += [c.started + START_TIMEOUT_S for c in self.children if not c.ready]
        return max(0.0, min(ends) - time.monotonic()) + 0.01 if ends else START_TIMEOUT_S

    def _answer(self, c: _Child, values: list[Any], timed_out: list[bool]) -> int:
        """Read `c`'s frame: ready, or its row's value (1: a row done). One that exited is
        read to its end: what it sent before, then nothing (its watcher killed what it had
        started: a helper it forked no longer holds the pipe open)."""
        exited = c.poll() is not None
        frame = read_frame(c.stdout) if not exited or _pending(c.stdout) else None
        if frame is None and c.ready and c.row is None:  # died idle: no row lost
            self._died_idle(c)
            return 0
        if frame is None and c.ready and c.row is not None and c.wait() < 0 \
                and not self._closed:  # a signal on its row (a segfault, the OOM killer):
            row, c.row = c.row, None  # the row is lost, as a timed-out one is
            timed_out[row] = self.crashed[row] = True
            self._signals[row] = c.wait()
            self._replace([self.children.index(c)])
            return 1
        if frame is None:  # it died, not by our hand
            code = c.wait()
            doing = f"on {self.where[c.row]}" if c.ready and c.row is not None else \
                f"before importing {self.ref[0]}:{self.ref[1]}"
            raise RuntimeError(f"{self.name}: its process {c.pid} exited with {code} "
                               f"{doing}; see the group's log")
        if frame == "ready":
            c.ready = True
            return 0
        index, value, error = frame
        if index != c.row:  # one frame answers each one sent: another process wrote it
            c.ready = False  # (replaced as the call fails)
            raise RuntimeError(f"{self.name}: its process {c.pid} answered for row {index} "
                               f"while it had {c.row}: another process wrote to its pipe (one "
                               f"the function forked, that went on instead of os._exit())")
        c.row = None
        if error is not None:
            raise ValueError(f"{self.name} failed on {self.where[index]}:\n{error}")
        values[index] = value
        return 1

    def _died_idle(self, c: _Child) -> None:
        """Replace `c`, which exited between rows; again and again in one call is an error
        (replacements that keep exiting would loop for ever)."""
        code = c.wait()
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
            spare, self._spare = self._spare, None
            if spare is not None and spare.poll() is not None:  # it died waiting (killed:
                _stop([spare])  # out of memory)
                spare = None
            fresh = spare if spare is not None else _Child(self.ref)
            if self.timeout_s is not None:  # (a spare that failed to start: started here)
                try:
                    self._spare = _Child(self.ref)
                except Exception as e:  # EAGAIN at a pids limit: a process taken is kept
                    log.warning("asyncrl: %s: its spare process did not start (%r); the "
                                "next replacement starts one", self.name, e)
        fresh.started = time.monotonic()  # its "ready" is read from now; an old spare is not
        return fresh  # late starting (the start timeout counts from its creation)

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
