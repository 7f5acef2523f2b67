"""Issue 18, items 1-2 over real mpiexec: checkpoints written by 4 ranks, recovered on 2, 3 and 8.

One write job (4 ranks: an L1 and an L4 checkpoint whose variables declare their blocks, 1-D and 2-D,
C and Fortran order, replicated, compressed; and an L1 checkpoint without declarations), then one
recovery job per rank count running every case in turn (tests/mpi_scripts/reshard_job.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()

DECLARED = ("l1", "l2", "l3", "l4")
LEVEL = {"l1": 1, "l2": 2, "l3": 3, "l4": 4, "l2_lost": 2, "l3_lost": 3, "dcp": 1, "l4zarr": 4}
CKPT = {"dcp": 2}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reshard")
    run(4, "reshard_job.py", "write", str(base), timeout=180)
    return base


def _corrupt_container(run_dir: Path, rank: int, vid: int) -> None:
    """Flip the first data bytes of variable ``vid`` in old rank ``rank``'s file (its structure stays valid)."""
    from ftidask.ftiff.reader import parse_ftiff

    path = next(iter(find_paths(run_dir, f"Ckpt1-Rank{rank}.fti")))
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    meta = next(m for _b, _c, m in parsed.containers() if m.id == vid and m.chunksize)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr)
        fh.write(bytes(b ^ 0xFF for b in fh.read(8)))
        

def _results(base: Path, size: int) -> list[dict]:
    return [json.loads((base / f"result-{size}-{r}.json").read_text()) for r in range(size)]


def _recover_on(written: Path, tmp_path: Path, size: int) -> tuple[Path, list[dict]]:
    base = tmp_path / "runs"
    shutil.copytree(written, base)
    # A node of the old layout lost: its L1 file cannot be read, so no rank may get partial data.
    shutil.copytree(base / "l1", base / "l1_lost")
    for path in find_paths(base / "l1_lost" / "Local" / "node1", "Ckpt*-Rank*.fti"):
        path.unlink()
    # A whole node of the old layout lost at L2 and L3: its files are rebuilt first, then redistributed.
    for name in ("l2", "l3"):
        shutil.copytree(base / name, base / f"{name}_lost")
        shutil.rmtree(base / f"{name}_lost" / "Local" / "node1")
    # Damaged data in an old file: detected by its container's hash before any array is written.
    shutil.copytree(base / "l4", base / "l4_damaged")
    _corrupt_container(base / "l4_damaged", 1, 2)
    run(size, "reshard_job.py", "recover", str(base), *DECLARED, "l2_lost", "l3_lost", "dcp", "l4zarr",
        "undeclared", "l1_lost", "l4_damaged", timeout=300)
    return base, _results(base, size)


def _check(results: list[dict], size: int, written: int = 4) -> None:
    for name in (*DECLARED, "l2_lost", "l3_lost", "dcp", "l4zarr"):
        for rank, res in enumerate(results):
            got = res[name]
            assert got.get("ok"), f"{name}, rank {rank} of {size}: {got}"
            assert all(got["equal"].values()), f"{name}, rank {rank} of {size}: blocks differ {got['equal']}"
            assert got["from"] == [CKPT.get(name, 1), LEVEL[name]]
    # Undeclared variables on another number of ranks: the same clear error everywhere, arrays untouched.
    errors = [res["undeclared"] for res in results]
    assert {e.get("error") for e in errors} == {"RecoveryError"}, errors
    assert len({e["message"] for e in errors}) == 1
    message = errors[0]["message"]
    assert f"written by {written} ranks, this run recovers on {size}" in message
    assert "global_shape" in message and "replicated=True" in message and "export" in message
    assert all(e["untouched"] for e in errors)
    assert all(f"written by {written} ranks, this run recovers on {size}" in e["stored_size"] for e in errors)
    # An old file lost (L1): no checkpoint can be redistributed, every rank says so, nothing written.
    lost = [res["l1_lost"] for res in results]
    assert {e.get("error") for e in lost} == {"NoCheckpointError"}, lost
    assert len({e["message"] for e in lost}) == 1 and "missing" in lost[0]["message"]
    assert all(e["untouched"] for e in lost)
    damaged = [res["l4_damaged"] for res in results]
    assert {e.get("error") for e in damaged} == {"NoCheckpointError"}, damaged
    assert len({e["message"] for e in damaged}) == 1 and "hash does not match" in damaged[0]["message"]
    assert all(e["untouched"] for e in damaged)


def _check_rebuilt(base: Path) -> None:
    """The lost node's files of L2/L3 are back, byte for byte."""
    for name in ("l2", "l3"):
        originals = sorted(find_paths(base / name / "Local" / "node1", "Ckpt*.fti"))  # as test_mpi_levels
        assert originals
        for path in originals:
            twin = base / f"{name}_lost" / path.relative_to(base / name)
            assert twin.read_bytes() == path.read_bytes(), twin


