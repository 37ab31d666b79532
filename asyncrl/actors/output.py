"""A rank's stdout and stderr, streamed to the controller line by line (a line ends at a
newline, at a carriage return: each redraw of a progress bar is a line, or after LINE_CAP
bytes without either; what has no end yet is sent after PARTIAL_S of quiet: a progress bar's
last redraw, a `print(..., end="")`).

    fd 1, fd 2 ──▶ pipe ──▶ tee ──▶ the original stdout (torchrun's group log keeps
                             │         every byte, as before)
                             └──▶ pipe ──▶ reader thread ──▶ send(lines) every 0.1 s, at
                                           most `max_bytes_per_s` a second (more is counted,
                                           not sent: the group log has it)

Print from anywhere (C extensions too: the file descriptors themselves are redirected).
`tee` is a process of its own (coreutils'), in a session of its own: what a dying rank wrote
last (a C++ `terminate called...` before abort, a fault's traceback) still reaches the log
after the rank and its reader thread are gone; the controller's report of the dead rank
shows that log's tail. Without a `tee -p`, the reader thread copies to the log itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

FLUSH_S = 0.1
LINE_CAP = 64 * 1024  # output without a line end is sent in pieces of this size
PARTIAL_S = 1.0  # a line without its end yet is sent after this long without output (its
# end, when it comes, ends no line of its own: the rest arrives as a line of its own)


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of `data`, and the rest (at most LINE_CAP bytes) to complete. A
    carriage return ends a line like a newline, but makes no empty line of its own (CRLF,
    tqdm's leading one)."""
    *complete, rest = data.split(b"\n")
    lines: list[bytes] = []
    for line in complete:
        lines.extend([piece for piece in line.split(b"\r") if piece] or [b""])
    # maybe half a CRLF, or of a \r\r\n: what comes next says; the line stays held with
    # one \r (a run of them ends a line as one does; the rest stays bounded)
    body = rest.rstrip(b"\r")
    held = body != rest
    *redrawn, rest = body.split(b"\r")
    lines.extend(piece for piece in redrawn if piece)
    rest += b"\r" if held else b""
    while len(rest) - held > LINE_CAP:
        cut = LINE_CAP
        while cut > LINE_CAP - 3 and rest[cut] & 0xC0 == 0x80:  # not inside a UTF-8 char
            cut -= 1
        lines.append(rest[:cut])
        rest = rest[cut:]
    return lines, rest


