"""Write tracking for differential checkpoints: real writes (numpy, the kernel, another thread,
another process through shared memory) must be seen; what cannot be seen must not be tracked."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.dcp import pagetrack
from ftidask.dcp import track as dcptrack
from ftidask.dcp.track import KnownDigests
from ftidask.model.errors import CheckpointError
from ftidask.storage import files as storage

BLOCK = 16384
N = 4 << 20  # bytes of the tracked array (tracking starts at dcptrack.MIN_TRACKED)


needs_tracking = pytest.mark.skipif(not pagetrack.available(), reason="no userfaultfd WP_ASYNC / PAGEMAP_SCAN here")


def _kw(root: Path, **extra):
    kw = {"ckpt_dir": str(root / "l"), "glbl_dir": str(root / "g"), "meta_dir": str(root / "m"), "enable_dcp": 1,
          "dcp_block_size": BLOCK, "verbosity": 3}
    kw.update(extra)
    return kw


def _recovered(root: Path, like: np.ndarray) -> np.ndarray:
    ctx = ftidask.init(**_kw(root))
    out = np.zeros_like(like)
    ctx.protect(1, out)
    ctx.recover()
    ctx._closed = True  # leave the run to its writer
    return out


class _Run:
    """One protected array, differential checkpoints, and the recovered state after each."""

    def __init__(self, root: Path, array: np.ndarray, **extra) -> None:
        self.root, self.array = root, array
        self.ctx = ftidask.init(**_kw(root, **extra))
        self.ctx.protect(1, array)
        self.next_id = 1
        for _ in range(3):  # both alternating files filled, tracking started
            self.checkpoint()

    def checkpoint(self, level: int = 5):
        info = self.ctx.checkpoint(self.next_id, level)
        self.next_id += 1
        got = _recovered(self.root, self.array)
        assert got.tobytes() == self.array.tobytes()
        return info


@needs_tracking
def test_only_written_blocks_are_hashed_and_every_write_is_seen(tmp_path):
    a = np.random.default_rng(0).random(N // 8)
    run = _Run(tmp_path, a)
    nblocks = N // BLOCK
    quiet = run.checkpoint()
    assert quiet.blocks_changed == 0 and quiet.blocks_hashed <= 2  # the two partly shared edge pages
    raw = a.view(np.uint8)

    def poke_numpy():
        a[1000] += 1

    def poke_kernel():  # the kernel writes into the array: read(2) into it
        r, w = os.pipe()
        os.write(w, b"\x01\x02\x03")
        os.readv(r, [memoryview(raw[3 * BLOCK + 5:3 * BLOCK + 8])])
        os.close(r)
        os.close(w)

    def poke_thread():
        t = threading.Thread(target=lambda: raw.__setitem__(7 * BLOCK + 1, raw[7 * BLOCK + 1] ^ 0xFF))
        t.start()
        t.join()

    def poke_memmove():
        src = (ctypes.c_char * 4)(*b"abcd")
        ctypes.memmove(a.ctypes.data + 11 * BLOCK + 100, src, 4)

    for poke in (poke_numpy, poke_kernel, poke_thread, poke_memmove):
        poke()
        info = run.checkpoint()  # recovered bit for bit (in _Run.checkpoint)
        # The other file lags one checkpoint: it lacks this change and the previous one.
        assert 1 <= info.blocks_changed <= 2, poke.__name__
        assert info.blocks_hashed <= 4, poke.__name__  # the blocks of the page written (a page may straddle two), two edges
        assert info.blocks_total == nblocks
        assert run.checkpoint().blocks_changed == 1  # the other file catches up, nothing re-hashed
    run.ctx.finalize()


@needs_tracking
def test_rewriting_everything_pauses_tracking_then_it_resumes(tmp_path):
    a = np.zeros(N // 8)
    run = _Run(tmp_path, a)
    total = N // BLOCK
    a += 1
    assert run.checkpoint().blocks_hashed == total  # every page written: every block hashed
    a[0] = 5  # the protection was lifted (most pages were written): no fault, everything hashed
    paused = run.checkpoint()
    assert paused.blocks_hashed == total
    a[-1] = 7  # that checkpoint changed few blocks: protected again before this one hashes
    assert run.checkpoint().blocks_hashed == total
    a[5] = 1
    resumed = run.checkpoint()
    assert resumed.blocks_hashed <= 4 and resumed.blocks_changed >= 1
    run.ctx.finalize()


@needs_tracking
def test_shared_memory_is_not_tracked(tmp_path):
    """Another process writes the array through its own page tables: nothing here would see it."""
    buf = mmap.mmap(-1, N)  # MAP_SHARED | MAP_ANONYMOUS
    a = np.frombuffer(buf, np.uint8)
    a[:] = 3
    run = _Run(tmp_path, a)
    assert run.checkpoint().blocks_hashed == N // BLOCK
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        a[5 * BLOCK] = 99
        os._exit(0)
    os.waitpid(pid, 0)
    assert a[5 * BLOCK] == 99
    info = run.checkpoint()
    assert info.blocks_changed == 1
    run.ctx.finalize()
    del a


@needs_tracking
def test_pinned_memory_means_hash_everything(tmp_path, monkeypatch):
    a = np.ones(N // 8)
    run = _Run(tmp_path, a)
    monkeypatch.setattr(pagetrack, "pinned_bytes", lambda: 4096)  # as with an RDMA registration
    a[9] = 2
    info = run.checkpoint()
    assert info.blocks_hashed == N // BLOCK and info.blocks_changed == 1
    monkeypatch.undo()
    # Nothing was protected while pinned: a device may have written unseen, so this one hashes all.
    a[10] = 2
    assert run.checkpoint().blocks_hashed == N // BLOCK
    a[11] = 3
    assert run.checkpoint().blocks_hashed <= 4
    run.ctx.finalize()


@needs_tracking
def test_a_forked_child_leaves_the_parents_tracking_alone(tmp_path):
    """The userfaultfd context acts on the memory of the process that made it: a child that
    checkpoints must not protect (and so hide) the parent's written pages."""
    a = np.ones(N // 8)
    run = _Run(tmp_path, a)
    a[70_000] = 5  # written in the parent, to be seen by its next checkpoint
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        tracking = run.ctx._dcp.tracking
        tracking._vars[1].protected = False  # the branch that protects before hashing
        ok = tracking.before_hash(1, memoryview(a).cast("B")) is None and not tracking.enabled
        os._exit(0 if ok else 1)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    info = run.checkpoint()  # recovered bit for bit
    assert info.blocks_changed >= 1 and info.blocks_hashed <= 4
    run.ctx.finalize()


@needs_tracking
def test_a_failed_checkpoint_loses_no_write(tmp_path, monkeypatch):
    """The scan consumed the written pages; the checkpoint then failed: the next one must still
    write those blocks (the digests were dropped, so everything is hashed)."""
    a = np.ones(N // 8)
    run = _Run(tmp_path, a)
    a[2000] = 3
    real = storage.pwrite_all

    def failing(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "pwrite_all", failing)
    with pytest.raises(CheckpointError):
        run.ctx.checkpoint(run.next_id, 5)
    run.next_id += 1
    monkeypatch.setattr(storage, "pwrite_all", real)
    info = run.checkpoint()
    assert info.blocks_changed >= 1 and info.blocks_hashed == N // BLOCK
    run.ctx.finalize()


@needs_tracking
def test_a_new_array_under_the_same_id_is_tracked_anew(tmp_path):
    a = np.ones(N // 8)
    run = _Run(tmp_path, a)
    b = a.copy()
    b[123] = 4
    run.ctx.protect(1, b)
    run.array = b
    info = run.checkpoint()
    assert info.blocks_changed == 1 and info.blocks_hashed == N // BLOCK
    b[50_000] = 1
    info = run.checkpoint()
    assert info.blocks_changed >= 1 and info.blocks_hashed <= 3
    run.ctx.finalize()


def test_tracking_off_hashes_everything(tmp_path):
    a = np.ones(N // 8)
    run = _Run(tmp_path, a, dcp_page_tracking=0)
    a[1] = 0
    info = run.checkpoint()
    assert info.blocks_hashed == N // BLOCK and info.blocks_changed == 1
    run.ctx.finalize()


# --- the block mapping, pure -----------------------------------------------------------------

def _known(address: int, nbytes: int, dirty_pages: list[int], old: dict[int, tuple[int, np.ndarray]]):
    start = -(-address // pagetrack.PAGE) * pagetrack.PAGE
    stop = (address + nbytes) // pagetrack.PAGE * pagetrack.PAGE
    written = np.array([[start + p * pagetrack.PAGE, start + (p + 1) * pagetrack.PAGE] for p in dirty_pages],
                       np.uint64).reshape(-1, 2)
    return KnownDigests(address, old, dcptrack._dirty_prefix(address, nbytes, start, stop, written))


def test_blocks_map_onto_pages_and_size_changes_invalidate_the_cut_block():
    page = pagetrack.PAGE
    address = 10 * page + 100  # not page-aligned: first and last pages are shared
    old = np.arange(10 * 16, dtype=np.uint8).reshape(10, 16)
    bs = 2 * page
    known = _known(address, 10 * bs - 50, [], {0: (10 * bs - 50, old)})
    digests, stale = known.container(0, 10 * bs - 50, bs)
    assert stale.tolist() == [True] + [False] * 8 + [True]  # the edge pages only
    assert (digests[1:9] == old[1:9]).all()
    known = _known(address, 10 * bs - 50, [6], {0: (10 * bs - 50, old)})  # page 6 of the registered range
    _d, stale = known.container(0, 10 * bs - 50, bs)
    assert stale.nonzero()[0].tolist() == [0, 3, 9]  # page 6 from a start 100 bytes in: block 3
    # The container grew: its old last block was cut short, it is hashed again; new blocks too.
    _d, stale = _known(address, 12 * bs, [], {0: (10 * bs - 50, old)}).container(0, 12 * bs, bs)
    assert stale.nonzero()[0].tolist() == [0, 9, 10, 11]
    # It shrank inside block 4: block 4 is hashed over fewer bytes; the last 100 bytes of block 3
    # lie in the (new) last page, which is shared, so it is hashed too.
    _d, stale = _known(address, 4 * bs + 7, [], {0: (10 * bs - 50, old)}).container(0, 4 * bs + 7, bs)
    assert stale.nonzero()[0].tolist() == [0, 3, 4]


@needs_tracking
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["poke", "region", "all", "grow", "ckpt"]),
                              st.integers(0, 10**7), st.integers(1, 200_000)), min_size=1, max_size=10))
def test_recovery_equals_state_with_tracking(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("track")
    rng = np.random.default_rng(len(ops))
    a = rng.integers(0, 255, size=N, dtype=np.uint8)
    run = _Run(root, a)
    for kind, pos, length in [*ops, ("ckpt", 0, 0)]:
        arr = run.array
        if kind == "poke":
            arr[pos % arr.size] ^= 0x5A
        elif kind == "region":
            lo = pos % arr.size
            arr[lo:lo + length] = rng.integers(0, 255, size=arr[lo:lo + length].size, dtype=np.uint8)
        elif kind == "all":
            arr += 1
        elif kind == "grow":
            grown = np.concatenate((arr, rng.integers(0, 255, size=length, dtype=np.uint8)))
            run.ctx.protect(1, grown)
            run.array = grown
        else:
            run.checkpoint()
    run.ctx.finalize()
