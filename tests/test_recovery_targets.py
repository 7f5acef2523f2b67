"""A recovery that cannot fill every protected array touches none of them (issue 12, item 8).

Every target is checked (writeable, dtype, shape, size) before the first byte is copied, and
the user gets a clear RecoveryError, never a raw BufferError/ValueError after another variable
was already overwritten.
"""

from __future__ import annotations

import numpy as np
import pytest

import ftidask


def _protect_two(ctx):
    first = np.arange(1 << 16, dtype=np.float64)
    second = np.arange(1000, dtype=np.int32)
    ctx.protect(1, first)
    ctx.protect(2, second)
    return first, second


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("level, extra", [(1, {}), (5, {"enable_dcp": 1}), (4, {"l4_format": "zarr"}),
                                          (1, {"compressor": "zstd"})])
def test_read_only_target_refused_before_any_byte_is_copied(dirs, level, extra):
    if extra.get("l4_format") == "zarr":
        pytest.importorskip("zarr")
    ctx = ftidask.init(**dirs, **extra)
    first, second = _protect_two(ctx)
    ctx.checkpoint(1, level)
    first += 1  # differs from the checkpoint: a recovery that touched it would show
    second += 1
    before = first.copy()
    _read_only(second)
    with pytest.raises(ftidask.RecoveryError, match="variable 2.*read-only"):
        ctx.recover()
    assert first.tobytes() == before.tobytes()
    # The same for a single file.
    path = ctx._rank_file(ctx.state.records()[-1])
    if path.suffix == ".fti":
        with pytest.raises(ftidask.RecoveryError, match="variable 2.*read-only"):
            ctx.recover_file(path)
        assert first.tobytes() == before.tobytes()
    # Once writeable again, recovery fills both.
    second.flags.writeable = True
    ctx.recover()
    assert first.tobytes() == (before - 1).tobytes() and (second == np.arange(1000)).all()


def test_broadcast_view_target_refused(dirs):
    """A protected view that NumPy marks read-only (a broadcast) is refused the same way."""
    ctx = ftidask.init(**dirs)
    first = np.arange(4096, dtype=np.float64)
    ctx.protect(1, first)
    ctx.protect(2, np.zeros((4, 8)))
    ctx.checkpoint(1, 1)
    first += 1
    before = first.copy()
    ctx.protect(2, np.broadcast_to(np.zeros(8), (4, 8)))
    with pytest.raises(ftidask.RecoveryError, match="variable 2.*read-only"):
        ctx.recover()
    assert first.tobytes() == before.tobytes()


@pytest.mark.dask
def test_dask_recover_read_only_numpy_target_touches_nothing(dirs):
    da = pytest.importorskip("dask.array")
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        grid = da.arange(64, chunks=16, dtype=np.float64)
        first = np.arange(100, dtype=np.int64)
        second = np.arange(50, dtype=np.int64)
        ctx.protect(1, grid)
        ctx.protect(2, first)
        ctx.protect(3, second)
        ctx.checkpoint(1, 1)
        held = ctx.protected[1]
        first += 1
        before = first.copy()
        _read_only(second)
        with pytest.raises(ftidask.RecoveryError, match="variable 3.*read-only"):
            ctx.recover()
        assert first.tobytes() == before.tobytes()
        assert ctx.protected[1] is held  # no Dask variable was rebound either
        second.flags.writeable = True
        out = ctx.recover()
        assert (first == np.arange(100)).all() and (second == np.arange(50)).all()
        assert (out[1].compute() == np.arange(64)).all()
