"""Dask arrays with empty blocks (what ``x[x > t].compute_chunk_sizes()`` gives, as ftidask's own ProtectError
advises for unknown chunk sizes): an empty block starts where the next block of its worker does. Before, the
blocks were told apart by that start alone: an empty block and the next one on the same worker were confused and
every checkpoint failed ("block (1,) ... has shape (0,), its Dask array declares (49,)"), or the next block's
bytes were lost behind the empty one."""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask.backends.dask.tasks import chunk_sources  # noqa: E402
from ftidask.model.arrays import VarInfo  # noqa: E402

pytestmark = pytest.mark.dask


def test_an_empty_block_and_the_next_one_at_the_same_place_are_told_apart():
    blocks = [[[0], [0], 0], [[1], [3], 0], [[2], [0], 24], [[3], [2], 24]]  # (index, shape, dptr) as planned
    info = VarInfo(1, "x", np.dtype("<f8"), (5,), "C", 40, {"dask": {"blocks": blocks}})
    chunks = [np.empty(0), np.arange(3.0), np.empty(0), np.arange(3.0, 5.0)]
    source = chunk_sources([[1, 0], [1, 0], [1, 24], [1, 24]], chunks, [info])[1]
    assert bytes(source.view(0, 24)) == np.arange(3.0).tobytes()
    assert bytes(source.view(24, 40)) == np.arange(3.0, 5.0).tobytes()
    with pytest.raises(ftidask.FTIError, match=r"block \(1,\) of variable 1 has shape \(2,\)"):
        chunk_sources([[1, 0], [1, 0]], [np.empty(0), np.arange(2.0)], [info])


@pytest.mark.parametrize("level", [1, 3])
def test_a_dask_array_with_empty_blocks_on_one_worker_round_trips(dask_client, dirs, level):
    base = da.arange(400, chunks=100, dtype=np.float64)
    x = base[base > 150]
    x.compute_chunk_sizes()
    assert 0 in x.chunks[0]
    worker = sorted(dask_client.scheduler_info()["workers"])[0]
    x = dask_client.persist(x, workers=[worker])  # every block on one worker: the empty one beside the next
    distributed.wait(x)
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, x)
    ctx.checkpoint(1, level)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    out = ctx.recover()[1]
    assert out.compute().tobytes() == np.arange(151, 400, dtype=np.float64).tobytes()
    ctx.finalize()
