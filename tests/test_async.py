"""Asynchronous checkpoints in one process: the checkpoint holds the values at the call, bit for bit,
whatever the application does to its arrays afterwards, with each snapshot mechanism in turn; failures
in the background are raised by the handle or by the next call, never lost; the previous checkpoint
stays recoverable."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import leaks
import numpy as np
import pytest
from diskfull import fill, full_commit_records, tmpfs

import ftidask
from ftidask.dcp import pagetrack
from ftidask.engine import snapshot
from ftidask.storage.files import find_paths

MECHANISMS = ["cow", "copy", "blocking"]


def cow_or_skip(mechanism: str) -> None:
    if mechanism != "cow":
        return
    try:
        from ftidask.memsnap.cow import cow_available
    except ImportError:
        pytest.skip("no copy-on-write snapshot in this build")
    ok, why = cow_available()
    if not ok:
        pytest.skip(f"copy-on-write snapshot unavailable: {why}")


def state(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        1: rng.random((512, 1024)),  # 4 MiB: copy-on-write's size
        2: np.asfortranarray(rng.integers(0, 2**31, (300, 700), dtype=np.int32)),  # F order, 840 KiB
        3: rng.integers(0, 255, 5000, dtype=np.uint8),  # small: always copied
        4: np.zeros(1 << 21, dtype=np.float32),  # 8 MiB never touched: pages not populated yet
    }


def restart(dirs: dict, exec_id: str, like: dict[int, np.ndarray], **config) -> dict[int, np.ndarray]:
    ctx = ftidask.init(exec_id=exec_id, **dirs, **config)
    out = {vid: np.zeros_like(a) for vid, a in like.items()}
    for vid, a in out.items():
        ctx.protect(vid, a)
    ctx.recover()
    ctx._close()
    return out


def assert_same(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    for vid in want:
        assert got[vid].tobytes() == want[vid].tobytes(), f"variable {vid} differs"


def scribble_all(arrays: dict[int, np.ndarray]) -> None:
    for a in arrays.values():
        a.reshape(-1, order="A").view(np.uint8)[:] = 0xA5 if a.flags.c_contiguous else 0x5A


def scribble_random(arrays: dict[int, np.ndarray], seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    for a in arrays.values():
        flat = a.reshape(-1, order="A")
        idx = rng.integers(0, flat.size, max(1, flat.size // 50))
        flat[idx] = flat[idx] + 1


def scribble_threads(arrays: dict[int, np.ndarray]) -> None:
    big = arrays[1]
    parts = np.array_split(np.arange(big.shape[0]), 4)
    workers = [threading.Thread(target=lambda rows=rows: big.__setitem__(rows, -3.5)) for rows in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    arrays[4][::1024] = 9.0


def scribble_kernel(arrays: dict[int, np.ndarray], tmp_path) -> None:
    """The kernel writes the pages: read(2) from a file into the protected arrays."""
    for vid, a in arrays.items():
        path = tmp_path / f"noise-{vid}"
        path.write_bytes(os.urandom(a.nbytes))
        with open(path, "rb", buffering=0) as fh:
            assert fh.readinto(memoryview(a.reshape(-1, order="A")).cast("B")) == a.nbytes


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("how", ["all", "random", "threads", "kernel"])
@pytest.mark.parametrize("level", [1, 4])
def test_holds_the_values_at_the_call(dirs, tmp_path, mechanism, how, level):
    cow_or_skip(mechanism)
    arrays = state(level)
    want = {vid: a.copy(order="A") for vid, a in arrays.items()}
    ctx = ftidask.init(async_snapshot=mechanism, **dirs)
    for vid, a in arrays.items():
        ctx.protect(vid, a)
    handle = ctx.checkpoint(1, level, wait=False)
    assert isinstance(handle, ftidask.CheckpointHandle) and handle.mechanism == mechanism
    if how == "all":
        scribble_all(arrays)
    elif how == "random":
        scribble_random(arrays)
    elif how == "threads":
        scribble_threads(arrays)
    else:
        scribble_kernel(arrays, tmp_path)
    info = handle.result(timeout=60)
    assert info.id == 1 and info.level == level and handle.done() and handle.exception() is None
    ctx._close()
    assert_same(restart(dirs, ctx.exec_id, want), want)


@pytest.mark.skipif(snapshot.COPY_THREADS < 2, reason="one core: the copy is not split")
def test_copy_split_over_threads(dirs, monkeypatch):
    """Large contiguous variables (C and F order) are copied by several threads at once: the same bytes."""
    monkeypatch.setattr(snapshot, "PARALLEL_COPY_BYTES", 1 << 20)
    arrays = state(11)
    arrays[5] = np.asfortranarray(np.random.default_rng(5).random((1001, 1003)))  # not a page multiple
    want = {vid: a.copy(order="A") for vid, a in arrays.items()}
    ctx = ftidask.init(async_snapshot="copy", **dirs)
    for vid, a in arrays.items():
        ctx.protect(vid, a)
    handle = ctx.checkpoint(1, 1, wait=False)
    scribble_all(arrays)
    assert any(t.name.startswith("ftidask-copy") for t in threading.enumerate())
    handle.wait()
    ctx._close()
    assert_same(restart(dirs, ctx.exec_id, want), want)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_reprotect_and_resize_after_the_call(dirs, mechanism):
    cow_or_skip(mechanism)
    arrays = state(3)
    want = {vid: a.copy(order="A") for vid, a in arrays.items()}
    ctx = ftidask.init(async_snapshot=mechanism, **dirs)
    for vid, a in arrays.items():
        ctx.protect(vid, a)
    handle = ctx.checkpoint(1, 1, wait=False)
    ctx.protect(1, np.ones(10))  # another array, another size, under the same id
    ctx.protect(3, np.empty(0, np.uint8))
    arrays[1][:] = 0
    del arrays
    handle.wait()
    ctx._close()
    assert_same(restart(dirs, ctx.exec_id, want), want)


@pytest.mark.parametrize("level", [5, 8])
def test_differential_async(dirs, level):
    """Levels 5-8 asynchronously: each checkpoint holds its call's values and only changed blocks move."""
    arrays = state(5)
    ctx = ftidask.init(enable_dcp=1, dcp_block_size=4096, **dirs)
    for vid, a in arrays.items():
        ctx.protect(vid, a)
    ctx.checkpoint(1, level, wait=False).wait()
    ctx.checkpoint(2, level, wait=False).wait()  # the second spare: both written in full once
    arrays[1][:10] += 1.0
    want = {vid: a.copy(order="A") for vid, a in arrays.items()}
    handle = ctx.checkpoint(3, level, wait=False)
    scribble_all(arrays)
    info = handle.result()
    assert info.blocks_changed is not None and info.blocks_changed < info.blocks_total / 10
    if pagetrack.available():  # the live pages were scanned at the call: only their blocks hashed
        assert info.blocks_hashed < info.blocks_total / 10, info
    ctx._close()
    assert_same(restart(dirs, ctx.exec_id, want, enable_dcp=1, dcp_block_size=4096), want)


