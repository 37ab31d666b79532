"""Pooled shared-memory segments in /dev/shm, for moving tensors between processes.

    consumer                                   producer (another process)
    lease = pool.acquire(n) ── name, offsets ─> SegmentMapper().view(name, off, n)[:] = rows
    arrays = lease.arrays(layout) <─ "done" ───
    torch.from_numpy(a) ... (zero copy)

Writing into a fresh mapping is slow (page faults), so segments are reused, never mapped
anew per transfer, and a producer's mapper caches its mappings. Segments are sized in powers
of two but only the bytes a lease asks for are reserved (fallocate): a write into a sparse
tmpfs file that /dev/shm cannot hold kills the process with SIGBUS; a reservation that does
not fit is a clear error instead, and the rounding costs no memory.

Lifetime rule: a segment returns to its pool when nothing can reach its memory: not the
lease (dropped, or ``release()``d) and no array from ``lease.arrays()``, nor any view, slice
or tensor made from one. All of them hang on one per-lease root array (numpy views,
``torch.from_numpy`` and ``Tensor.numpy`` keep it alive); ``weakref.finalize`` on the root
gives the segment back. If a producer may still write into it (a transfer timed out),
``discard()`` the lease instead: the segment is unlinked and never lent again.

A prefix names one pool of one run and is never reused: a producer's cached mapping would
outlive the old segment. ``cleanup(prefix)`` removes what a killed process left. Linux
only; no ``multiprocessing.shared_memory``: its resource tracker unlinks segments that
other processes still use.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncrl.errors import ClosedError

SHM_DIR = "/dev/shm"
MIN_SEGMENT = 64 * 1024
MAX_OVERSIZE = 4  # a free segment serves a request only if it is at most 4x larger

_NAMES_TRIED = 1024  # names a pool skips, taken, before it gives up
STALE_SCAN_S = 1.0  # how often a mapper reusing its mappings looks for unlinked ones
_clock = time.monotonic  # (tests move it)


def _path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad shared-memory segment name {name!r}: it must be a plain file name")
    return os.path.join(SHM_DIR, name)


def layout(specs: Iterable[tuple[Any, tuple[int, ...]]], align: int = 64
           ) -> tuple[list[tuple[int, np.dtype, tuple[int, ...]]], int]:
    """Place arrays given as (dtype, shape) one after another, each at a multiple of
    ``align`` bytes; return their (offset, dtype, shape) and the total bytes needed."""
    out, end = [], 0
    for dtype, shape in specs:
        dt, shape = np.dtype(dtype), tuple(shape)
        offset = -(-end // align) * align
        out.append((offset, dt, shape))
        end = offset + dt.itemsize * int(np.prod(shape, dtype=np.int64))
    return out, end


class _Returns:
    """Segments given back by finalizers, which run on any thread, even one inside
    acquire() (gc): SimpleQueue.put is safe there. Nothing is kept once the pool is closed."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Segment] = queue.SimpleQueue()
        self.closed = False

    def put(self, seg: _Segment) -> None:
        if not self.closed:
            self.queue.put(seg)


class _Segment:
    # no descriptor kept: the mapping holds one of its own, and a pool of many segments
    # would spend two each; growing the reservation reopens the file (checked by inode)
    __slots__ = ("name", "size", "mm", "inode", "reserved", "retired")

    def __init__(self, name: str, size: int, mm: mmap.mmap, inode: int):
        self.name, self.size, self.mm, self.retired = name, size, mm, False
        self.inode, self.reserved = inode, 0  # bytes from 0 that /dev/shm holds for it


@dataclass(frozen=True)
class PoolStats:
    segments: int
    bytes: int
    in_use: int


