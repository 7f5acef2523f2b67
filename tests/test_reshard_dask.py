"""Checkpoints that change backend on a restart.

A structured dtype written by one process is recovered on Dask: the stitching planner once refused it ("different
or structured dtypes"), its table recording the dtype as a JSON object.

A Dask checkpoint restarted by one process (or MPI ranks: tests/test_mpi_reshard.py): a Dask worker's file holds
some chunks of each array (recorded in its table's ``extra["dask"]``), in the worker's order, never one block per
rank. It was refused (and, with one worker, offered to ``ctx.realloc``, which would have given the chunks' bytes in
the worker's order); it is now redistributed (:mod:`ftidask.engine.reshard_dask`): one process protects each array
whole, MPI ranks declare their blocks.
"""

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = pytest.mark.dask


def _arrays() -> dict[int, np.ndarray]:
    """Variables of a Dask checkpoint: irregular 2-D chunks, a 3-D int array, a structured dtype, a 0-size one."""
    rec = np.zeros((7, 3), np.dtype([("a", "<i4"), ("b", "<f8", (2,))]))
    rec["a"], rec["b"] = np.arange(21).reshape(7, 3), np.arange(42).reshape(7, 3, 2) / 3
    return {1: np.arange(30.0).reshape(5, 6) ** 1.5, 2: np.arange(120, dtype=np.int32).reshape(4, 5, 6) - 60,
            3: rec, 4: np.zeros((0, 3), np.float32)}


CHUNKS = {1: (2, 4), 2: (3, 2, 5), 3: (2, 3), 4: (1, 2)}


def _write_dask(dirs, workers: int, level: int, ckpts: int = 1) -> None:
    """``ckpts`` checkpoints (ids 1, 2...: the last at ``level``, the earlier ones at L4), each array + (id - 1)."""
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        for ckpt in range(1, ckpts + 1):
            for vid, a in _arrays().items():
                ctx.protect(vid, da.from_array(a + (ckpt - 1) if vid != 3 else a, chunks=CHUNKS[vid]), name=f"v{vid}")
            ctx.checkpoint(ckpt, level if ckpt == ckpts else 4)
        ctx._close()  # as a job that ends: the checkpoints stay


@pytest.mark.parametrize(("workers", "level"), [(1, 1), (3, 1), (3, 4)])
def test_dask_checkpoint_recovered_whole_by_one_process(dirs, workers, level):
    """A Dask checkpoint restarted by one process that protects each array whole (no declaration, a block that is
    the whole array, or replicated): every array exactly as the Dask arrays were. Before, a worker's file (its
    chunks one after the other, in the worker's order) was refused, or with one worker offered to ctx.realloc."""
    _write_dask(dirs, workers, level)
    for how in ({}, {"replicated": True}, "block"):
        ctx = ftidask.init(**dirs)
        out = {vid: np.zeros_like(a) for vid, a in _arrays().items()}
        for vid, a in out.items():
            decl = {"global_shape": a.shape, "offset": (0,) * a.ndim} if how == "block" else how
            ctx.protect(vid, a, **decl)
        ctx.recover()
        assert ctx.recovered_from == (1, level)
        for vid, a in _arrays().items():
            assert out[vid].tobytes() == a.tobytes(), (how, vid)
        ctx._close()


def test_dask_checkpoint_refused_by_one_process_whose_arrays_do_not_fit(dirs):
    """A protected array of another shape than the Dask array, or a block of another global shape: a RecoveryError
    that says what to protect, and the arrays untouched."""
    _write_dask(dirs, 2, 1)
    for shape, decl in (((6, 5), {}), ((30,), {}), ((2, 6), {"global_shape": (6, 6), "offset": (0, 0)})):
        ctx = ftidask.init(**dirs)
        a = np.full(shape, 7.0)
        ctx.protect(1, a, **decl)
        with pytest.raises(ftidask.RecoveryError) as err:
            ctx.recover()
        message = str(err.value)
        assert "written by the Dask backend" in message and "client=" in message, message
        assert (a == 7.0).all()
        ctx._close()


