"""A Dask run among others on one cluster, and its malformed or unplaceable inputs: each run's tasks are its own,
a block of another shape than its array declares is refused, a recovery that cannot build a chunked array changes
no variable, an empty cluster is refused at once. Each case was found by a review."""

from __future__ import annotations

import threading

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 2


@pytest.fixture
def client(dask_client):
    return dask_client


def _dirs(base, **kw):
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"), **kw}


def _hold(name: str, timeout: float) -> None:  # a task that keeps its worker's one thread busy
    distributed.Event(name).wait(timeout)


def test_two_runs_checkpointing_at_once_keep_their_own_files(client, tmp_path):
    """The write tasks' keys held only the checkpoint id and sequence number, which every run numbers from 1: a
    second run's checkpoint submitted while the first's was queued got the first's results, committed without a
    file of its own and retired its previous checkpoint (its restart found nothing)."""
    runs = {}
    for name, sign in (("a", 1.0), ("b", -1.0)):
        ctx = ftidask.init(client=client, **_dirs(tmp_path / name, exec_id=f"run-{name}"))
        x = client.persist(da.from_array(sign * np.arange(40.0), chunks=10))
        ctx.protect(1, x)
        ctx.checkpoint(1, 1)
        runs[name] = (ctx, sign)
    event = distributed.Event("ftidask-test-hold", client=client)
    holds = [client.submit(_hold, "ftidask-test-hold", 60, pure=False, workers=[w])
             for w in sorted(client.scheduler_info()["workers"])]
    pending = [ctx.checkpoint(2, 1, wait=False) for ctx, _sign in runs.values()]  # both queued behind the holds
    threading.Timer(0.5, event.set).start()
    for handle in pending:
        handle.result()
    distributed.wait(holds)
    for name, (ctx, sign) in runs.items():
        ctx._close()  # both programs die
        again = ftidask.init(client=client, **_dirs(tmp_path / name, exec_id=f"run-{name}"))
        again.protect(1, da.zeros(40, chunks=10))
        got = again.recover()[1].compute()
        assert got.tobytes() == (sign * np.arange(40.0)).tobytes(), name
        again.finalize()


@pytest.mark.parametrize("factor", [2, 0.75])
def test_a_block_of_another_shape_than_declared_is_refused(client, tmp_path, factor):
    """A map_blocks returning blocks larger than its chunks= declares was checkpointed cut to the declared bytes
    (the recovery gave back an array of the declared shape, silently); a smaller one failed with a message about
    bytes and chunks at offsets."""
    rows = int(4 * factor)
    x = da.ones((8, 5), chunks=(4, 5)).map_blocks(lambda b: np.ones((rows, 5)), chunks=(4, 5), dtype=float)
    ctx = ftidask.init(client=client, **_dirs(tmp_path))
    ctx.protect(1, x)
    with pytest.raises(ftidask.CheckpointError, match=rf"has shape \({rows}, 5\), its Dask array declares \(4, 5\)"):
        ctx.checkpoint(1, 1)
    ctx.finalize()


def test_a_recovery_that_cannot_build_a_chunked_array_changes_no_variable(client, tmp_path, monkeypatch):
    """A checkpoint of CuPy chunks recovered where CuPy is missing raised a raw ModuleNotFoundError after the NumPy
    variable was filled; nan chunk sizes passed the check and a raw ValueError came after the same fill."""
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: a device checkpoint recovers here")
    except ImportError:
        pass
    from ftidask.backends.dask import writing

    ctx = ftidask.init(client=client, **_dirs(tmp_path))
    ctx.protect(1, np.arange(6.0))
    ctx.protect(2, da.from_array(np.arange(20.0), chunks=5))
    ctx.protect(3, da.from_array(np.arange(12.0).reshape(3, 4), chunks=2))
    with monkeypatch.context() as patch:  # the client plans variable 2's chunks as CuPy's (a GPU run's record)
        patch.setattr(writing, "is_device_array", lambda meta: isinstance(meta, np.ndarray) and meta.ndim == 1)
        ctx.checkpoint(1, 1)
    ctx._close()
    again = ftidask.init(client=client, **_dirs(tmp_path))
    a = np.zeros(6)
    again.protect(1, a)
    third = da.zeros((3, 4), chunks=3)
    again.protect(3, third)
    with pytest.raises(ftidask.RecoveryError, match="cupy"):
        again.recover()
    with pytest.raises(ftidask.RecoveryError, match="nan"):
        again.recover(chunks={3: ((float("nan"),), (4,))})
    assert (a == 0).all() and again.protected[3] is third
    again.finalize()