class Lease:
    """One segment, lent by a `SegmentPool` until nothing references its memory."""

    __slots__ = ("name", "size", "reserved", "_root", "_ref", "_seg", "_retire")

    def __init__(self, seg: _Segment, root: npt.NDArray[np.uint8], reserved: int,
                 retire: Callable[[_Segment], None]):
        self.name, self.size, self._seg, self._retire = seg.name, seg.size, seg, retire
        self.reserved = reserved  # the bytes asked for: the rest of `size` may be unbacked
        self._root: npt.NDArray[np.uint8] | None = root
        self._ref = weakref.ref(root)

    @property
    def buf(self) -> npt.NDArray[np.uint8]:
        """The reserved bytes as a writable uint8 array (a view: it holds the lease too)."""
        if self._root is None:
            raise RuntimeError(f"lease of segment {self.name!r} was released or handed to "
                               f"arrays(); use those arrays instead")
        return self._root[:self.reserved]

    def arrays(self, spec: Iterable[tuple[int, Any, tuple[int, ...]]]
               ) -> list[npt.NDArray[Any]]:
        """Arrays at the given (offset, dtype, shape) in the segment, ready for
        ``torch.from_numpy``. Call once: the lease hands its memory to these arrays and the
        segment returns to the pool when they, and every view of them, are gone."""
        root = self.buf
        out = []
        for offset, dtype, shape in spec:
            dt = np.dtype(dtype)
            nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
            if offset % dt.alignment:
                raise ValueError(f"offset {offset} of a {dt} array is not a multiple of its "
                                 f"alignment {dt.alignment}; use layout() to place arrays")
            # not the segment's size: a write past the reservation may SIGBUS (see above)
            if offset < 0 or offset + nbytes > self.reserved:
                raise ValueError(
                    f"array of {nbytes} bytes at offset {offset} ends at {offset + nbytes}, "
                    f"beyond the {self.reserved} bytes reserved in segment {self.name!r} of "
                    f"{self.size} bytes; acquire a lease of {offset + nbytes} bytes or more")
            out.append(np.ndarray(tuple(shape), dtype=dt, buffer=root, offset=offset))
        self._root = None
        return out

    def release(self) -> None:
        """Drop the lease's own hold on the segment (idempotent). It returns to the pool
        now if no array or view of ``buf`` is alive, else when the last one dies."""
        self._root = None

    def discard(self) -> None:
        """Unlink the segment and never lend it again, for when a producer may still write
        into it (a transfer failed or timed out). Arrays already made stay valid."""
        root, self._root = self._ref(), None  # held: it cannot be given back meanwhile
        if root is None:
            raise RuntimeError(f"segment {self.name!r} was already given back to its pool; "
                               f"call discard() instead of release(), not after it")
        self._retire(self._seg)