@pytest.mark.parametrize("level", [2, 3])
def test_dask_checkpoint_with_a_lost_worker_file_recovered_by_one_process(dirs, level):
    """An L2/L3 Dask checkpoint (4 workers) whose worker 1 file is lost: rebuilt from its group, then stitched."""
    from pathlib import Path

    _write_dask(dirs, 4, level)
    (lost,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank1.fti")
    lost.unlink()
    ctx = ftidask.init(**dirs)
    out = {vid: np.zeros_like(a) for vid, a in _arrays().items()}
    for vid, a in out.items():
        ctx.protect(vid, a)
    ctx.recover()
    for vid, a in _arrays().items():
        assert out[vid].tobytes() == a.tobytes(), vid
    assert lost.exists()
    ctx._close()


def test_damaged_dask_chunk_falls_back_to_the_previous_checkpoint(dirs):
    """Checkpoint 2's (L1) file of worker 0 damaged in a chunk: one process recovers checkpoint 1 (L4) whole, never a
    mix of the two."""
    from pathlib import Path

    from ftidask.ftiff.reader import parse_ftiff

    _write_dask(dirs, 2, 1, ckpts=2)
    (path,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")
    with open(path, "rb") as fh:
        meta = next(m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == 1 and m.chunksize)
    raw = bytearray(path.read_bytes())
    raw[meta.fptr] ^= 0xFF
    path.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    out = {vid: np.zeros_like(a) for vid, a in _arrays().items()}
    for vid, a in out.items():
        ctx.protect(vid, a)
    ctx.recover()
    assert ctx.recovered_from == (1, 4)
    for vid, a in _arrays().items():
        assert out[vid].tobytes() == a.tobytes(), vid
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


def test_python_states_of_a_dask_checkpoint_recovered_by_one_process(dirs):
    """ftidask.State, Value and a NumPy Generator protected on Dask come back in one process beside the arrays;
    a state protected where the checkpoint holds an array is refused, nothing touched."""
    rng = np.random.default_rng(7)
    rng.random(3)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.from_array(np.arange(12.0).reshape(3, 4), chunks=(2, 3)))
        ctx.protect(2, ftidask.State(step=5, name="x", hist=[1.5, 2]))
        ctx.protect(3, ftidask.Value([1, {"a": None}]))
        ctx.protect(4, rng)
        ctx.checkpoint(1, 1)
        ctx._close()
    expected_draw = np.random.default_rng(7)
    expected_draw.random(3)
    ctx = ftidask.init(**dirs)
    a, state, value, gen = np.zeros((3, 4)), ftidask.State(), ftidask.Value(None), np.random.default_rng(0)
    for vid, obj in enumerate((a, state, value, gen), start=1):
        ctx.protect(vid, obj)
    ctx.recover()
    assert a.tobytes() == np.arange(12.0).reshape(3, 4).tobytes()
    assert dict(state) == {"step": 5, "name": "x", "hist": [1.5, 2]} and value.value == [1, {"a": None}]
    assert gen.random() == expected_draw.random()
    ctx._close()
    ctx = ftidask.init(**dirs)
    wrong, b = ftidask.State(keep=1), np.zeros((3, 4))
    ctx.protect(1, wrong)
    ctx.protect(2, b)
    with pytest.raises(ftidask.RecoveryError):
        ctx.recover()
    assert dict(wrong) == {"keep": 1} and not b.any()
    ctx._close()


def test_differential_dask_checkpoint_recovered_by_one_process(dirs):
    """Two L5 (L1 differential) checkpoints of a Dask array, the second changing one chunk: one process recovers
    the second whole (a differential file is verified whole, then each chunk taken at its place)."""
    dcp = dict(dirs, enable_dcp=1, dcp_block_size=1024)
    base = np.arange(4000.0).reshape(40, 100)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dcp)
        ctx.protect(1, da.from_array(base, chunks=(15, 30)))
        ctx.checkpoint(1, 5)
        changed = base.copy()
        changed[:15, :30] += 0.5
        ctx.protect(1, da.from_array(changed, chunks=(15, 30)))
        ctx.checkpoint(2, 5)
        ctx._close()
    ctx = ftidask.init(**dcp)
    out = np.zeros_like(base)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from[0] == 2 and out.tobytes() == changed.tobytes()
    ctx._close()


