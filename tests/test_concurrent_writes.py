"""Checkpoints taken while another thread writes the protected arrays (issue 12, item 7).

FTI's semantics allow the data of such a checkpoint to be torn (some pieces from before a
write, some from after), but every committed checkpoint must verify and be recoverable: the
bytes hashed are the bytes written. And a checkpoint that fails never costs the previous one.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine.recovery import check_file
from ftidask.model.errors import CheckpointError
from ftidask.tools.cli import main as cli_main

ITERATIONS = 6


class Mutator:
    """A thread that keeps incrementing every element of ``arrays`` (NumPy releases the GIL)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays, self.rounds = arrays, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for a in self.arrays:
                a += 1
            self.rounds += 1

    def __enter__(self) -> Mutator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _committed_files(ctx) -> list[Path]:
    return [ctx._rank_file(r) for r in ctx.state.records()]


def _check_every_commit(ctx, dirs, level: int, arrays: list[np.ndarray], **kw) -> None:
    """Checkpoint ``ITERATIONS`` times under mutation; each commit must verify and recover."""
    with Mutator(arrays) as mut:
        for i in range(1, ITERATIONS + 1):
            ctx.checkpoint(i, level, **kw)
            for path in _committed_files(ctx):
                verdict = check_file(path, None, 0)
                assert verdict.kind == "ok", f"checkpoint {i}: {verdict.message}"
        rounds = mut.rounds
    assert rounds > 0  # the arrays really changed while checkpoints ran
    assert cli_main(["verify", dirs["ckpt_dir"]]) == 0
    # The newest one recovers; every element holds a value it had at some point (the data may be
    # torn between pieces, never garbage).
    ceiling = [a.copy() for a in arrays]
    for a in arrays:
        a[...] = -1
    ctx.recover()
    for a, top in zip(arrays, ceiling, strict=True):
        assert (a >= 0).all() and (a <= top).all()


def test_full_checkpoints_under_concurrent_writes_verify(dirs):
    ctx = ftidask.init(**dirs)
    arrays = [np.zeros(1 << 20), np.zeros((512, 1024), order="F")]  # 8 MiB and 4 MiB (Fortran order)
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a)
    _check_every_commit(ctx, dirs, 1, arrays)


def test_incremental_checkpoints_under_concurrent_writes_verify(dirs):
    ctx = ftidask.init(**dirs)
    arrays = [np.zeros(1 << 20), np.zeros(1 << 19)]
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a)
    with Mutator(arrays):
        for i in range(1, ITERATIONS + 1):
            with ctx.incremental(i, 1) as icp:
                icp.add(1)
                icp.add(2)
            for path in _committed_files(ctx):
                verdict = check_file(path, None, 0)
                assert verdict.kind == "ok", f"checkpoint {i}: {verdict.message}"
    assert cli_main(["verify", dirs["ckpt_dir"]]) == 0


@pytest.mark.parametrize("tracking", [0, 1])
def test_differential_checkpoints_under_concurrent_writes_verify(dirs, tracking):
    ctx = ftidask.init(**dirs, enable_dcp=1, dcp_block_size=16384, dcp_page_tracking=tracking)
    arrays = [np.zeros(1 << 20), np.zeros(3 << 17)]
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a)
    _check_every_commit(ctx, dirs, 1, arrays, dcp=True)


def test_compressed_checkpoints_under_concurrent_writes_verify(dirs):
    ctx = ftidask.init(**dirs, compressor="lz4")
    # Random bytes do not compress: their containers are stored as is (the raw fallback).
    noise = np.random.default_rng(0).integers(0, 100, 4 << 20, dtype=np.uint8)
    smooth = np.zeros(1 << 20)
    ctx.protect(1, noise)
    ctx.protect(2, smooth)
    with Mutator([noise, smooth]):
        for i in range(1, ITERATIONS + 1):
            ctx.checkpoint(i, 1)
            for path in _committed_files(ctx):
                verdict = check_file(path, None, 0)
                assert verdict.kind == "ok", f"checkpoint {i}: {verdict.message}"
    assert cli_main(["verify", dirs["ckpt_dir"]]) == 0
    ctx.recover()


def test_previous_checkpoint_kept_until_the_new_one_is_committed(dirs, monkeypatch):
    """Retirement runs only after the new checkpoint's commit record, with its files verifying;
    a checkpoint that fails midway leaves the previous one committed and recoverable."""
    from ftidask.engine.retention import Retention
    from ftidask.ftiff import writer

    ctx = ftidask.init(**dirs)
    a = np.arange(1 << 20, dtype=np.float64)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    first = _committed_files(ctx)

    seen = []
    retire = Retention.retire_older

    def checked_retire(self, record):
        # At retirement time the new checkpoint is committed and every one of its files verifies.
        assert record.seq in [r.seq for r in self.state.records()]
        verdict = check_file(ctx._rank_file(record), record, 0)
        seen.append((record.ckpt_id, verdict.kind))
        return retire(self, record)

    monkeypatch.setattr(Retention, "retire_older", checked_retire)
    a += 1
    ctx.checkpoint(2, 1)
    assert seen == [(2, "ok")]
    assert not any(p.exists() for p in first)  # and then the older one was retired

    # A write that fails halfway through the data: the checkpoint fails, checkpoint 2 stays.
    real = writer._write_all

    def failing(fh, data):
        fh.write(data[:len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_write_all", failing)
    expected = a.copy()
    a += 1
    with pytest.raises(CheckpointError, match="previous checkpoint is kept"):
        ctx.checkpoint(3, 1)
    monkeypatch.setattr(writer, "_write_all", real)
    assert seen == [(2, "ok")]
    assert [r.ckpt_id for r in ctx.state.records()] == [2]
    a[...] = 0
    ctx.recover()
    assert a.tobytes() == expected.tobytes()


def test_zarr_l4_checkpoints_under_concurrent_writes_verify(dirs):
    """Level 4 as Zarr hashes the files it wrote (not the arrays): it verifies as well."""
    pytest.importorskip("zarr")
    ctx = ftidask.init(**dirs, l4_format="zarr")
    arrays = [np.zeros(1 << 20)]
    ctx.protect(1, arrays[0])
    with Mutator(arrays):
        for i in range(1, 4):
            ctx.checkpoint(i, 4)
            for path in _committed_files(ctx):
                assert check_file(path, ctx.state.records()[-1], 0).kind == "ok", f"checkpoint {i}"
    ceiling = arrays[0].copy()
    arrays[0][...] = -1
    ctx.recover()
    assert (arrays[0] >= 0).all() and (arrays[0] <= ceiling).all()
