"""A restart on another number of ranks into arrays already in use (written before ``recover()``, as a program that
sets its initial state first does): their pieces are verified first (every container that holds one, against its
hash), the ranks agree, then the pieces are read from the files into the arrays, each file checked to be the one
verified and unchanged (as a recovery on the same layout reads into arrays in use). Before, each such array was
staged whole in a private buffer of its size, then copied: a restart on fewer ranks (larger blocks) needed twice its
arrays' memory. 4 old ranks, 2 new ones; the ranks are threads over the real engine (``run_ranks``)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from ftidask.api.context import Context
from ftidask.engine import reshard
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff import reader
from ftidask.ftiff.reader import parse_ftiff
from ftidask.model.config import load_config
from ftidask.model.errors import RecoveryError
from ftidask.storage.files import find_paths

OLD, NEW = 4, 2
MIB = 1 << 20


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, verbosity=4)


def recovery_error(ctx: Context) -> str:
    """``ctx.recover()``, then close the context (as a job that ends); the RecoveryError's text, '' when none."""
    try:
        ctx.recover()
    except RecoveryError as exc:
        return str(exc)
    finally:
        ctx._close()
    return ""


def _glob(n1: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Variable 1: 1-D float64 (pieces that are runs of the old streams); variable 2: 2-D int32, old blocks a 2x2
    grid, new ones row bands (strided pieces, containers cut)."""
    return np.arange(n1, dtype=np.float64) * 0.5 - 3, (np.arange(rows * 64, dtype=np.int32) * 7).reshape(rows, 64)


def _block(vid: int, rank: int, size: int, n1: int, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if vid == 1:
        lo, hi = n1 * rank // size, n1 * (rank + 1) // size
        return (lo,), (hi - lo,)
    if size == OLD:
        return (rank // 2 * rows // 2, rank % 2 * 32), (rows // 2, 32)
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    return (lo, 0), (hi - lo, 64)


def _sl(off, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(off, shape))


def _write(base: Path, n1: int, rows: int) -> None:
    g = _glob(n1, rows)

    def program(t) -> None:
        ctx = Context(_config(base), t)
        for vid in (1, 2):
            off, shape = _block(vid, t.rank, OLD, n1, rows)
            ctx.protect(vid, g[vid - 1][_sl(off, shape)].copy(), global_shape=g[vid - 1].shape, offset=off)
        ctx.checkpoint(1, 1)
        ctx._close()

    assert run_ranks(_config(base), OLD, program, wait=240)[1] == []


def _recover(base: Path, n1: int, rows: int, g: tuple[np.ndarray, np.ndarray] | None = None,
             peak: list | None = None) -> list:
    """Each new rank recovers into arrays it filled first: (the error, if any; whether each array holds its block
    of the checkpoint, ``g`` the global arrays; whether each still holds its fill). ``peak``: the process's peak
    memory during the recovery, beyond what it held before, appended (the arrays compared after it is read)."""
    g = g or _glob(n1, rows)

    def program(t):
        ctx = Context(_config(base), t)
        arrays = {}
        for vid in (1, 2):
            off, shape = _block(vid, t.rank, NEW, n1, rows)
            arrays[vid] = np.full(shape, -1, g[vid - 1].dtype)  # in use: every page touched
            ctx.protect(vid, arrays[vid], global_shape=g[vid - 1].shape, offset=off)
        return recovery_error(ctx), arrays

    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS (Linux 4.0+)
    results, errors = run_ranks(_config(base), NEW, program, wait=240)
    if peak is not None:
        peak.append(_rss("VmHWM") - before)
    assert errors == [], errors
    return [(error, [np.array_equal(arrays[v], g[v - 1][_sl(*_block(v, rank, NEW, n1, rows))]) for v in (1, 2)],
             [bool((arrays[v] == -1).all()) for v in (1, 2)]) for rank, (error, arrays) in enumerate(results)]


def _rss(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


@pytest.mark.slow
def test_arrays_in_use_are_recovered_without_a_buffer_of_their_size(tmp_path: Path) -> None:
    n1, rows = 32 << 20, 1024  # variable 1: 256 MiB in all, 128 MiB a new rank; variable 2: 256 KiB
    _write(tmp_path, n1, rows)
    peaks: list[int] = []
    results = _recover(tmp_path, n1, rows, _glob(n1, rows), peaks)
    peak = peaks[0]
    assert [r[:2] for r in results] == [("", [True, True])] * NEW, [r[:2] for r in results]
    arrays = n1 * 8 + rows * 64 * 4
    # the arrays themselves (filled first) and the verifying threads' read buffers; before, a buffer of each
    # array's size came on top (peak >= 2x the arrays)
    assert peak < 1.6 * arrays, f"peak {peak / MIB:.0f} MiB for {arrays / MIB:.0f} MiB of arrays"


def _flip(base: Path, name: str, vid: int) -> None:
    """One byte of variable ``vid``'s container in old file ``name`` flipped (again: back as it was)."""
    (path,) = find_paths(base / "Local", name)
    with open(path, "rb") as fh:
        meta = next(m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == vid and m.chunksize)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(meta.fptr + meta.chunksize // 2)
        fh.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("vid", [1, 2])
def test_a_file_changed_after_the_agreement_fails_on_every_rank_and_a_new_recovery_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vid: int) -> None:
    """Old rank 1's file changed (a byte flipped) after every rank verified it and agreed, before the arrays are
    read: the ranks that read it find it changed (never the flipped byte in an array unnoticed), every rank raises
    the same error; with the file restored, a new recovery reads it (no stale verdict kept)."""
    n1, rows = 1 << 16, 64
    _write(tmp_path, n1, rows)
    once = threading.Lock()
    flipped = []

    def change() -> None:
        with once:
            if not flipped:
                _flip(tmp_path, "Ckpt1-Rank1.fti", vid)
                flipped.append(True)

    monkeypatch.setattr(reshard, "BEFORE_LOAD", change)
    results = _recover(tmp_path, n1, rows)
    assert flipped and len({r[0] for r in results}) == 1, results
    message = results[0][0]
    assert "failed while loading" in message and ("changed" in message or "modified" in message), message
    monkeypatch.setattr(reshard, "BEFORE_LOAD", None)
    _flip(tmp_path, "Ckpt1-Rank1.fti", vid)  # back as it was
    assert [r[:2] for r in _recover(tmp_path, n1, rows)] == [("", [True, True])] * NEW


def test_runs_of_the_stream_are_copied_in_pieces_over_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces that are runs of an old stream (variable 1) go to the copying threads of a recovery on the same
    layout (``reader.copy_direct``), cut here in pieces of 3 pages over 3 threads: every byte where it belongs; a file
    cut short after the agreement is found changed on every rank."""
    monkeypatch.setattr(reader, "_COPY_PIECE", 3 * 4096)
    monkeypatch.setattr(reader, "_COPY_THREADS", 3)
    n1, rows = 100_003, 64  # blocks of odd sizes: pieces that start and end inside pages and containers
    _write(tmp_path, n1, rows)
    assert [r[:2] for r in _recover(tmp_path, n1, rows)] == [("", [True, True])] * NEW
    (path,) = find_paths(tmp_path / "Local", "Ckpt1-Rank2.fti")
    whole = path.read_bytes()
    cut = []

    def truncate() -> None:
        if not cut:
            cut.append(True)
            with open(path, "r+b") as fh:
                fh.truncate(len(whole) // 2)

    monkeypatch.setattr(reshard, "BEFORE_LOAD", truncate)
    results = _recover(tmp_path, n1, rows)
    assert len({r[0] for r in results}) == 1 and "failed while loading" in results[0][0], results
    assert "changed" in results[0][0] or "modified" in results[0][0], results[0][0]


def test_damage_found_by_the_verification_leaves_the_arrays_in_use_untouched(tmp_path: Path) -> None:
    n1, rows = 1 << 16, 64
    _write(tmp_path, n1, rows)
    _flip(tmp_path, "Ckpt1-Rank2.fti", 2)
    results = _recover(tmp_path, n1, rows)
    assert all(r[0] and r[2] == [True, True] for r in results), results
    assert len({r[0] for r in results}) == 1 and "hash" in results[0][0], results[0][0]