@pytest.mark.parametrize("size", [2, 3, 8])
def test_4_ranks_recovered_on(written: Path, tmp_path: Path, size: int) -> None:
    base, results = _recover_on(written, tmp_path, size)
    _check(results, size)
    _check_rebuilt(base)


def test_same_ranks_other_nodes(written: Path, tmp_path: Path) -> None:
    """4 ranks again, 2 per node instead of 1: undeclared variables still come back (rank r gets old
    rank r's file, read from its old node's directory), declared ones too."""
    base = tmp_path / "runs"
    shutil.copytree(written, base)
    run(4, "reshard_job.py", "recover", str(base), "undeclared:2", "l1:2", timeout=300)
    for rank, res in enumerate(_results(base, 4)):
        for name in ("undeclared:2", "l1:2"):
            assert res[name].get("ok") and all(res[name]["equal"].values()), (name, rank, res[name])


@pytest.mark.parametrize("size", [2, 3])
def test_a_run_restarted_on_fewer_nodes_leaves_no_old_file(written: Path, tmp_path: Path, size: int) -> None:
    """The old layout's nodes that no rank of the restarted run holds (node2, node3 here) are the run's too: the
    checkpoints retired after the restart and those finalize removes are removed there as well, not left behind."""
    base = tmp_path / "runs"
    shutil.copytree(written, base)
    names = ("l1", "l2", "l3", "l4", "dcp", "l4zarr")
    assert all(list(find_paths(base / name, "Ckpt*-Rank3.*")) for name in names)
    run(size, "reshard_job.py", "finish", str(base), *names, timeout=300)
    for name in names:
        left = sorted(str(p.relative_to(base)) for p in find_paths(base / name, "*")
                      if p.is_file() and "Meta" not in p.parts)
        assert left == [], (name, left)


@pytest.mark.slow
@pytest.mark.timeout(960)  # the 16-rank write job may take 600 s, the recovery job 300: not cut at pytest's 300
def test_16_ranks_recovered_on_4(tmp_path: Path) -> None:
    base = tmp_path / "written"
    base.mkdir()
    run(16, "reshard_job.py", "write", str(base), timeout=600)
    runs, results = _recover_on(base, tmp_path, 4)
    _check(results, 4, written=16)
    _check_rebuilt(runs)


def test_export_stitches_declared_blocks(written: Path) -> None:
    """`ftidask export --to-zarr` of the 4-rank checkpoint: one global array per declared variable."""
    zarr = pytest.importorskip("zarr")
    from mpi_scripts.reshard_job import globals_

    from ftidask.tools.zarr_export import export_checkpoint

    for name in ("l1", "l4"):
        dest = written / f"{name}-export.zarr"
        run_dir = written / name
        export_checkpoint(None, dest, ckpt_dir=run_dir / "Local", glbl_dir=run_dir / "Global",
                          meta_dir=run_dir / "Meta", local_test=1)
        group = zarr.open_group(str(dest), mode="r")
        for vid, glob in globals_().items():
            got = group[f"var{vid}"][...]
            assert got.shape == glob.shape and got.tobytes() == np.ascontiguousarray(glob).tobytes(), (name, vid)


@pytest.mark.parametrize("name", ["l1", "l4", "dcp"])
def test_one_process_recovers_whole_arrays_undeclared(written: Path, tmp_path: Path, name: str) -> None:
    """One process (a notebook) restarting the 4-rank checkpoint protects each global array whole, with no
    declaration: the blocks are stitched into it (it was refused: "declare no decomposition"). A wrong shape, or a
    checkpoint whose ranks declared nothing, is refused with the arrays untouched."""
    from mpi_scripts.reshard_job import dirs, globals_

    import ftidask

    shutil.copytree(written / name, tmp_path / name)
    ctx = ftidask.init(**dirs(str(tmp_path), name))
    out = {vid: np.zeros_like(glob) for vid, glob in globals_().items()}
    for vid, a in out.items():
        ctx.protect(vid, a)
    ctx.recover()
    assert ctx.recovered_from == (CKPT.get(name, 1), LEVEL[name])
    for vid, glob in globals_().items():
        assert out[vid].tobytes() == glob.tobytes(), vid
    ctx._close()
    ctx = ftidask.init(**dirs(str(tmp_path), name))
    wrong = np.zeros(7)
    ctx.protect(1, wrong)
    with pytest.raises(ftidask.RecoveryError, match="protect the whole array"):
        ctx.recover()
    assert not wrong.any()
    ctx._close()
    shutil.copytree(written / "undeclared", tmp_path / "undeclared")
    ctx = ftidask.init(**dirs(str(tmp_path), "undeclared"))
    whole = np.zeros_like(globals_()[1])
    ctx.protect(1, whole)
    with pytest.raises(ftidask.RecoveryError, match="declares no decomposition"):
        ctx.recover()
    assert not whole.any()
    ctx._close()