class SegmentPool:
    """Segments named ``f"{prefix}-{n}"`` owned by this process, lent out and reused.
    Thread-safe; leases may be given back (by garbage collection) on any thread."""

    def __init__(self, prefix: str):
        _path(prefix)
        self.prefix = prefix
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._free: list[_Segment] = []
        self._returned = _Returns()
        self._closed = False
        self._paths: list[str] = []
        self._unlink_at_exit = weakref.finalize(self, _unlink_all, self._paths)

    def _drain(self) -> None:
        while True:
            try:
                seg = self._returned.queue.get_nowait()
            except queue.Empty:
                return
            if not seg.retired:
                self._free.append(seg)

    def acquire(self, nbytes: int) -> Lease:
        """Lend a segment of at least ``nbytes``: the smallest free one that fits and is not
        more than 4x too big, else a new one of the next power of two (>= 64 KiB)."""
        if nbytes < 0:
            raise ValueError(f"acquire(nbytes={nbytes}): nbytes must be >= 0")
        with self._lock:
            if self._closed:
                raise ClosedError(f"segment pool {self.prefix!r} is closed")
            self._drain()
            limit = max(MAX_OVERSIZE * nbytes, MIN_SEGMENT)
            fits = [s for s in self._free if nbytes <= s.size <= limit]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
            else:
                seg = self._create(max(MIN_SEGMENT, 1 << max(nbytes - 1, 0).bit_length()))
            try:
                self._reserve(seg, nbytes)
            except OSError as e:
                if e.errno == errno.ENOENT:  # removed: no other process can map it now
                    self._unlink(seg, remove_file=False)  # (the name may be another's now)
                elif seg.reserved:  # it served smaller leases: keep it for them
                    self._free.append(seg)
                else:
                    self._unlink(seg)
                raise
        root = np.frombuffer(seg.mm, np.uint8)
        weakref.finalize(root, self._returned.put, seg).atexit = False
        return Lease(seg, root, nbytes, self._retire)

    def _reserve(self, seg: _Segment, nbytes: int) -> None:
        if nbytes <= seg.reserved:
            return
        try:
            fd = os.open(_path(seg.name), os.O_RDWR | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_ino != seg.inode:  # removed, and the name taken again
                    raise FileNotFoundError(errno.ENOENT, "removed")
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except FileNotFoundError as e:  # (the other processes cannot map it either)
            raise OSError(errno.ENOENT, (
                f"shared-memory segment {_path(seg.name)} was removed by another process "
                f"while this pool used it; do not clean {SHM_DIR} under a running job")) from e
        except OSError as e:
            raise OSError(e.errno, (
                f"cannot reserve {nbytes} bytes of shared memory in {SHM_DIR} ({e.strerror}): "
                f"it is too small or full; give it more room (e.g. docker run --shm-size=8g) "
                f"or free what other processes left there")) from e
        seg.reserved = nbytes

    def _retire(self, seg: _Segment) -> None:
        with self._lock:
            self._unlink(seg)

    def _unlink(self, seg: _Segment, remove_file: bool = True) -> None:
        if self._segments.pop(seg.name, None) is seg:
            seg.retired = True
            path = _path(seg.name)
            self._paths.remove(path)
            if remove_file:
                _unlink_all([path])

    def _create(self, size: int) -> _Segment:
        # named at random: /dev/shm is world-listable, and another user who took the next
        # names of a counter blocked the pool; a name taken all the same (not ours) is
        # skipped and left alone
        for _ in range(_NAMES_TRIED):
            name = f"{self.prefix}-{secrets.token_hex(6)}"
            path = _path(name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(
                f"shared-memory segments {self.prefix}-* up to {path} all exist: a prefix "
                f"must be unique per pool and run; remove leftovers with "
                f"asyncrl.comm.shm.cleanup({self.prefix!r})")
        try:
            os.ftruncate(fd, size)  # sparse: acquire() reserves what each lease needs
            mm = mmap.mmap(fd, size)
            inode = os.fstat(fd).st_ino
        except BaseException:  # (address space, a size refused): no file left behind
            _unlink_all([path])
            raise
        finally:
            os.close(fd)
        self._paths.append(path)
        seg = self._segments[name] = _Segment(name, size, mm, inode)
        return seg

    def stats(self) -> PoolStats:
        with self._lock:
            self._drain()
            segs = self._segments.values()
            return PoolStats(len(segs), sum(s.size for s in segs), len(segs) - len(self._free))

    def close(self) -> None:
        """Unlink every segment and unmap those not in use; a segment still in use is
        unmapped when its last array dies (its memory stays valid until then)."""
        with self._lock:
            self._closed = self._returned.closed = True
            self._drain()
            for seg in self._segments.values():
                with suppress(BufferError):  # arrays still alive
                    seg.mm.close()
            self._segments.clear()
            self._free.clear()
            self._unlink_at_exit()


def _unlink_all(paths: list[str]) -> list[str]:
    """Unlink `paths`; those it did (another user's file of the name is not ours)."""
    done = []
    for path in paths:
        with suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
            done.append(path)
    return done


class SegmentMapper:
    """Writable views of other processes' segments, mapping each on first use. Thread-safe."""

    def __init__(self, max_maps: int = 64) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}  # in order of last use
        self._max_maps = max_maps  # least recently used mappings beyond this are dropped
        self._scanned = _clock()  # when it last looked for unlinked segments

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        with self._lock:
            mm = self._maps.pop(name, None)
            # a new segment often replaces one its owner unlinked (discarded, or its pool
            # closed; names are never reused), and an owner may discard one while it reuses
            # others: unmap those, else they pin their memory (looked for on a cache hit
            # too, but at most once every STALE_SCAN_S: a stat per mapping)
            scan = mm is None or _clock() - self._scanned >= STALE_SCAN_S
            if mm is None:
                mm = self._open(name)
            stale = []
            if scan:
                self._scanned = _clock()
                stale = [n for n in self._maps if not os.path.exists(_path(n))]
            self._maps[name] = mm
            if len(self._maps) > self._max_maps:
                stale += list(self._maps)[:-self._max_maps]
            if offset < 0 or nbytes < 0 or offset + nbytes > len(mm):
                raise ValueError(
                    f"cannot view {nbytes} bytes at offset {offset} (ending at "
                    f"{offset + nbytes}) of shared-memory segment {name!r}, which has "
                    f"{len(mm)} bytes")
            # made under the lock: another thread's forget() may close the mapping once
            # it is unlocked, and a live view is what keeps it open
            view = memoryview(mm)[offset:offset + nbytes]
        for old in stale:
            self.forget(old)
        return view

    @staticmethod
    def _open(name: str) -> mmap.mmap:
        path = _path(name)
        try:  # (not through a link: the name may have been replaced since it was given)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} ({path}) does not exist: its owner closed "
                f"its pool or exited") from None
        except OSError as e:
            if e.errno != errno.ELOOP:  # (ELOOP: a symbolic link)
                raise
            raise PermissionError(f"shared-memory segment {name!r} ({path}) is not a plain "
                                  f"file ({e.strerror}): refused") from None
        try:
            st = os.fstat(fd)
            # a segment our puller unlinked (it gave up) and another user made again under
            # its name: writing rows into it would hand them over
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionError(
                    f"shared-memory segment {name!r} ({path}) is not a file of this user "
                    f"(owner uid {st.st_uid}): refused")
            return mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)

    def forget(self, name: str) -> None:
        """Drop the cached mapping (unmapped once no view of it is alive)."""
        with self._lock:
            mm = self._maps.pop(name, None)
        if mm is not None:
            with suppress(BufferError):  # views still alive; unmapped when they die
                mm.close()

    def forget_prefix(self, prefix: str) -> None:
        """Drop the mappings of the segments named `prefix`... (a group gone: its pools go,
        and a mapping of an unlinked segment would pin its memory)."""
        with self._lock:
            names = [n for n in self._maps if n.startswith(prefix)]
        for name in names:
            self.forget(name)

    def close(self) -> None:
        for name in list(self._maps):
            self.forget(name)


def cleanup(prefix: str, which: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Unlink every file in /dev/shm whose name starts with ``prefix`` (a run's leftovers,
    e.g. of a killed rank) and that `which` picks; return the names removed."""
    _path(prefix)
    found = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR)
             if n.startswith(prefix) and which(n)]
    return [os.path.basename(path) for path in _unlink_all(found)]