def test_python_state_taken_at_the_call(dirs):
    box = ftidask.State({"step": 1})
    ctx = ftidask.init(**dirs)
    ctx.protect(1, box)
    ctx.protect(2, np.arange(10.0))
    handle = ctx.checkpoint(1, 1, wait=False)
    box["step"] = 2
    handle.wait()
    ctx._close()
    again = ftidask.State({"step": 0})
    ctx2 = ftidask.init(exec_id=ctx.exec_id, **dirs)
    ctx2.protect(1, again)
    ctx2.protect(2, np.zeros(10))
    ctx2.recover()
    assert again["step"] == 1
    ctx2._close()


def test_config_makes_it_the_default_and_snapshot_too(dirs):
    a = np.zeros(1000)
    ctx = ftidask.init(async_ckpt=1, ckpt_l1=1, snapshot_unit="iterations", **dirs)
    ctx.protect(1, a)
    handle = ctx.checkpoint(1, 1)
    assert isinstance(handle, ftidask.CheckpointHandle)
    assert isinstance(ctx.checkpoint(2, 1, wait=True), ftidask.CheckpointInfo)  # waits for the first, too
    assert handle.done()
    for i in range(3, 8):
        a[:] = i
        assert ctx.snapshot() == ftidask.FTI_DONE
    a[:] = -1  # after the last snapshot call: not in any checkpoint
    ctx.wait()
    assert ctx.last_checkpoint.id == 7
    ctx._close()
    assert restart(dirs, ctx.exec_id, {1: a})[1][0] == 7


