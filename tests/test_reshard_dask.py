"""Checkpoints that change backend on a restart.

A structured dtype written by one process is recovered on Dask: the stitching planner once refused it ("different
or structured dtypes"), its table recording the dtype as a JSON object.

A Dask checkpoint restarted by one process (or MPI ranks) with declared blocks: refused with advice that fits.

A Dask worker's file holds some chunks of each array (recorded in its table's ``extra["dask"]``), never one block
per rank, so the MPI reshard cannot redistribute it. The refusal said "the checkpoint records it as none" and
advised declaring blocks "in the run that writes checkpoints" (which a Dask run cannot do) or restarting on "3
ranks"; with one worker, whose file looked like this run's layout, it said "use ctx.realloc". It now says that
a Dask cluster of any size recovers it, or the Zarr export moves it.
"""

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = pytest.mark.dask


@pytest.mark.parametrize("workers", [1, 3])  # 1: "this run's layout" (one file, on node 0), loaded as it was
def test_dask_checkpoint_refused_by_one_process_with_dask_advice(dirs, workers):
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.arange(30.0, chunks=7).reshape(5, 6).rechunk((2, 4)), name="f")
        ctx.checkpoint(1, 4)
        ctx._close()  # as a job that ends: the checkpoint stays
    ctx = ftidask.init(**dirs)
    a = np.zeros((5, 6))
    ctx.protect(1, a, global_shape=(5, 6), offset=(0, 0))
    with pytest.raises(ftidask.RecoveryError) as err:
        ctx.recover()
    message = str(err.value)
    assert "written by the Dask backend" in message and "client=" in message and "export --to-zarr" in message
    assert "records it as none" not in message and "restart on the checkpoint's layout" not in message
    assert not a.any()
    ctx._close()


def test_structured_dtype_written_by_one_process_recovered_on_dask(dirs):
    dtype = np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "?")])
    rec = np.zeros((6, 5), dtype)
    rec["a"], rec["b"], rec["c"] = np.arange(30).reshape(6, 5), np.arange(60).reshape(6, 5, 2) / 7, True
    ctx = ftidask.init(**dirs)
    ctx.protect(1, rec)
    ctx.checkpoint(1, 1)
    ctx._close()  # as a job that ends: the checkpoint stays
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        back = ctx.recover(chunks={1: (4, 3)})[1]
        got = back.compute()
        assert back.dtype == dtype and got.tobytes() == rec.tobytes()
        ctx._close()