class OutputCapture:
    def __init__(self, send: Callable[[list[str], int], None],
                 max_bytes_per_s: int = 1 << 20):
        self._send = send
        self._budget = max_bytes_per_s
        self._read_fd = -1
        self._original = -1
        self._thread: threading.Thread | None = None
        self._mirror = True  # copy to the original stdout (torchrun's log)
        self._unsent = 0  # lines a failed send lost
        self._tee: subprocess.Popen[bytes] | None = None
        self._closing = False

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        self._original = os.dup(1)
        tee = _tee(read_fd, self._original)
        if tee is not None:
            os.close(read_fd)
            self._tee, read_fd = tee
            self._mirror = False  # tee writes the log
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        self._thread = threading.Thread(target=self._pump, name="asyncrl-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            self._read_lines()
        except BaseException as e:  # noqa: BLE001 - nobody would drain the pipe: every
            # print would block once it filled; the log alone from now on
            os.dup2(self._original, 1)
            os.dup2(self._original, 2)
            note = f"[asyncrl] this rank's output reader failed ({type(e).__name__}: {e}):" \
                   f" its output goes to this log only"
            self._forward([note], 0)
            with contextlib.suppress(OSError):
                os.write(self._original, note.encode() + b"\n")

    def _read_lines(self) -> None:
        partial, lines, dropped = b"", [], 0
        window, sent = time.monotonic(), 0
        last_flush = partial_since = time.monotonic()
        cut = False  # the last line was sent before its end (PARTIAL_S)
        poller = select.poll()  # (select() refuses a descriptor >= 1024: a group of a
        poller.register(self._read_fd, select.POLLIN)  # thousand ranks' gloo sockets)
        while True:
            ready = poller.poll(FLUSH_S * 1000)
            chunk = os.read(self._read_fd, 65536) if ready else b""
            if ready and not chunk:  # every writer closed: the rank is exiting
                if partial.rstrip(b"\r"):
                    lines.append(partial.rstrip(b"\r").decode(errors="replace"))
                if lines or dropped:
                    self._forward(lines, dropped)
                if self._tee is not None and not self._closing:  # the tee died (killed):
                    self._tee_gone()  # prints would fail on its broken pipe
                return
            now = time.monotonic()
            complete: list[bytes] = []
            if chunk:
                self._copy_to_log(chunk)
                data = _after_cut(chunk) if cut else chunk
                cut = cut and not chunk.strip(b"\r")  # (only a held "\r": that line's end
                complete, partial = split_lines(partial + data)  # may still come)
                partial_since = now  # (output flows: a line built slowly is not cut)
            if partial.rstrip(b"\r") and now - partial_since >= PARTIAL_S:  # quiet since
                complete.append(partial.rstrip(b"\r"))  # (a hung rank's last words, a
                partial, cut = b"", True  # progress bar's last redraw: not held back)
            if complete:
                if now - window >= 1.0:
                    window, sent = now, 0
                for raw in complete:
                    if sent + len(raw) > self._budget:
                        dropped += 1
                        continue
                    sent += len(raw) + 1
                    lines.append(raw.decode(errors="replace"))
            if (lines or dropped) and now - last_flush >= FLUSH_S:
                self._forward(lines, dropped)
                lines, dropped, last_flush = [], 0, now

    def _copy_to_log(self, chunk: bytes) -> None:
        if self._mirror:
            try:
                os.write(self._original, chunk)
            except OSError:  # the log's disk is full or its pipe broke: the lines still
                self._mirror = False  # reach the controller, and the pump goes on (a
                # pipe nobody drains would block every print)

    def _forward(self, lines: list[str], dropped: int) -> None:
        try:
            self._send(lines, dropped + self._unsent)
            self._unsent = 0
        except Exception:  # noqa: BLE001 - the controller gone, or its queue full: these
            self._unsent += dropped + len(lines)  # lines are in torchrun's log only (counted
            # as dropped with the next send); the pump must go on draining the pipe

    def _tee_gone(self) -> None:
        os.dup2(self._original, 1)  # the log alone from now on
        os.dup2(self._original, 2)
        note = "[asyncrl] the output tee exited: this rank's output goes to this log only"
        self._forward([note], 0)
        with contextlib.suppress(OSError):
            os.write(self._original, note.encode() + b"\n")

    def close(self, timeout: float = 2.0) -> bool:
        """Send what is left: point fds 1 and 2 back at the original stdout (the pipe's last
        writers), let the reader drain it. False if it still runs after `timeout` (a child
        process holds the pipe): its socket is still its own."""
        if self._thread is None:
            return True
        self._closing = True
        os.dup2(self._original, 1)
        os.dup2(self._original, 2)
        self._thread.join(timeout)  # (tee's end: the pipe's last writers closed)
        if self._tee is not None:
            self._tee.poll()  # reaped if done (a child of the rank's may still write)
        return not self._thread.is_alive()


def _after_cut(data: bytes) -> bytes:
    """`data` that follows a line sent before its end: its leading line end ends that line,
    not an empty one (a progress bar's closing newline)."""
    return data.lstrip(b"\r").removeprefix(b"\n")


def _tee(source: int, log: int) -> tuple[subprocess.Popen[bytes], int] | None:
    """A `tee` copying pipe `source` to `log` and to a new pipe, and that pipe's read end;
    None where there is no tee that keeps going once that pipe's reader is gone (`-p`)."""
    path = tee_path()
    if path is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        # the log is tee's stdout, the very file description (its offset shared with
        # torchrun's other writers); the reader's pipe is the file it opens
        tee = subprocess.Popen([path, "-p", f"/dev/fd/{write_fd}"], stdin=source, stdout=log,
                               stderr=log, pass_fds=(write_fd,), start_new_session=True)
    except OSError:
        os.close(read_fd)
        return None
    finally:
        os.close(write_fd)
    return tee, read_fd


@functools.cache
def tee_path() -> str | None:
    """coreutils' tee, where it copies to a /dev/fd pipe as `_tee` asks (busybox's has no
    -p; a system may lack /dev/fd)."""
    path = shutil.which("tee")
    if path is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        done = subprocess.run([path, "-p", f"/dev/fd/{write_fd}"], input=b"ok",
                              capture_output=True, pass_fds=(write_fd,), timeout=10)
        os.close(write_fd)
        write_fd = -1
        ok = done.returncode == 0 and os.read(read_fd, 2) == b"ok"
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
    return path if ok else None