def test_background_failure_is_raised_once_and_the_previous_stays(dirs, monkeypatch):
    a = np.arange(4096.0)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1, wait=False).wait()
    with monkeypatch.context() as m:
        full_commit_records(m.setattr)  # the disk is full: the commit record cannot be written
        handle = ctx.checkpoint(2, 1, wait=False)
        a[:] = -1
        assert isinstance(handle.exception(timeout=60), ftidask.CheckpointError)
        with pytest.raises(ftidask.CheckpointError, match="No space left"):
            handle.result()
        unasked = ctx.checkpoint(3, 1, wait=False)  # nobody asks this handle: the next call raises it
        unasked.settled()
        with pytest.raises(ftidask.CheckpointError, match="asynchronous checkpoint 3 .*failed"):
            ctx.checkpoint(4, 1, wait=False)
        ctx.wait()  # raised once only
    a[:] = 5.0  # space freed: checkpoints work again
    ctx.checkpoint(5, 1, wait=False).wait()
    ctx._close()
    assert restart(dirs, ctx.exec_id, {1: a})[1][0] == 5.0
    assert sorted(r.ckpt_id for r in ctx.state.records()) == [5]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_really_full_disk_in_the_background(dirs, tmp_path, mechanism):
    """The node-local disk (a 24 MiB tmpfs) has room for one checkpoint of the 8 MiB state, not two:
    the second fails in the background with ENOSPC, the next call raises it as a CheckpointError, the
    first stays recoverable and nothing of the second is left; once space is freed, checkpoints work."""
    cow_or_skip(mechanism)
    with tmpfs(tmp_path / "node", "24m") as node:
        dirs = dict(dirs, ckpt_dir=str(node / "Local"))
        a = np.random.default_rng(3).random(1 << 20)
        first = a.copy()
        ctx = ftidask.init(async_snapshot=mechanism, **dirs)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1, wait=False).wait()
        filler = fill(node, leave=4 << 20)
        ctx.checkpoint(2, 1, wait=False)
        a[:] = -1.0
        with pytest.raises(ftidask.CheckpointError, match="(?s)asynchronous checkpoint 2.*No space left"):
            ctx.wait()
        assert ctx.last_checkpoint.id == 1
        assert not [p for p in find_paths(Path(dirs["ckpt_dir"]), "*") if "ckpt2" in p.name.lower()]
        assert restart(dirs, ctx.exec_id, {1: a})[1].tobytes() == first.tobytes()
        filler.unlink()
        a[:] = 2.0
        ctx.checkpoint(3, 1, wait=False).wait()
        ctx._close()
        assert (restart(dirs, ctx.exec_id, {1: a})[1] == 2.0).all()


def test_failure_unobserved_is_raised_by_finalize(dirs, monkeypatch):
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(10.0))
    full_commit_records(monkeypatch.setattr)
    ctx.checkpoint(1, 1, wait=False)
    with pytest.raises(ftidask.CheckpointError, match="asynchronous checkpoint 1"):
        ctx.finalize()
    with pytest.raises(ftidask.FTIError, match="finalized"):
        ctx.checkpoint(2, 1, wait=False)


def test_max_inflight_and_finalize_waits(dirs):
    arrays = [np.full(1 << 18, float(i)) for i in range(6)]
    ctx = ftidask.init(max_inflight=3, **dirs)
    ctx.protect(1, arrays[0])
    handles = []
    for i, a in enumerate(arrays, start=1):
        ctx.protect(1, a)
        handles.append(ctx.checkpoint(i, 1, wait=False))
        assert sum(not h.done() for h in handles) <= 3
    ctx.finalize()
    assert all(h.done() and h.exception() is None for h in handles)


def test_recover_waits_for_the_checkpoint_in_flight(dirs):
    a = np.arange(1 << 20, dtype=np.float64)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    want = a.copy()
    handle = ctx.checkpoint(1, 1, wait=False)
    a[:] = 0
    ctx.recover()  # never a half-written checkpoint: this one, once committed
    assert handle.done() and np.array_equal(a, want)
    ctx.finalize()


