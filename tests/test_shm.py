"""Shared-memory segment pool: cross-process writes, reuse only after views die, threads."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from asyncrl.comm.shm import SHM_DIR, SegmentMapper, SegmentPool, cleanup, layout
from asyncrl.errors import ClosedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


@pytest.fixture
def prefix():
    p = f"asyncrl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield p
    gc.collect()
    cleanup(p)
    assert files(p) == []


@pytest.fixture
def pool(prefix):
    pool = SegmentPool(prefix)
    yield pool
    pool.close()


PRODUCER = """
import sys, numpy as np
from asyncrl.comm.shm import SegmentMapper
name, off_a, off_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mapper = SegmentMapper()
a = np.arange(12, dtype=np.float32).reshape(4, 3) * 1.5
b = np.array([7, -1, 2**40, 0, 3], dtype=np.int64)
mapper.view(name, off_a, a.nbytes)[:] = a.tobytes()
mapper.view(name, off_b, b.nbytes)[:] = b.tobytes()
assert len(mapper._maps) == 1  # one cached mapping for both views
mapper.close()
"""


def test_another_process_writes_rows_the_consumer_reads_zero_copy(pool):
    spec, nbytes = layout([(np.float32, (4, 3)), (np.int64, (5,))])
    lease = pool.acquire(nbytes)
    (off_a, _, _), (off_b, _, _) = spec
    subprocess.run([sys.executable, "-c", PRODUCER, lease.name, str(off_a), str(off_b)],
                   check=True, timeout=60, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})
    a, b = (torch.from_numpy(x) for x in lease.arrays(spec))
    assert torch.equal(a, torch.arange(12, dtype=torch.float32).reshape(4, 3) * 1.5)
    assert b.tolist() == [7, -1, 2**40, 0, 3]
    a[0, 0] = 99.0  # zero copy: the tensor writes the segment itself
    assert np.frombuffer(SegmentMapper().view(lease.name, off_a, 4), np.float32)[0] == 99.0


def test_layout_aligns_offsets_and_sums_bytes():
    spec, nbytes = layout([(np.int8, (3,)), (np.float64, (2, 2)), (np.int32, ())], align=16)
    assert [(o, d, s) for o, d, s in spec] == [
        (0, np.dtype(np.int8), (3,)), (16, np.dtype(np.float64), (2, 2)),
        (48, np.dtype(np.int32), ())]
    assert nbytes == 52


def test_segment_returns_only_after_every_tensor_view_is_gone(pool):
    lease = pool.acquire(1000)
    first = lease.name
    arr, = lease.arrays([(0, np.float32, (250,))])
    tail = torch.from_numpy(arr)[10:]  # a slice of a tensor made from the array
    del arr, lease
    gc.collect()
    assert pool.stats().in_use == 1
    other = pool.acquire(1000)
    assert other.name != first  # not handed out while `tail` can still write it
    tail.fill_(1.0)
    del tail
    gc.collect()
    assert pool.acquire(1000).name == first


@pytest.mark.parametrize("keep", ["numpy slice", "tensor.numpy()", "reshaped view", "buf"])
def test_any_view_keeps_the_segment(pool, keep):
    lease = pool.acquire(4096)
    first = lease.name
    if keep == "buf":
        view = lease.buf[100:200]
        lease.release()
    else:
        arr, = lease.arrays([(64, np.int32, (8, 4))])
        view = {"numpy slice": lambda: arr[2:, 1],
                "tensor.numpy()": lambda: torch.from_numpy(arr)[1].numpy(),
                "reshaped view": lambda: arr.reshape(-1)[3:].view(np.uint8)}[keep]()
        del arr
    del lease
    gc.collect()
    assert pool.stats().in_use == 1
    held = pool.acquire(4096)
    assert held.name != first
    del view
    gc.collect()
    assert pool.acquire(4096).name == first


def test_release_and_dropping_a_lease_give_the_segment_back(pool):
    lease = pool.acquire(10)
    name = lease.name
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(RuntimeError, match="released"):
        lease.arrays([(0, np.uint8, (1,))])
    assert pool.stats().in_use == 0
    lease = pool.acquire(10)
    assert lease.name == name
    del lease  # never released, never used: garbage gives it back too
    assert pool.stats() == pool.stats().__class__(segments=1, bytes=64 * 1024, in_use=0)


def test_a_discarded_segment_is_unlinked_and_never_lent_again(pool, prefix):
    lease = pool.acquire(100)
    name = lease.name
    arr, = lease.arrays([(0, np.int64, (4,))])
    lease.discard()  # e.g. a producer timed out and may still write into it
    assert files(prefix) == [] and pool.stats().segments == 0
    arr[:] = 5  # still mapped while the array lives
    del arr
    gc.collect()
    assert pool.acquire(100).name != name
    assert pool.stats().in_use == 0 and pool.stats().segments == 1
    late = pool.acquire(100)
    late.release()
    gc.collect()
    with pytest.raises(RuntimeError, match="instead of release"):
        late.discard()  # too late: it may already be lent to someone else


def test_sizes_round_up_and_smallest_fitting_segment_is_reused(pool):
    leases = [pool.acquire(n) for n in (1, 100 * 1024, 1 << 20)]
    assert [x.size for x in leases] == [64 * 1024, 128 * 1024, 1 << 20]
    names = [x.name for x in leases]
    for x in leases:
        x.release()
    held = [pool.acquire(50_000), pool.acquire(70_000)]  # each takes the smallest that fits
    assert [x.name for x in held] == names[:2]
    small = pool.acquire(100)  # the 1 MiB one is free but 4x too big: a new segment
    assert small.name not in names and small.size == 64 * 1024
    big = pool.acquire(300_000)  # 1 MiB <= 4 x 300 000
    assert big.name == names[2]
    assert pool.stats().segments == 4 and pool.stats().in_use == 4


def test_threads_acquire_and_drop_concurrently(pool, prefix):
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(tid: int) -> None:
        try:
            rng = np.random.default_rng(tid)
            barrier.wait()
            for i in range(150):
                lease = pool.acquire(int(rng.integers(128, 300_000)))  # (128 written)
                mark = np.full(16, tid * 1000 + i % 1000, dtype=np.int64)
                if i % 2:
                    arr, = lease.arrays([(0, np.int64, (16,))])
                    arr[:] = mark
                    t = torch.from_numpy(arr)[4:]
                    del arr
                    os.sched_yield()
                    assert (t == int(mark[0])).all(), "segment shared by two holders"
                else:
                    lease.buf[:128] = mark.view(np.uint8)
                    os.sched_yield()
                    assert (lease.buf[:128].view(np.int64) == mark).all()
                    lease.release()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    gc.collect()
    stats = pool.stats()
    assert stats.in_use == 0
    on_disk = files(prefix)
    assert stats.segments == len(on_disk) <= 8 * 4  # at most 8 of each size: 64 KiB..512 KiB
    assert stats.bytes == sum(os.path.getsize(os.path.join(SHM_DIR, n)) for n in on_disk)


def test_close_unlinks_everything_and_live_arrays_stay_valid(prefix):
    pool = SegmentPool(prefix)
    arr, = pool.acquire(100).arrays([(0, np.int64, (4,))])
    arr[:] = [1, 2, 3, 4]
    pool.acquire(1 << 20).release()
    assert len(files(prefix)) == 2
    pool.close()
    assert files(prefix) == []
    assert arr.tolist() == [1, 2, 3, 4]  # still mapped until it dies
    with pytest.raises(ClosedError, match=prefix):
        pool.acquire(1)
    del arr
    gc.collect()
    pool.close()  # idempotent


def test_cleanup_removes_a_dead_ranks_segments_only(prefix):
    script = ("import sys, os; from asyncrl.comm.shm import SegmentPool\n"
              "p = SegmentPool(sys.argv[1]); [p.acquire(n) for n in (1, 1 << 17)]\n"
              "os._exit(0)  # killed: nothing is unlinked\n")
    subprocess.run([sys.executable, "-c", script, prefix + "-r0"], check=True, timeout=60,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    bystander = SegmentPool(f"asyncrl-test-other-{uuid.uuid4().hex[:8]}")
    try:
        bystander.acquire(1)
        left = files(prefix)
        assert len(left) == 2 and all(n.startswith(prefix + "-r0-") for n in left)
        assert sorted(cleanup(prefix)) == left
        assert files(prefix) == []
        assert len(files(bystander.prefix)) == 1
    finally:
        bystander.close()
    assert files(bystander.prefix) == []
    with pytest.raises(ValueError, match="plain file name"):
        cleanup("")


def test_a_pool_skips_names_another_took_and_leaves_them(prefix, monkeypatch):
    """/dev/shm is world-listable: another user who saw the first segment's name made the
    next ones. The pool's counter stayed on the taken name: every later segment failed
    for the rank's life; and unlinking another's file (EPERM) failed the group's close.
    Names are drawn at random now (no next name to take); one taken all the same is
    skipped."""
    import asyncrl.comm.shm as shm

    first = SegmentPool(prefix + "-x")
    first.acquire(1).release()
    first.acquire(1 << 20).release()  # two segments: names no counter gives
    assert not {prefix + "-x-0", prefix + "-x-1"} & set(files(prefix)), files(prefix)
    first.close()
    drawn = iter("012")
    monkeypatch.setattr(shm.secrets, "token_hex", lambda n: next(drawn))
    for n in (0, 1):
        os.close(os.open(os.path.join(SHM_DIR, f"{prefix}-{n}"), os.O_CREAT | os.O_WRONLY,
                         0o600))
    pool = SegmentPool(prefix)
    lease = pool.acquire(1)
    assert files(prefix) == [prefix + "-0", prefix + "-1", prefix + "-2"]
    del lease
    pool.close()
    assert files(prefix) == [prefix + "-0", prefix + "-1"]  # not ours: left for cleanup()
    os.chown(os.path.join(SHM_DIR, prefix + "-1"), 12345, 12345)
    real_unlink = os.unlink

    def sticky(path):  # the sticky /dev/shm: another user's file is not ours to remove
        if path.endswith("-1"):
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "unlink", sticky)
        assert cleanup(prefix) == [prefix + "-0"]
    cleanup(prefix)


def test_a_mapper_refuses_a_segment_name_another_user_took_over(pool, tmp_path):
    """A puller that gave a segment up unlinks it; another user who makes a file (or a link)
    under its name before the producer maps it got the rows written into it."""
    mapper = SegmentMapper()
    theirs = os.path.join(SHM_DIR, f"{pool.prefix}-x")
    with open(theirs, "wb") as f:
        f.write(bytes(64))
    os.chown(theirs, 12345, 12345)
    link = os.path.join(SHM_DIR, f"{pool.prefix}-y")
    os.symlink(tmp_path / "elsewhere", link)
    try:
        with pytest.raises(PermissionError, match="not a file of this user .*refused"):
            mapper.view(f"{pool.prefix}-x", 0, 8)
        with pytest.raises(PermissionError, match="is not a plain file"):
            mapper.view(f"{pool.prefix}-y", 0, 8)
        assert not (tmp_path / "elsewhere").exists()
    finally:
        os.unlink(theirs)
        os.unlink(link)


def test_errors_name_the_segment_and_the_numbers(pool):
    mapper = SegmentMapper()
    with pytest.raises(FileNotFoundError, match=f"'{pool.prefix}-7'.*does not exist"):
        mapper.view(f"{pool.prefix}-7", 0, 1)
    lease = pool.acquire(1)
    with pytest.raises(ValueError, match="100 bytes at offset 65500 .ending at 65600.*65536"):
        mapper.view(lease.name, 65500, 100)
    with pytest.raises(ValueError, match="offset -1"):
        mapper.view(lease.name, -1, 1)
    assert len(mapper.view(lease.name, 65436, 100)) == 100
    with pytest.raises(ValueError, match="ends at 65544, beyond the 1 bytes reserved in "
                                         "segment .* of 65536 bytes"):
        lease.arrays([(0, np.float64, (8192 + 1,))])
    with pytest.raises(ValueError, match="not a multiple of its alignment 8"):
        lease.arrays([(4, np.float64, (1,))])
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pool.acquire(-1)
    with pytest.raises(ValueError, match="plain file name"):
        mapper.view("../etc/passwd", 0, 1)
    mapper.close()


def test_mapper_sees_the_owner_memory_and_forget_remaps(pool):
    lease = pool.acquire(1 << 16)
    mapper = SegmentMapper()
    view = mapper.view(lease.name, 8, 4)
    view[:] = b"abcd"
    assert bytes(lease.buf[8:12]) == b"abcd"
    lease.buf[8] = ord("z")
    assert bytes(view) == b"zbcd"
    mapper.forget(lease.name)  # a view is alive: unmapped only when it dies
    assert bytes(view) == b"zbcd"
    del view
    assert bytes(mapper.view(lease.name, 8, 4)) == b"zbcd"
    mapper.close()


def test_a_full_dev_shm_is_a_clear_error_not_a_sigbus(pool, prefix, monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve 100 bytes of shared memory in "
                                      r"/dev/shm .*--shm-size") as info:
        pool.acquire(100)
    assert info.value.errno == errno.ENOSPC
    assert files(prefix) == [] and pool.stats().segments == 0  # nothing left behind
    monkeypatch.undo()
    lease = pool.acquire(100)  # it works again once there is room
    assert lease.size == 64 * 1024
    lease.release()
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert pool.acquire(100).size == 64 * 1024  # reserved already: no new reservation
    with pytest.raises(OSError, match="cannot reserve 40000 bytes"):
        pool.acquire(40_000)  # the same segment, more of it: refused, the segment kept
    assert pool.stats().segments == 1


def test_a_lease_reserves_the_bytes_it_asked_for_not_the_rounded_size(pool, prefix):
    lease = pool.acquire(300 * 1024)  # a 512 KiB segment
    assert lease.size == 512 * 1024
    [name] = files(prefix)
    held = os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
    assert 300 * 1024 <= held < 512 * 1024


def test_a_lease_lends_only_the_bytes_it_reserved(pool):
    """Its arrays and buf ran to the segment's end: 120 KiB written into a 128 KiB segment
    of which 100,000 bytes were reserved, on pages /dev/shm may lack (SIGBUS when full)."""
    lease = pool.acquire(100_000)
    assert (lease.size, lease.reserved, len(lease.buf)) == (128 * 1024, 100_000, 100_000)
    with pytest.raises(ValueError, match="ends at 100001, beyond the 100000 bytes reserved in "
                                         "segment .* of 131072 bytes; acquire a lease of "
                                         "100001 bytes"):
        lease.arrays([(0, np.uint8, (100_001,))])
    arr, = lease.arrays([(0, np.uint8, (100_000,))])
    arr[-1] = 7
    assert len(arr) == 100_000


def test_mapper_unmaps_segments_their_owner_unlinked(pool):
    old, new = pool.acquire(10), pool.acquire(10)
    mapper = SegmentMapper()
    mapper.view(old.name, 0, 1)
    old.discard()  # unlinked: nobody will ask for it again
    mapper.view(new.name, 0, 1)
    assert list(mapper._maps) == [new.name]
    mapper.close()


def test_mapper_unmaps_an_unlinked_segment_while_it_reuses_others(pool, monkeypatch):
    """A consumer discarded one segment (a pull into it timed out) and went on pulling into
    another the producer had mapped: no new name to map, so the producer kept the discarded
    one mapped (its tmpfs memory pinned) until its LRU evicted it. A cache hit now looks
    for unlinked segments too, at most once every STALE_SCAN_S seconds."""
    import asyncrl.comm.shm as shm

    now = [100.0]
    monkeypatch.setattr(shm, "_clock", lambda: now[0])
    old, kept = pool.acquire(10), pool.acquire(10)
    mapper = SegmentMapper()
    mapper.view(old.name, 0, 1)
    mapper.view(kept.name, 0, 1)
    old.discard()
    mapper.view(kept.name, 0, 1)  # within the interval: no scan (kept cheap)
    assert list(mapper._maps) == [old.name, kept.name]
    now[0] += shm.STALE_SCAN_S
    mapper.view(kept.name, 0, 1)  # a cache hit
    assert list(mapper._maps) == [kept.name]
    mapper.close()


def test_a_segment_that_cannot_be_mapped_leaves_no_file(pool, prefix, monkeypatch):
    """Its file stayed in /dev/shm (named in the pool's list) until the pool closed."""
    import mmap as mmap_module

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
    monkeypatch.setattr(mmap_module, "mmap", refused)
    with pytest.raises(OSError, match=os.strerror(errno.ENOMEM)):
        pool.acquire(100)
    assert files(prefix) == [] and pool.stats().segments == 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_segment_holds_one_descriptor_its_mapping_and_still_grows(pool, prefix):
    """Each held two (the pool's and the mapping's own): a pool of many segments ran into
    the descriptor limit twice as soon."""
    before = open_fds()
    leases = [pool.acquire(100) for _ in range(8)]
    assert open_fds() - before == 8
    names = {lease.name for lease in leases}
    del leases  # all back in the pool, 100 bytes reserved each
    grown = pool.acquire(40_000)  # a reused segment reserves more (the file reopened)
    assert grown.name in names
    held = os.stat(os.path.join(SHM_DIR, grown.name)).st_blocks * 512
    assert held >= 40_000 and open_fds() - before == 8
    gone = next(iter(names - {grown.name}))
    os.unlink(os.path.join(SHM_DIR, gone))  # another process cleaned /dev/shm under the job
    with open(os.path.join(SHM_DIR, gone), "wb"):  # and the name was taken again
        pass
    with pytest.raises(OSError, match=rf"{gone} was removed by another process"):
        [pool.acquire(60_000) for _ in range(7)]  # the other seven grow, one of them fails
    assert pool.stats().segments == 7  # that one forgotten, the other file left alone
    assert os.path.exists(os.path.join(SHM_DIR, gone))
    os.unlink(os.path.join(SHM_DIR, gone))
