"""keep_last_ckpt at finalize when the newest checkpoint's files are lost: it kept an older level-4 checkpoint in the
newest's place, silently (finalize returned, the next run restarted from the older one), though at L2 the lost file
could be rebuilt from its partner copy, as a restart does. The lost L2/L3 files are rebuilt before the flush now;
a newest checkpoint that cannot be kept (lost beyond its level's redundancy) is passed over for the newest that a
restart would recover, as before, and a warning says so. Found by a review.

The ranks are threads over the real engine (``run_ranks``), as in tests/test_reshard_forged_blocks.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.storage.files import find_paths


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, keep_last_ckpt=1, verbosity=4)


def test_a_lost_l2_file_is_rebuilt_before_the_flush(tmp_path):
    def write(t):
        ctx = Context(_config(tmp_path), t)
        u = np.zeros(100)
        ctx.protect(1, u)
        u[:] = 1
        ctx.checkpoint(1, 4)
        u[:] = 2 + t.rank
        ctx.checkpoint(2, 2)
        t.barrier()
        if t.rank == 1:  # rank 1's own file lost; its partner copy on node 2 stays
            (own,) = find_paths(tmp_path / "Local" / "node1", "Ckpt2-Rank1.fti")
            own.unlink()
        t.barrier()
        ctx.finalize()

    assert run_ranks(_config(tmp_path), 4, write, wait=60)[1] == []

    def read(t):
        ctx = Context(_config(tmp_path), t)
        u = np.zeros(100)
        ctx.protect(1, u)
        status = ctx.status()
        ctx.recover()
        ctx.finalize()
        return status, ctx.recovered_from, u[0]

    results, errors = run_ranks(_config(tmp_path), 4, read, wait=60)
    assert errors == [] and results == [(2, (2, 4), 2.0 + r) for r in range(4)], results


@pytest.mark.parametrize("lost", ["missing", "damaged"])
def test_a_newest_checkpoint_that_cannot_be_kept_is_said(tmp_path, caplog, lost):
    """The newest checkpoint's only file lost: the one kept is the newest a restart recovers (checkpoint 1), as
    before, but a warning says so now (it was silent), and no partial L4 copy of the newest is left."""
    ctx = ftidask.init(_config(tmp_path))
    u = np.zeros(10)
    ctx.protect(1, u)
    u[:] = 1
    ctx.checkpoint(1, 4)
    u[:] = 2
    ctx.checkpoint(2, 1)
    (own,) = find_paths(tmp_path / "Local", "Ckpt2-Rank0.fti")
    if lost == "missing":
        own.unlink()
    else:
        raw = bytearray(own.read_bytes())
        raw[100] ^= 1
        own.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        ctx.finalize()
    assert "the newest checkpoint cannot be kept" in caplog.text and "kept checkpoint 1 (level 4)" in caplog.text
    assert not find_paths(tmp_path / "Global", "ckpt2.s*")  # no partial copy left
    again = ftidask.init(_config(tmp_path))
    again.protect(1, u)
    assert again.status() == 2
    again.recover()
    assert again.recovered_from == (1, 4) and (u == 1).all()
    again.finalize()


@pytest.mark.parametrize("backend", ["process", "dask"])
def test_a_full_global_directory_keeps_the_newest_checkpoint(tmp_path, request, backend):
    """keep_last_ckpt's flush of the newest checkpoint failing on a full global disk (ENOSPC) passed over it as a
    damaged one: finalize kept the older L4 checkpoint, removed the newest and said nothing but a warning (a restart
    went back to checkpoint 1). A full disk is the flush's failure: finalize raises, the run keeps its checkpoints."""
    from diskfull import fill, tmpfs

    def array(values: np.ndarray):
        if backend == "process":
            return values
        import dask.array as da
        return da.from_array(values, chunks=10_000)

    with tmpfs(tmp_path / "fs", "4m") as fs:
        kw = dict(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(fs / "Global"), meta_dir=str(tmp_path / "Meta"),
                  keep_last_ckpt=1, verbosity=4)
        if backend == "dask":
            kw["client"] = request.getfixturevalue("dask_client")
        ctx = ftidask.init(**kw)
        ctx.protect(1, array(np.arange(40_000.0)))
        ctx.checkpoint(1, 4)
        ctx.protect(1, array(np.arange(40_000.0) + 1))
        ctx.checkpoint(2, 1)
        filler = fill(fs)
        with pytest.raises(ftidask.CheckpointError, match="No space left on device"):
            ctx.finalize()
        filler.unlink()
        again = ftidask.init(**kw)
        out = np.zeros(40_000)
        again.protect(1, array(out))
        assert again.status() == 1
        got = again.recover()[1]
        assert again.recovered_from == (2, 1)
        assert (np.asarray(got) if backend == "process" else got.compute()).tobytes() == \
            (np.arange(40_000.0) + 1).tobytes()
        again.finalize()


def test_a_full_local_disk_under_the_rebuild_keeps_the_newest_checkpoint(tmp_path):
    """The newest L2 checkpoint's lost file could not be rebuilt because the node's disk was full: the loss was then
    counted as damage, finalize passed over the checkpoint and kept the older L4 one (a restart went back). Raised
    now, on every rank; once there is room, the restart recovers the newest."""
    from diskfull import fill, tmpfs

    with tmpfs(tmp_path / "fs", "2m") as fs:
        cfg = load_config(None, ckpt_dir=str(fs / "Local"), glbl_dir=str(tmp_path / "Global"),
                          meta_dir=str(tmp_path / "Meta"), local_test=1, node_size=1, group_size=2, keep_last_ckpt=1,
                          verbosity=4)
        filler = []

        def write(t):
            ctx = Context(cfg, t)
            u = np.zeros(1000)
            ctx.protect(1, u)
            u[:] = 1
            ctx.checkpoint(1, 4)
            u[:] = 2 + t.rank
            ctx.checkpoint(2, 2)
            t.barrier()
            if t.rank == 1:  # rank 1's own file lost, its partner copy kept; then the node's disk fills
                (own,) = find_paths(fs / "Local" / "node1", "Ckpt2-Rank1.fti")
                own.unlink()
                filler.append(fill(fs))
            t.barrier()
            with pytest.raises(ftidask.CheckpointError, match="No space left on device"):
                ctx.finalize()

        assert run_ranks(cfg, 4, write, wait=60)[1] == []
        filler[0].unlink()

        def read(t):
            ctx = Context(cfg, t)
            u = np.zeros(1000)
            ctx.protect(1, u)
            status = ctx.status()
            ctx.recover()
            ctx.finalize()
            return status, ctx.recovered_from, u[0]

        results, errors = run_ranks(cfg, 4, read, wait=60)
        assert errors == [] and [r[1:] for r in results] == [((2, 2), 2.0 + r) for r in range(4)], results
