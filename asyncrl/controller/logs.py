"""Ranks' output on the controller: every line kept per rank in RUN_DIR/logs/<group>/rank<r>.log,
and echoed on the console prefixed with `group:rank`, at most `lines_per_s` a second per
rank (the rest is counted and said to be in the file; a rank's own `[asyncrl]` notices, a
breakpoint's waiting for `asyncrl attach`, always shown). The console is written by a thread
of its own: a console that does not read (a paused `| less`, Ctrl-S) must not stop the
controller's loop, and what it cannot take is counted and said when it reads again."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TextIO

from asyncrl.actors.rank_client import current_umask

CONSOLE_QUEUE = 1000  # writes waiting for the console; past it, lines are counted, not kept
# ranks' files held open at once: a quarter of the open-file limit, 256 at least; the least
# recently written closed past it (opened again at its next line): one a rank took every
# descriptor of ~1000 printing ranks (EMFILE on all), and a fixed 256 made each write past
# 256 ranks an open and a close (20x slower, on the loop)
OPEN_LOGS = 256
CONTROLLER_LOG = "controller.log"  # the controller's notices, in RUN_DIR (logs/ has the
# groups' logs, torchrun's logs/<group>.log among them)
GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # the whole name (fullmatch: "$" took "g\n")
MAX_GROUP_NAME = 100  # it starts every socket identity of its ranks: ZeroMQ takes 255 bytes
# C0 controls but tab and newline, DEL and C1, written as \x1b...: a rank's escape sequence
# would be obeyed by the terminal (set its title or clipboard, clear it, move the cursor
# over other ranks' lines); colours (SGR: ESC [ digits and semicolons m) only are kept
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0)) if c not in (9, 10)}
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_RESETS = ("\x1b[m", "\x1b[0m")


def visible(text: str) -> str:
    """`text` with its control characters escaped, as a terminal may show it, but for its
    colours (a rank forcing colour: FORCE_COLOR, rich); a line that leaves a colour on is
    reset at its end (it would colour the next lines, other ranks' too)."""
    if "\x1b" not in text:
        return text.translate(_CONTROLS)
    return "\n".join(_coloured(line) for line in text.split("\n"))


def _coloured(line: str) -> str:
    shown, at, last = [], 0, ""
    for colour in _COLOUR.finditer(line):
        shown += [line[at:colour.start()].translate(_CONTROLS), colour.group()]
        at, last = colour.end(), colour.group()
    shown.append(line[at:].translate(_CONTROLS))
    return "".join(shown) + ("\x1b[0m" if last and last not in _RESETS else "")


def check_group_name(name: str) -> None:
    """Refuse a group name that cannot name its logs' folder, RUN_DIR/logs/<name>, or that
    is the timeline's row of the flow's node functions."""
    from asyncrl.controller.timeline import CONTROLLER_ROW  # (timeline imports this module)

    if not GROUP_NAME.fullmatch(name) or name in (".", ".."):  # ('..': above RUN_DIR/logs)
        raise ValueError(f"group name {name!r}: use letters, digits, '_', '.' or '-' "
                         f"(not '.' or '..' alone)")
    if len(name) > MAX_GROUP_NAME:  # (else the ranks fail with "ZMQError: Invalid argument")
        raise ValueError(f"group name {name[:20]!r}... is {len(name)} characters long: "
                         f"use at most {MAX_GROUP_NAME} (ZeroMQ socket names, which start "
                         f"with it, are limited to 255 bytes)")
    if name == CONTROLLER_ROW:  # its calls would be taken for the node functions' own time
        raise ValueError(f"group name {name!r} is the timeline's row of the flow's node "
                         f"functions (its calls would be left out of time/<node>_s, "
                         f"time/busy/<group>_s and `asyncrl bench`); choose another name "
                         f"(name=... in spawn() or asyncrl.group())")


def say(ctl: Any, text: str) -> None:
    """A notice of the controller's (a restart, a rewind, a checkpoint not pruned) in
    RUN_DIR/controller.log and on its console, in order with the ranks' lines (a console that
    does not keep up may miss it: the file has it); stderr itself without a controller."""
    sink = getattr(ctl, "logs", None)
    if isinstance(sink, LogSink):
        with contextlib.suppress(OSError), open(sink.folder.parent / CONTROLLER_LOG, "a",
                                                encoding="utf-8", errors="replace") as f:
            f.write(text + "\n")
        sink.console.write(text + "\n")
        return
    with contextlib.suppress(OSError, ValueError):  # a console gone: the run goes on
        print(visible(text), file=sys.stderr, flush=True)


class Console:
    """stderr, written by a thread of its own from a bounded queue."""

    def __init__(self) -> None:
        self.alive = True  # False once a write failed (a closed pipe): nothing more goes
        self._queue: queue.Queue[str | None] = queue.Queue(CONSOLE_QUEUE)
        self._lost = 0  # lines the full queue did not take
        self._thread: threading.Thread | None = None
        self._closed = False

    def write(self, text: str) -> None:
        if self._closed:  # nothing left to keep in order with: written here
            if self.alive:
                self._emit(text)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="asyncrl-console")
            self._thread.start()
        if self._lost and self._queue.qsize() < CONSOLE_QUEUE // 2:
            self.write(self._said_lost())  # it reads again: say what it missed
        try:
            self._queue.put_nowait(text)
        except queue.Full:
            self._lost += text.count("\n")

    def _said_lost(self) -> str:
        lost, self._lost = self._lost, 0
        return f"[asyncrl] {lost} lines were not shown (the console did not keep up); all " \
               f"are in the logs\n"

    def _run(self) -> None:
        while (text := self._queue.get()) is not None:
            if not self._emit(text):
                return

    def _emit(self, text: str) -> bool:
        """`text` on stderr, its control characters escaped (ranks' lines, remote errors);
        False (and no more after) once the console is gone."""
        try:
            sys.stderr.write(visible(text))
            sys.stderr.flush()
        except (OSError, ValueError):  # the console gone: the files go on
            self.alive = False
        return self.alive

    def close(self, timeout: float = 5.0) -> None:
        """What is queued written (within `timeout`: a console that does not read), what
        it could not take said."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                if self._lost:
                    self._queue.put(self._said_lost(), timeout=timeout)
                self._queue.put(None, timeout=timeout)
            self._thread.join(timeout)
        self._thread = None


class LogSink:
    def __init__(self, folder: Path, echo: bool = True, lines_per_s: float = 20,
                 burst: int = 100):
        self.folder, self._echo = folder, echo
        self.console = Console()
        self.rate, self.burst = lines_per_s, burst
        self._tokens: dict[tuple[str, int], tuple[float, float]] = {}  # tokens, time
        self._hidden: dict[tuple[str, int], int] = {}
        self._files: dict[tuple[str, int], TextIO] = {}
        self._open_most = max(OPEN_LOGS, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
        self._unwritten: set[str] = set()  # groups whose files could not be written (said)

    def path(self, group: str, rank: int) -> Path:
        return self.folder / group / f"rank{rank}.log"

    @property
    def echo(self) -> bool:  # (off once the console is gone: a closed pipe, a hung-up tty)
        return self._echo and self.console.alive

    def write(self, group: str, rank: int, lines: list[str], dropped: int = 0) -> None:
        key = (group, rank)
        unstreamed = f"[asyncrl] {dropped} lines were not streamed (over the rank's limit, " \
                     f"or its queue full): they are only in the group's torchrun log" \
            if dropped else ""
        if self.echo:  # first: a file that cannot be written must not hide them
            self._show(key, lines + ([f"{unstreamed} in {self.folder}"] if dropped else []))
        try:
            f = self._files.pop(key, None)  # (put back last: the most recently written)
            if f is None:
                if len(self._files) >= self._open_most:
                    _close_log(self._files.pop(next(iter(self._files))))
                self.path(group, rank).parent.mkdir(parents=True, exist_ok=True)
                f = open(self.path(group, rank), "a", encoding="utf-8")
            self._files[key] = f
            for line in lines:
                f.write(line + "\n")
            if dropped:
                f.write(unstreamed + "\n")
            f.flush()
        except OSError as e:  # a full disk: said once a group, the run goes on
            if group not in self._unwritten:
                self._unwritten.add(group)
                self.console.write(
                    f"[asyncrl] writing {self.path(group, rank)} failed ({e}); group "
                    f"{group!r}'s lines are in its torchrun log in {self.folder} "
                    f"({group}.log; on a cluster {group}.<host>.log, on each host)\n")

    def _show(self, key: tuple[str, int], lines: list[str]) -> None:
        now = time.monotonic()
        tokens, then = self._tokens.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        prefix = f"{key[0]}:{key[1]}"
        out = []
        for line in lines:
            hidden = self._hidden.get(key, 0)
            if line.startswith("[asyncrl] "):  # the rank's own notice: always shown
                out.append(f"{prefix} | {line}")
                continue
            if tokens >= 1:
                if hidden:  # the rate dropped again: say how many were held back
                    out.append(f"{prefix} | [asyncrl] {hidden} lines were not shown; all are "
                               f"in {self.path(*key)}")
                    self._hidden[key] = 0
                tokens -= 1
                out.append(f"{prefix} | {line}")
                continue
            if not hidden:  # the first line held back: say so now, count the rest
                out.append(f"{prefix} | [asyncrl] over {self.rate:g} lines/s: lines not shown "
                           f"until the rate drops; all are in {self.path(*key)}")
            self._hidden[key] = hidden + 1
        self._tokens[key] = (tokens, now)
        if out:
            self.console.write("\n".join(out) + "\n")

    def close_group(self, group: str) -> None:
        """A group stopped: its ranks' files closed (a respawn opens them again), so that a
        long run of many groups and restarts holds no descriptor per rank it ever had."""
        for key in [k for k in self._hidden if k[0] == group and self._hidden[k]]:
            self._say_hidden(key)  # (a burst that ended its output: a traceback, often)
        for key in [k for k in self._files if k[0] == group]:
            _close_log(self._files.pop(key))
        for table in (self._tokens, self._hidden):
            for key in [k for k in table if k[0] == group]:
                del table[key]

    def _say_hidden(self, key: tuple[str, int]) -> None:
        hidden = self._hidden.pop(key)
        if self.echo:
            self.console.write(f"{key[0]}:{key[1]} | [asyncrl] {hidden} lines were not "
                               f"shown; all are in {self.path(*key)}\n")

    def close(self) -> None:
        try:
            for key in [k for k in self._hidden if self._hidden[k]]:
                self._say_hidden(key)
            for f in self._files.values():
                _close_log(f)
            self._files.clear()
        finally:  # its last lines shown whatever happened to the files
            self.console.close()


def _close_log(f: TextIO) -> None:
    """Close a rank's file, every time: its flush fails again on a full disk, a loss its
    write has said already (the file is closed all the same)."""
    with contextlib.suppress(OSError):
        f.close()


def read_log(run_dir: Path, group: str, rank: int, tail: int | None = None
             ) -> Iterable[str]:
    """A rank's log, line by line (the last `tail` lines); FileNotFoundError at once, naming
    the logs there are, when it has none."""
    path = Path(run_dir) / "logs" / group / f"rank{rank}.log"
    if not path.is_file():
        folder = Path(run_dir) / "logs"
        known = sorted(f"{p.parent.name}:{p.stem.removeprefix('rank')}"
                       for p in folder.glob("*/rank*.log")) if folder.is_dir() else []
        # the group ran (torchrun's log: <group>.log, or <group>.<host>.log on each host of
        # a cluster): its rank printed nothing, or it has no such rank
        agents = sorted(str(p) for p in [*folder.glob(f"{group}.log"),
                                         *folder.glob(f"{group}.*.log")])
        if agents:
            raise FileNotFoundError(
                f"rank {rank} of group {group!r} printed nothing in {run_dir} (a rank's log "
                f"is made at its first line), or the group has no rank {rank}; the group's "
                f"torchrun log"
                f"{'s are' if len(agents) > 1 else ' is'} {', '.join(agents)}; logs there: "
                f"{known or 'none'}")
        raise FileNotFoundError(f"no log for group {group!r} rank {rank} in {folder}; "
                                f"logs there: {known or 'none'}")
    if tail is None:
        return _lines(path)
    return _last_lines(path, tail)


def _lines(path: Path) -> Iterator[str]:
    """Its lines, as read (a rank's log may be gigabytes): split at newlines only, as the
    rank wrote them (not at the other line breaks of str.splitlines, U+2028, \\x0c...)."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line.removesuffix("\n")


def _last_lines(path: Path, n: int, block: int = 1 << 16) -> list[str]:
    """The last `n` lines of `path`, read from its end a block at a time (a rank's log may
    be gigabytes)."""
    blocks: list[bytes] = []
    newlines = 0
    with open(path, "rb") as f:
        at = f.seek(0, os.SEEK_END)
        while at > 0 and newlines <= n:  # one more: the first may be cut
            step = min(block, at)
            at -= step
            f.seek(at)
            blocks.append(f.read(step))
            newlines += blocks[-1].count(b"\n")
    text = b"".join(reversed(blocks)).decode(errors="replace")
    lines = text.removesuffix("\n").split("\n") if text else []
    return lines[max(len(lines) - n, 0):]


def replace_json(path: Path, value: Any) -> None:
    """Write `value` as JSON to `path`, replacing it whole (`replace_file`)."""
    replace_file(path, lambda out: out.write(json.dumps(value).encode()))


def replace_file(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Replace `path` whole by what `write` writes: a kill mid-write leaves the previous
    file (timeline.json, a tracker's state, restarts.json). Each write has its own temporary
    file: a checkpoint's write in a thread may still run when the run's last one starts (a
    Ctrl-C or SIGTERM while the trace was written); one file would mix them."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # on disk before the rename (a power cut between
            write(f)  # would leave an empty file under the name)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # (mkstemp's 0600: as open would make it)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_line(path: Path, line: str) -> None:
    """Append `line` to a JSON-lines file (metrics.jsonl, recoveries.jsonl; the controller
    its one writer) whole or not at all (`append_whole`). One write to an O_APPEND
    descriptor, as a rule: a reader polling the file does not see half of it."""
    append_whole(path, (line + "\n").encode())


def append_whole(path: Path, data: bytes, sync: bool = False) -> int:
    """Append `data` to `path` (on disk when this returns, with `sync`); the file's new
    size. A write cut short (a nearly full disk) is taken back: the next line would go on
    at the end of the half one, on its line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # (a write may take only part)
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # (the write's error is the one to see)
                os.ftruncate(fd, size)
            raise
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