def test_copy_pool_bound_falls_back_to_blocking(dirs):
    a = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
    ctx = ftidask.init(async_snapshot="copy", async_buffer_mb=1, **dirs)
    ctx.protect(1, a)
    handle = ctx.checkpoint(1, 1, wait=False)
    assert handle.mechanism == "blocking" and handle.done()
    ctx.finalize()


def test_copy_pool_reuses_and_bounds():
    pool = snapshot.CopyPool(limit=10 << 20)
    first = pool.take([4 << 20, 1 << 20])
    assert first is not None and pool.take([6 << 20]) is None  # 5 MiB lent, 6 more would pass 10
    pool.give_back(first)
    again = pool.take([4 << 20, 1 << 20])
    assert again is not None and {id(b) for b in again} == {id(b) for b in first}  # the same buffers
    pool.give_back(again)
    assert pool.take([9 << 20]) is not None  # unmatched free buffers are dropped to make room


def test_bad_mechanism_is_a_config_error(dirs):
    with pytest.raises(ftidask.ConfigError, match="async_snapshot"):
        ftidask.init(async_snapshot="fork", **dirs)


@pytest.mark.parametrize("count", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_many_async_checkpoints_hold_no_resources(dirs, tmp_path, count):
    import resource

    a = np.zeros(1 << 16)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    for i in range(1, 21):
        ctx.checkpoint(i, 1, wait=False)
    ctx.wait()
    # What this run holds (tests/leaks.py): its files and ftidask's kernel objects, ftidask's threads; not a count of
    # the process's descriptors and threads, which what earlier tests left (a Dask cluster's loop) changes by itself
    # (CI saw a count of 55 for 54 in test_io_faults).
    fds, threads = leaks.descriptors(tmp_path), leaks.ftidask_threads()
    total_fds, total_threads = leaks.all_descriptors(), threading.active_count()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(21, count + 1):
        a[:] = i
        ctx.checkpoint(i, 1, wait=False)
    ctx.wait()
    # None more: a remover thread may still be deleting a retired checkpoint (a directory's descriptor), settled()
    # gives it time; a leak per checkpoint (180 or more) stays.
    more_fds = leaks.settled(lambda: leaks.grown(fds, leaks.descriptors(tmp_path)), lambda v: not v)
    more_threads = leaks.settled(lambda: leaks.grown(threads, leaks.ftidask_threads()), lambda v: not v)
    assert not more_fds and not more_threads, (more_fds, more_threads)
    # Whatever their kind (a pipe, a socket): flat too; the slack is for the descriptors and threads that other
    # tests' leftovers open for a moment, far below the 180 that one per checkpoint would make.
    assert leaks.all_descriptors() <= total_fds + 32 and threading.active_count() <= total_threads + 16
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10  # KiB: < 64 MiB more at peak
    assert ctx.last_checkpoint.id == count
    ctx.finalize()


_ENDS_IN_FLIGHT = """
import json, sys
import numpy as np
import ftidask

ctx = ftidask.init(**json.loads(sys.argv[1]), compressor="zstd")
walk = [np.round(np.cumsum(np.random.default_rng(i).standard_normal(6_000_000)), 2) for i in range(3)]
for i, a in enumerate(walk):
    ctx.protect(i + 1, a)
ctx.checkpoint(1, 1)
for a in walk:
    a += 1.0
ctx.checkpoint(2, 1, wait=False)
# the program ends here, checkpoint 2 in flight, without finalize (the run stays restartable)
"""


def test_a_program_that_ends_with_a_checkpoint_in_flight_commits_it(dirs):
    """The interpreter's exit stops every thread pool from taking work before it joins the threads: the
    checkpoint in flight then failed on its first task (compressed frames, hashes) and was never committed.
    It is now finished first, as the docs say (finalize, or the end of the program, waits for it)."""
    import json

    from conftest import run_python

    run_python(_ENDS_IN_FLIGHT, json.dumps(dirs))
    ctx = ftidask.init(**dirs)
    out = [np.zeros(6_000_000) for _ in range(3)]
    for i, a in enumerate(out):
        ctx.protect(i + 1, a)
    ctx.recover()
    assert ctx.recovered_from == (2, 1)
    want = [np.round(np.cumsum(np.random.default_rng(i).standard_normal(6_000_000)), 2) + 1.0 for i in range(3)]
    assert all(np.array_equal(a, w) for a, w in zip(out, want))
    ctx.finalize()
