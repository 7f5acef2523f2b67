"""A restart on another number of ranks into arrays in use of every kind (ftidask.engine.reshard: their pieces
verified, the ranks agreed, then read from the files into the arrays, tests/test_reshard_in_place.py): NumPy's
ndarray subclasses the same layout recovers (an np.matrix, a record array, a memory map), views (strided, reversed,
of the other order) of every variable kind of tests/test_reshard_reader_matrix.py, a file deleted, cut, replaced or
touched after the agreement (beside a fresh array whose verified pages were staged: given back, and the same
context recovers again), a newest checkpoint refused after its pieces were verified (a Python state that does not
decode): the older one recovered, nothing of the refused one read into the arrays. The ranks are threads over the
real engine (``run_ranks``)."""

from __future__ import annotations

import os
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import test_reshard_pages_paths as pages
import test_reshard_reader_matrix as matrix
from freshpages import map_large_arrays_afresh
from test_reshard_in_place import recovery_error

import ftidask
from ftidask.api.context import Context
from ftidask.engine import pagemove, reshard
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.model.errors import RecoveryError
from ftidask.storage.files import find_paths

G = (12, 10)
REC = np.dtype([("a", "<i4"), ("b", ">f8")])


def _config(base: Path, node_size: int = 1):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=node_size, group_size=2, verbosity=4)


def _sl(off, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(off, shape))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # numpy's word on np.matrix
@pytest.mark.parametrize("new", [1, 2, 3])
@pytest.mark.parametrize("kind", ["matrix", "matrix-columns", "recarray", "memmap"])
def test_ndarray_subclasses_in_use_are_recovered_bit_for_bit(tmp_path: Path, kind: str, new: int) -> None:
    """4 old ranks (row bands) onto 1-3 new ones (row bands: pieces that are runs of the old streams, read straight
    into the array; or column bands). Before, an np.matrix flattened stayed 2-D (1, n): the pieces read straight into
    it were sliced by rows, the bytes landed elsewhere than verified, and a sound checkpoint was refused for ever
    ('data hash does not match', after part of it was written into the array)."""
    dtype = REC if kind == "recarray" else np.dtype(np.float64)
    g = (np.arange(G[0] * G[1]) * 3 + 1).astype(dtype).reshape(G)

    def write(t) -> None:
        ctx = Context(_config(tmp_path), t)
        lo, hi = G[0] * t.rank // 4, G[0] * (t.rank + 1) // 4
        ctx.protect(1, g[lo:hi].copy(), global_shape=G, offset=(lo, 0))
        ctx.checkpoint(1, 1)
        ctx._close()

    assert run_ranks(_config(tmp_path), 4, write, wait=120)[1] == []

    def program(t):
        ctx = Context(_config(tmp_path), t)
        d = 1 if kind == "matrix-columns" else 0
        lo, hi = G[d] * t.rank // new, G[d] * (t.rank + 1) // new
        off = (0, lo) if d else (lo, 0)
        shape = (G[0], hi - lo) if d else (hi - lo, G[1])
        if kind.startswith("matrix"):
            a = np.matrix(np.full(shape, -1.0))
        elif kind == "recarray":
            a = np.rec.array(np.zeros(shape, REC))
        else:
            a = np.memmap(tmp_path / f"map{t.rank}", dtype=dtype, mode="w+", shape=shape)
            a[...] = -1
        ctx.protect(1, a, global_shape=G, offset=off)
        return recovery_error(ctx), type(a).__name__, np.asarray(a).tobytes() == np.ascontiguousarray(g[_sl(off, shape)]).tobytes()

    results, errors = run_ranks(_config(tmp_path), new, program, wait=120)
    assert errors == [], errors
    name = {"recarray": "recarray", "memmap": "memmap"}.get(kind, "matrix")
    assert results == [("", name, True)] * new, results


def _view(want: np.ndarray, kind: str) -> np.ndarray:
    """An array in use of ``want``'s dtype and shape: a strided or reversed view, or of the other order."""
    if want.ndim == 0:
        return np.zeros((), want.dtype)
    if kind == "strided":
        return np.zeros(tuple(2 * n + 1 for n in want.shape), want.dtype)[tuple(slice(1, None, 2) for _ in want.shape)]
    if kind == "reversed":
        return np.zeros(tuple(n + 2 for n in want.shape), want.dtype)[tuple(slice(-2, 0, -1) for _ in want.shape)]
    return np.zeros(want.shape, want.dtype, order="C" if want.flags.f_contiguous and want.ndim > 1 else "F")


