"""Export and L4-in-Zarr with the real MPI and Dask backends (skipped where a backend is absent)."""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
zarr = pytest.importorskip("zarr")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


MPI_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from mpi4py import MPI
    import ftidask

    d, fmt = Path(sys.argv[1]), sys.argv[2]
    comm = MPI.COMM_WORLD
    kw = dict(ckpt_dir=str(d / "l"), glbl_dir=str(d / "g"), meta_dir=str(d / "m"), exec_id="mpi",
              l4_format=fmt, verbosity=3, local_test=1)
    ctx = ftidask.init(comm=comm, **kw)
    a = np.full((4, 5), comm.rank, dtype=np.float64) + np.arange(5) / 10
    ctx.protect(1, a, name="block", compressor="zstd")
    ctx.protect(2, np.arange(comm.rank + 3), name="ragged")
    ctx.checkpoint(1, 4)
    ctx2 = ftidask.init(comm=comm, **kw)
    b, c = np.zeros((4, 5)), np.zeros(comm.rank + 3, dtype=np.int64)
    ctx2.protect(1, b)
    ctx2.protect(2, c)
    ctx2.recover()
    assert b.tobytes() == a.tobytes() and (c == np.arange(comm.rank + 3)).all()
""")


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["ftiff", "zarr"])
def test_mpi_l4_and_export(tmp_path, fmt):
    if not (_has("mpi4py") and _has("ftidask.backends.mpi.transport")):
        pytest.skip("needs mpi4py and the MPI backend")
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    script = tmp_path / "run.py"
    script.write_text(MPI_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path), fmt],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if fmt == "zarr":
        stores = sorted(tmp_path.glob("g/mpi/l4/ckpt1.s*/Ckpt1-Rank*.zarr"))
        assert len(stores) == 2
    from ftidask.tools.zarr_export import export_checkpoint

    dirs = dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m", exec_id="mpi")
    result = export_checkpoint(None, tmp_path / "out.zarr", **dirs)
    assert result.nranks == 2 and result.level == 4
    group = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")
    for rank in (0, 1):
        expected = np.full((4, 5), rank, dtype=np.float64) + np.arange(5) / 10
        assert group[f"rank{rank}/block"][...].tobytes() == expected.tobytes()
        assert np.array_equal(group[f"rank{rank}/ragged"][...], np.arange(rank + 3))


@pytest.mark.dask
def test_dask_checkpoint_export(tmp_path):
    if not (_has("distributed") and _has("ftidask.backends.dask.context")):
        pytest.skip("needs distributed and the Dask backend")
    import dask.array as da
    import xarray as xr
    from distributed import Client, LocalCluster

    import ftidask
    from ftidask.tools.zarr_export import export_checkpoint

    dirs = dict(ckpt_dir=str(tmp_path / "l"), glbl_dir=str(tmp_path / "g"), meta_dir=str(tmp_path / "m"),
                verbosity=3)
    full = np.arange(6 * 10, dtype=np.float64).reshape(6, 10)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        x = da.from_array(full, chunks=(3, 4)).persist()
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, x, name="x")
        ctx.checkpoint(1, 1)
        result = export_checkpoint(None, tmp_path / "dask.zarr", **dirs)
        ctx.finalize()
    assert result.arrays == ("x",)
    z = zarr.open_array(str(tmp_path / "dask.zarr"), path="x", mode="r")
    assert z.chunks == (3, 4)
    assert z[...].tobytes() == full.tobytes()
    assert da.from_zarr(str(tmp_path / "dask.zarr"), component="x").compute().tobytes() == full.tobytes()
    assert xr.open_zarr(tmp_path / "dask.zarr")["x"].values.tobytes() == full.tobytes()