@pytest.mark.parametrize("name", ["l2", "l3"])
def test_export_rebuilds_a_lost_node_of_an_l2_l3_checkpoint(written: Path, tmp_path: Path, name: str) -> None:
    """A node's directory lost at L2/L3: the export rebuilds its files from the partner copies or the parity
    (verified against the commit record), as a recovery would, and writes the exact global arrays. Before,
    it refused the checkpoint and told the user to recover the run with ftidask first."""
    zarr = pytest.importorskip("zarr")
    from mpi_scripts.reshard_job import globals_

    from ftidask.tools.zarr_export import export_checkpoint

    run_dir = tmp_path / name
    shutil.copytree(written / name, run_dir)
    lost = sorted(p.name for p in find_paths(run_dir / "Local" / "node1", "Ckpt*-Rank*.fti"))
    assert lost
    shutil.rmtree(run_dir / "Local" / "node1")
    result = export_checkpoint(None, tmp_path / "x.zarr", ckpt_dir=run_dir / "Local", glbl_dir=run_dir / "Global",
                               meta_dir=run_dir / "Meta", local_test=1)
    assert (result.ckpt_id, result.level) == (1, LEVEL[name])
    group = zarr.open_group(str(tmp_path / "x.zarr"), mode="r")
    for vid, glob in globals_().items():
        assert group[f"var{vid}"][...].tobytes() == np.ascontiguousarray(glob).tobytes(), vid
    assert sorted(p.name for p in find_paths(run_dir / "Local" / "node1", "Ckpt*-Rank*.fti")) == lost


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_dask_checkpoint_redistributed_onto_mpi_ranks(tmp_path: Path, ranks: int) -> None:
    """A checkpoint of 2 Dask workers (irregular chunks, an int, a structured and an empty array) recovered by MPI
    ranks that declare their blocks (rows, a middle axis) or replicated arrays: each rank's block exactly. Before,
    it was refused (a Dask worker's file holds chunks in the worker's order)."""
    pytest.importorskip("distributed")
    from test_reshard_dask import _arrays, _write_dask

    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 3}
    _write_dask(dirs, 2, 1)
    out = tmp_path / "out"
    out.mkdir()
    run(ranks, "dask_ckpt_job.py", str(out), dirs["ckpt_dir"], dirs["glbl_dir"], dirs["meta_dir"], timeout=180)
    assert not list(out.glob("error-*")), [p.read_text() for p in out.glob("error-*")]
    want = _arrays()
    for r in range(ranks):
        where = json.loads((out / f"where-{r}.json").read_text())
        assert where["from"] == [1, 1]
        (r0, r1), (c0, c1) = where["rows"], where["cols"]
        expect = {1: want[1][r0:r1], 2: want[2][:, c0:c1], 3: want[3], 4: want[4]}
        for vid, a in expect.items():
            got = np.load(out / f"got-{r}-{vid}.npy")
            assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), (r, vid)


# --- the Dask backend stitches the same checkpoints into global arrays --------------------------------

@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") \
            as cluster, distributed.Client(cluster) as client:
        yield client


def _dask_ctx(client, run_dir: Path):
    import ftidask

    return ftidask.init(client=client, ckpt_dir=str(run_dir / "Local"), glbl_dir=str(run_dir / "Global"),
                        meta_dir=str(run_dir / "Meta"), local_test=1, verbosity=4)


@pytest.mark.dask
def test_dask_backend_stitches_an_mpi_checkpoint(written: Path, tmp_path: Path, dask_client) -> None:
    """Checkpoints of 4 MPI ranks (declared 1-D/2-D blocks, C and Fortran order, compressed, replicated) come
    back on 2 Dask workers as global arrays, bit for bit: at L1 and L4, at L2 and L3 after a node was lost
    (rebuilt first), from differential files and from an L4 Zarr store."""
    import dask.array as da
    from mpi_scripts.reshard_job import globals_

    glob = globals_()
    for name in ("l1", "l4", "l2_lost", "l3_lost", "dcp", "l4zarr"):
        run_dir = tmp_path / name
        shutil.copytree(written / name.replace("_lost", ""), run_dir)
        if name.endswith("_lost"):
            shutil.rmtree(run_dir / "Local" / "node1")
        ctx = _dask_ctx(dask_client, run_dir)
        into = np.zeros(glob[2].shape, glob[2].dtype)  # a NumPy variable of the global shape: filled in place
        ctx.protect(2, into)
        ctx.protect(1, da.zeros(glob[1].shape, chunks=50))  # a Dask variable: its chunks are kept
        out = ctx.recover(chunks={3: (3, 4)})
        assert sorted(out) == sorted(glob), name
        for vid, g in glob.items():
            got = np.asarray(out[vid])
            assert got.shape == g.shape and got.tobytes() == np.ascontiguousarray(g).tobytes(), (name, vid)
        assert out[2] is into
        assert out[1].chunks == ((50, 50, 3),) and ctx.protected[1] is out[1]
        assert out[3].chunks == ((3, 3, 3), (4, 4, 3))
        assert out[5].chunks == ((50, 52, 52, 52),)  # the old ranks' blocks
        assert out[4].chunks == ((7,),)  # replicated: one chunk, from one file
        assert ctx.recovered_from == (CKPT.get(name, 1), LEVEL[name]), name
        ctx._close()
    for name in ("l2_lost", "l3_lost"):  # rebuilt from the partner copy / the group's parity
        assert list(find_paths(tmp_path / name / "Local" / "node1", "Ckpt1-Rank1.fti")), name


