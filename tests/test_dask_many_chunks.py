"""Dask arrays of many chunks: more than 64 along an axis come back (the record's check took a chunk list for a
shape, whose length NumPy bounds at 64), and a recovery parses each rank file once per worker, not once per chunk
(a file of n chunks cost n parses of its n-entry table: quadratic)."""

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(180)]


@pytest.fixture
def client(dask_client):
    return dask_client


def test_more_than_64_chunks_along_an_axis_recover(client, dirs):
    x = da.arange(200 * 3, chunks=3).astype(np.float64)  # 200 chunks along its one axis
    y = da.random.default_rng(1).random((130, 6), chunks=(2, 3))  # 65 x 2 chunks
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, x)
    ctx.protect(2, y)
    ctx.checkpoint(1, 1)
    saved = {vid: a.compute() for vid, a in ctx.protected.items()}
    ctx._close()  # as a job that died: the checkpoint stays
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
    ctx.protect(2, da.zeros(y.shape, chunks=y.chunks))
    out = ctx.recover()
    assert out[1].chunks == x.chunks and out[2].chunks == y.chunks  # 200 and 65 x 2 chunks
    for vid, ref in saved.items():
        assert out[vid].compute().tobytes() == ref.tobytes()
    ctx.finalize()