def test_a_checkpoint_on_a_cluster_without_workers_is_refused(tmp_path):
    """It waited for ever for a worker to compute the chunks (a recovery refused at once)."""
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=50) as cluster, \
            distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **_dirs(tmp_path))
        ctx.protect(1, da.arange(10, chunks=5))
        with pytest.raises(ftidask.CheckpointError, match="no workers"):
            ctx.checkpoint(1, 1)
        ctx.finalize()


def test_a_structured_dtype_with_titles_is_checkpointed(client, tmp_path):
    """A field's title is not recorded in the variable table: the chunks' dtype (with titles) was refused as another
    dtype than the array's ("a chunk holds ..., its Dask array is ..."), which it is not. The bytes come back."""
    dtype = np.dtype([(("T", "a"), "<i4"), ("b", "<f4")])
    raw = np.frombuffer(np.random.default_rng(0).integers(0, 256, 10 * dtype.itemsize, np.uint8).tobytes(), dtype)
    ctx = ftidask.init(client=client, **_dirs(tmp_path))
    ctx.protect(1, da.from_array(raw.copy(), chunks=4))
    ctx.checkpoint(1, 1)
    ctx._close()
    again = ftidask.init(client=client, **_dirs(tmp_path))
    got = again.recover()[1].compute()
    assert got.tobytes() == raw.tobytes() and got.dtype.names == ("a", "b")
    again.finalize()


@pytest.mark.parametrize("level", [1, 5])
def test_a_0d_numpy_variable_on_dask(client, tmp_path, level):
    """A 0-d NumPy variable was scattered as a 1-d array of one element: refused as a block of another shape."""
    ctx = ftidask.init(client=client, **_dirs(tmp_path, enable_dcp=int(level > 4)))
    ctx.protect(1, da.arange(6.0, chunks=3))
    ctx.protect(2, np.array(5.0))
    ctx.checkpoint(1, level)
    ctx._close()
    again = ftidask.init(client=client, **_dirs(tmp_path, enable_dcp=int(level > 4)))
    value = np.array(0.0)
    again.protect(2, value)
    again.recover()
    assert value == 5.0
    again.finalize()


def test_an_async_checkpoint_on_a_cluster_of_threads_holds_the_numpy_values_of_the_call(tmp_path):
    """A cluster of threads in this process (``processes=False``) keeps the scattered object itself, not its
    bytes: a NumPy array checkpointed with ``wait=False`` and written at once after the call was saved with the
    new values (found by the GPU review, through a CuPy array's host copy)."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        with ftidask.init(client=client, **_dirs(tmp_path)) as ctx:
            a = np.ones(1 << 16)
            ctx.protect(1, a)
            event = distributed.Event("ftidask-test-hold-threads", client=client)
            holds = [client.submit(_hold, "ftidask-test-hold-threads", 60, pure=False, workers=[w])
                     for w in sorted(client.scheduler_info()["workers"])]
            handle = ctx.checkpoint(2, 1, wait=False)  # queued behind the holds: the write comes after the change
            a[...] = 2
            event.set()
            assert handle.result().id == 2
            distributed.wait(holds)
            a[...] = 0
            ctx.recover()
            assert (a == 1).all()


def test_a_chunked_xarray_object_is_refused_with_what_to_protect(client, tmp_path):
    """Every xarray object has the attributes of a Dask collection (a chunked one has chunks and a dtype): it was
    taken for a Dask array. It is refused, naming what to protect instead (its .data, a Dask array)."""
    xr = pytest.importorskip("xarray")
    with ftidask.init(client=client, **_dirs(tmp_path)) as ctx:
        labelled = xr.DataArray(da.zeros(40, chunks=10), dims=["x"])
        for wrong in (labelled, xr.DataArray(np.zeros(4))):  # chunked, or NumPy-backed: refused, naming .data
            with pytest.raises(ftidask.ProtectError, match=r"DataArray; protect the array it holds, its \.data"):
                ctx.protect(1, wrong)
        ctx.protect(1, labelled.data)
        ctx.checkpoint(1, 1)