def test_big_endian_dask_array_written_in_its_byte_order(dirs):
    """A big-endian Dask array whose chunks Dask computes in the machine's byte order (a 2-D slice of a '>f8'
    array): each chunk is written in the array's recorded dtype, so recovered on Dask and by one process exactly.
    Before, the chunks' little-endian bytes were stored under '>f8': every value came back byte-swapped."""
    a = (np.arange(60).reshape(6, 10) / 7).astype(">f8")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.from_array(a, chunks=((1, 5), (3, 3, 4))))
        ctx.checkpoint(1, 1)
        ctx._close()
        ctx = ftidask.init(client=client, **dirs)
        back = ctx.recover()[1]
        assert back.dtype == a.dtype and back.compute().tobytes() == a.tobytes()
        ctx._close()
    ctx = ftidask.init(**dirs)
    out = np.zeros_like(a)
    ctx.protect(1, out)
    ctx.recover()
    assert out.tobytes() == a.tobytes()
    ctx._close()


def test_partial_recovery_names_the_dask_checkpoint_it_passes_over(dirs):
    """One process restarted a Dask checkpoint (1, L4) and wrote its own (2, L1), now damaged: recover_var and
    recover(ids=...) cannot redistribute checkpoint 1 (a partial recovery never is), and their NoCheckpointError says
    that recover() without ids does, nothing touched; recover() then takes checkpoint 1. Before, the error listed
    only checkpoint 2, as if no checkpoint could be recovered."""
    from pathlib import Path

    _write_dask(dirs, 2, 4)
    ctx = ftidask.init(**dirs)
    a = np.zeros((5, 6))
    ctx.protect(1, a)
    ctx.recover()
    a += 1
    ctx.checkpoint(2, 1)
    ctx._close()
    (path,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    out = np.full((5, 6), -7.0)
    ctx.protect(1, out)
    for call in (lambda: ctx.recover_var(1), lambda: ctx.recover(ids=[1])):
        with pytest.raises(ftidask.NoCheckpointError) as err:
            call()
        assert "checkpoint 1 (level 4) was written by the Dask backend" in str(err.value), str(err.value)
        assert "without ids" in str(err.value) and (out == -7).all()
    ctx.recover()
    assert ctx.recovered_from == (1, 4) and out.tobytes() == _arrays()[1].tobytes()
    ctx._close()


def test_a_python_state_of_a_dask_checkpoint_is_never_loaded_into_an_array(dirs):
    """A Dask checkpoint holding an ftidask.Value under id 2; one process protects a uint8 array of its stored size
    there: refused (as on the checkpoint's own layout), the array untouched. Before, the state's JSON bytes were
    copied into the array."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.from_array(np.arange(12.0), chunks=5))
        ctx.protect(2, ftidask.Value([1, 2]))
        ctx.checkpoint(1, 1)
        ctx._close()
    ctx = ftidask.init(**dirs)
    a, b = np.zeros(12), np.zeros(len(b"[1,2]"), np.uint8)
    ctx.protect(1, a)
    ctx.protect(2, b)
    with pytest.raises(ftidask.RecoveryError, match="holds a Python state"):
        ctx.recover()
    assert not a.any() and not b.any()
    ctx._close()


def test_zero_d_arrays_written_by_one_process_recovered_on_dask(dirs):
    """0-d arrays (a piece of shape ()): the stitching's reader took ``out[()]``, a scalar copy, and failed assigning
    into it (TypeError) since the reader reads runs of the stream in place."""
    dtype = np.dtype([("a", "<i2"), ("b", ">f8")])
    arrays = {1: np.array(2.75), 2: np.array((7, -1.5), dtype)}
    ctx = ftidask.init(**dirs)
    for vid, a in arrays.items():
        ctx.protect(vid, a)
    ctx.checkpoint(1, 1)
    ctx._close()  # as a job that ends: the checkpoint stays
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        back = ctx.recover()
        for vid, a in arrays.items():
            got = np.asarray(back[vid].compute())
            assert got.dtype == a.dtype and got.shape == () and got.tobytes() == a.tobytes(), (vid, got)
        ctx._close()