@pytest.mark.parametrize("kind", ["strided", "reversed", "other-order"])
@pytest.mark.parametrize("size", [1, 3])
def test_views_in_use_of_every_variable_kind_are_recovered_bit_for_bit(tmp_path: Path, size: int, kind: str) -> None:
    matrix._write(tmp_path)

    def program(t):
        ctx = Context(matrix._config(tmp_path), t)
        arrays = {}
        for vid in matrix.VARS:
            want, kw = matrix._want(vid, t.rank, size, 2, old=False)
            arrays[vid] = (_view(want, kind), want)
            ctx.protect(vid, arrays[vid][0], **kw)
        ctx.recover()
        ctx._close()
        return ctx.recovered_from, {vid: a.tobytes() == w.tobytes() for vid, (a, w) in arrays.items()}

    results, errors = run_ranks(matrix._config(tmp_path), size, program, wait=120)
    assert errors == [], errors
    assert results == [((2, 1), {vid: True for vid in matrix.VARS})] * size, results


BIG = 3 << 20  # float64: 24 MiB a new rank, fresh (its verified pages staged, then moved under it)


@pytest.mark.skipif(not pagemove.enabled, reason="needs the native page helper")
@pytest.mark.parametrize("how", ["deleted", "cut", "replaced", "touched"])
def test_a_file_gone_or_changed_after_the_agreement_fails_alike_and_the_same_context_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Old rank 1's file deleted, cut by 10 bytes, replaced by a copy of itself (another inode) or only touched
    after every rank verified it and agreed: every rank raises the same error ('failed while loading'), the fresh
    array's staged pages are given back (its own pages still never touched), and once the file is back the same
    context recovers every array exactly (the fresh one's verified pages moved under it)."""
    map_large_arrays_afresh()
    n = 1 << 14
    g1, g2 = np.arange(n, dtype=np.float64) / 3, np.arange(BIG * 2, dtype=np.float64) * 2

    def write(t) -> None:
        ctx = Context(_config(tmp_path), t)
        for vid, g in ((1, g1), (2, g2)):
            lo, hi = len(g) * t.rank // 4, len(g) * (t.rank + 1) // 4
            ctx.protect(vid, g[lo:hi].copy(), global_shape=g.shape, offset=(lo,))
        ctx.checkpoint(1, 1)
        ctx._close()

    assert run_ranks(_config(tmp_path), 4, write, wait=120)[1] == []
    (path,) = find_paths(tmp_path / "Local", "Ckpt1-Rank1.fti")
    saved = path.read_bytes()
    once, done = threading.Lock(), []

    def change() -> None:
        with once:
            if done:
                return
            done.append(how)
            if how == "deleted":
                path.unlink()
            elif how == "cut":
                os.truncate(path, len(saved) - 10)
            elif how == "replaced":
                path.with_suffix(".new").write_bytes(saved)
                os.replace(path.with_suffix(".new"), path)
            else:
                os.utime(path)

    monkeypatch.setattr(reshard, "BEFORE_LOAD", change)

    def program(t):
        ctx = Context(_config(tmp_path), t)
        lo, hi = n * t.rank // 2, n * (t.rank + 1) // 2
        arr = np.full(hi - lo, -1.0)  # in use
        ctx.protect(1, arr, global_shape=g1.shape, offset=(lo,))
        big = pages._fresh((BIG,))
        ctx.protect(2, big, global_shape=g2.shape, offset=(BIG * t.rank,))
        errors, untouched = [], None
        for _ in range(2):
            try:
                ctx.recover()
                errors.append("")
            except RecoveryError as exc:
                errors.append(str(exc))
                untouched = pagemove.movable(big)  # its staged pages never moved under it, nor copied into it
            if t.rank == 0 and how in ("deleted", "cut"):  # back as it was (the seam, called once, changes no more)
                path.write_bytes(saved)
            t.allgather(0)
        exact = [arr.tobytes() == g1[lo:hi].tobytes(), big.tobytes() == g2[BIG * t.rank:BIG * (t.rank + 1)].tobytes()]
        ctx._close()
        return errors, untouched, exact

    moved = pagemove.stats["moved_bytes"]
    results, errors = run_ranks(_config(tmp_path), 2, program, wait=120)
    assert errors == [] and done == [how], (errors, done)
    assert len({r[0][0] for r in results}) == 1 and "failed while loading" in results[0][0][0], results
    assert [(r[0][1], r[1], r[2]) for r in results] == [("", True, [True, True])] * 2, results
    assert pagemove.stats["moved_bytes"] - moved >= 2 * (BIG * 8 - 2 * 4096)  # the second recovery's, moved


def test_a_newest_checkpoint_refused_after_its_pieces_were_verified_never_reaches_the_arrays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks on 2 nodes, then on 1 (Python states are redistributed onto as many ranks only): checkpoint 2's
    pieces are verified, then its Python state does not decode on rank 0, every rank refuses it; checkpoint 1 is
    recovered. The arrays in use hold checkpoint 1 exactly, and only checkpoint 1's pieces were read into them."""
    n = 1 << 12

    def want(rank: int, ckpt: int) -> np.ndarray:
        return np.arange(rank * n, (rank + 1) * n, dtype=np.float64) + ckpt / 4

    def write(t) -> None:
        ctx = Context(_config(tmp_path, 1), t)
        a, value = np.empty(n), ftidask.Value()
        ctx.protect(1, a, global_shape=(2 * n,), offset=(t.rank * n,))
        ctx.protect(9, value)
        for ckpt, level, state in ((1, 2, {"k": 1}), (2, 1, 5)):
            a[...], value.value = want(t.rank, ckpt), state
            ctx.checkpoint(ckpt, level)
        ctx._close()

    assert run_ranks(_config(tmp_path, 1), 2, write, wait=120)[1] == []
    loads = []
    monkeypatch.setattr(reshard, "BEFORE_LOAD", lambda: loads.append(1))

    def program(t):
        ctx = Context(_config(tmp_path, 2), t)
        a = np.full(n, -1.0)  # in use
        ctx.protect(1, a, global_shape=(2 * n,), offset=(t.rank * n,))
        ctx.protect(9, ftidask.State() if t.rank == 0 else ftidask.Value())  # checkpoint 2 holds 5: not a dict
        ctx.recover()
        ctx._close()
        return ctx.recovered_from, a.tobytes() == want(t.rank, 1).tobytes()

    results, errors = run_ranks(_config(tmp_path, 2), 2, program, wait=120)
    assert errors == [] and results == [((1, 2), True)] * 2, (errors, results)
    assert len(loads) == 2, loads  # once a rank: checkpoint 1's


def _rss(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def test_small_arrays_in_use_are_verified_in_less_memory_than_a_buffer_of_theirs(tmp_path: Path) -> None:
    """4 variables of 1.1 MiB an old rank (18 MiB in all), 4 old ranks onto 2 new ones: each old file's containers
    are verified on threads (more than 4 MiB a file), each thread's read buffers no larger than its containers.
    Before, each thread zeroed a ring of 12 MiB whatever it checked: the peak was 3.6x the arrays, where a buffer of
    each array's size (the restart before its pieces were read into the arrays in use) made it 2.0x; now 1.7x."""
    nv, per = 4, 150_000  # float64 an old rank, per variable
    map_large_arrays_afresh()  # every array and buffer of 1 MiB or more its own mapping: counted, given back

    def write(t) -> None:
        ctx = Context(_config(tmp_path), t)
        for v in range(nv):
            ctx.protect(v + 1, np.arange(per, dtype=np.float64) + per * t.rank + v, global_shape=(4 * per,),
                        offset=(per * t.rank,))
        ctx.checkpoint(1, 1)
        ctx._close()

    assert run_ranks(_config(tmp_path), 4, write, wait=120)[1] == []

    def program(t):
        ctx = Context(_config(tmp_path), t)
        arrays = [np.full(2 * per, -1.0) for _ in range(nv)]  # in use
        for v, a in enumerate(arrays):
            ctx.protect(v + 1, a, global_shape=(4 * per,), offset=(2 * per * t.rank,))
        ctx.recover()
        ctx._close()
        return all(a.tobytes() == (np.arange(2 * per * t.rank, 2 * per * (t.rank + 1), dtype=np.float64) + v).tobytes()
                   for v, a in enumerate(arrays))

    # Python's and NumPy's allocations traced (tracemalloc), not the process's resident memory: in the whole default
    # run this process also hosts other tests' Dask scheduler, whose memory moved VmHWM by more than the margin.
    tracemalloc.start()
    try:
        results, errors = run_ranks(_config(tmp_path), 2, program, wait=120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert errors == [] and results == [True, True], (errors, results)
    held = nv * per * 4 * 8  # the arrays, allocated and filled in the recovery's threads
    assert peak < 1.85 * held, f"peak {peak / (1 << 20):.1f} MiB for {held / (1 << 20):.1f} MiB of arrays"