@pytest.mark.dask
def test_dask_backend_refuses_damaged_mpi_data(written: Path, tmp_path: Path, dask_client) -> None:
    """A damaged container of an old rank's file: a clear error, no array filled, nothing rebound."""
    import dask.array as da

    import ftidask

    run_dir = tmp_path / "l4"
    shutil.copytree(written / "l4", run_dir)
    _corrupt_container(run_dir, 1, 2)
    ctx = _dask_ctx(dask_client, run_dir)
    into = np.full((10, 14), -1, np.int32)
    ctx.protect(2, into)
    held = da.zeros(103, chunks=50)
    ctx.protect(1, held)
    with pytest.raises(ftidask.NoCheckpointError, match="hash does not match"):
        ctx.recover()
    assert np.all(into == -1) and ctx.protected[1] is held
    ctx._close()


@pytest.mark.dask
def test_dask_backend_refuses_an_undeclared_mpi_checkpoint(written: Path, tmp_path: Path, dask_client) -> None:
    """Variables that declare no place in a global array: the clear error, nothing touched."""
    import ftidask

    run_dir = tmp_path / "undeclared"
    shutil.copytree(written / "undeclared", run_dir)
    ctx = _dask_ctx(dask_client, run_dir)
    into = np.full(7, -1.0)
    ctx.protect(4, into)
    with pytest.raises(ftidask.RecoveryError, match="written by the MPI or single-process backend") as err:
        ctx.recover()
    assert "declare no place in a global array" in str(err.value)
    assert "export --to-zarr" in str(err.value) and "global_shape" in str(err.value)
    assert np.all(into == -1)
    with pytest.raises(ftidask.RecoveryError, match="its stored sizes are per old rank"):
        ctx.stored_size(1)
    ctx._close()


@pytest.mark.dask
def test_dask_backend_recovers_a_single_process_checkpoint(tmp_path: Path, dask_client) -> None:
    """One process, nothing declared: its arrays are whole; a Python state comes back too."""
    import ftidask

    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "local_test": 1, "verbosity": 4}
    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    state = ftidask.State(step=7, name="run")
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    ctx.protect(2, state)
    ctx.protect(3, np.zeros((0, 4)))
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    back = ftidask.State()
    ctx.protect(2, back)
    out = ctx.recover(ids=[1])  # partial: the state stays as it is
    assert sorted(out) == [1] and dict(back) == {}
    out = ctx.recover(chunks={1: (3, 5)})
    assert out[1].chunks == ((3, 3), (5, 5)) and np.asarray(out[1]).tobytes() == a.tobytes()
    assert dict(back) == {"step": 7, "name": "run"}
    assert np.asarray(out[3]).shape == (0, 4)
    ctx._close()


def test_one_process_recovers_the_global_arrays(written: Path, tmp_path: Path) -> None:
    """Without MPI, one process declares the whole global arrays and recovers them from the 4 rank files."""
    from mpi_scripts.reshard_job import globals_

    import ftidask

    run_dir = tmp_path / "l4"
    shutil.copytree(written / "l4", run_dir)
    ctx = ftidask.init(ckpt_dir=str(run_dir / "Local"), glbl_dir=str(run_dir / "Global"),
                       meta_dir=str(run_dir / "Meta"), verbosity=4)
    glob = globals_()
    arrays = {vid: np.zeros_like(g) for vid, g in glob.items()}
    for vid, a in arrays.items():
        if vid == 4:
            ctx.protect(vid, a, replicated=True)
        else:
            ctx.protect(vid, a, global_shape=a.shape, offset=(0,) * a.ndim)
    ctx.recover()
    for vid, a in arrays.items():
        assert a.tobytes() == glob[vid].tobytes(), vid
    ctx._close()
