"""Dask arrays of CuPy chunks on a LocalCluster of worker processes sharing the GPU (issue 19).

Needs CuPy, a CUDA device and distributed: skipped otherwise (CI has no GPU). Each worker writes the chunks it
holds from their bytes copied to the host; the files are those of NumPy chunks (the variable's record says they
were CuPy arrays). A recovery, a lineage read after a checkpoint, and a NumPy array protected in its place give
back the right kind of chunks, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the GPU tests run on a machine with a GPU)")
da = pytest.importorskip("dask.array")
pytest.importorskip("distributed")
try:
    _DEVICES = cupy.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001 - CuPy installed, no driver or no device
    _DEVICES = 0

import ftidask  # noqa: E402
from ftidask.engine.device import is_device_array  # noqa: E402

pytestmark = [pytest.mark.skipif(_DEVICES == 0, reason="no CUDA device"), pytest.mark.dask, pytest.mark.timeout(300)]


@pytest.fixture
def client(dask_client):
    return dask_client


def _kw(root: Path, **extra) -> dict:
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=3,
                group_size=2, node_size=1, **extra)


def _on_device(shape: tuple, chunks: tuple, dtype: str = "float32", seed: int = 0):
    host = np.random.default_rng(seed).integers(0, 1 << 30, int(np.prod(shape))).astype(dtype).reshape(shape)
    return host, da.from_array(host, chunks=chunks).map_blocks(cupy.asarray, dtype=host.dtype,
                                                               meta=cupy.empty((0,) * len(shape), dtype=dtype))


def _host(arr) -> np.ndarray:
    """The values of a Dask array of CuPy chunks, each brought to the host on its worker (only NumPy chunks cross
    the network: moving CuPy chunks between processes needs distributed's CUDA serializers, numba or RMM)."""
    return arr.map_blocks(cupy.asnumpy, dtype=arr.dtype, meta=np.empty((0,) * arr.ndim, arr.dtype)).compute()


def _chunk_kinds(arr) -> set[str]:
    """The top module of every chunk's type as the workers hold them: 'cupy' or 'numpy'."""
    import dask

    kind = dask.delayed(lambda b: type(b).__module__.split(".")[0])
    return set(dask.compute(*[kind(b) for b in arr.to_delayed().ravel()]))


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_cupy_chunks_round_trip_at_every_level(client, tmp_path, level):
    host, x = _on_device((64, 48), (16, 24), seed=level)
    with ftidask.init(client=client, **_kw(tmp_path)) as ctx:
        ctx.protect(1, x)
        ctx.checkpoint(1, level)
        assert is_device_array(ctx.protected[1]._meta)  # the array its lineage was cut into: CuPy chunks still
        assert _chunk_kinds(ctx.protected[1]) == {"cupy"}
        _host2, y = _on_device((64, 48), (16, 24), seed=99)
        ctx.protect(1, y)
        out = ctx.recover()[1]
        assert is_device_array(out._meta) and _chunk_kinds(out) == {"cupy"}
        assert _host(out).tobytes() == host.tobytes()


def test_a_restart_gets_cupy_chunks_back_or_numpy_ones_as_protected(client, tmp_path):
    host, x = _on_device((40, 30), (10, 30), "float64", seed=3)
    first = ftidask.init(client=client, **_kw(tmp_path, keep_last_ckpt=1))
    first.protect(1, x)
    first.checkpoint(1, 1)
    first.finalize()
    with ftidask.init(client=client, **_kw(tmp_path, keep_last_ckpt=1)) as ctx:  # nothing protected: as written
        out = ctx.recover()[1]
        assert _chunk_kinds(out) == {"cupy"} and _host(out).tobytes() == host.tobytes()
    with ftidask.init(client=client, **_kw(tmp_path)) as ctx:  # a NumPy-backed array protected: NumPy chunks
        ctx.protect(1, da.zeros((40, 30), chunks=(20, 15)))
        out = ctx.recover()[1]
        assert _chunk_kinds(out) == {"numpy"} and out.compute().tobytes() == host.tobytes()


def test_differential_checkpoints_of_cupy_chunks(client, tmp_path):
    host, x = _on_device((64, 64), (32, 32), seed=5)
    with ftidask.init(client=client, **_kw(tmp_path, enable_dcp=1)) as ctx:
        ctx.protect(1, x)
        ctx.checkpoint(1, 5)
        ctx.protect(1, ctx.protected[1] + 1)
        info = ctx.checkpoint(2, 5)
        assert info.blocks_changed > 0
        ctx.protect(1, ctx.protected[1] * 0)
        out = ctx.recover()[1]
        assert _host(out).tobytes() == (host + 1).tobytes()


def test_a_cupy_array_protected_on_a_dask_context_is_recovered_in_place(client, tmp_path):
    a = cupy.asarray(np.arange(1000, dtype=np.int64))
    with ftidask.init(client=client, **_kw(tmp_path)) as ctx:
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        a[...] = -1
        out = ctx.recover()[1]
        assert out is a and (a.get() == np.arange(1000)).all()


def test_a_chunk_lost_with_its_worker_is_read_back_onto_a_device(client, tmp_path):
    """After a checkpoint the array's chunks read the checkpoint if lost: a worker killed (SIGKILL), the chunks it
    held come back from the L2 partner copy, CuPy arrays again, bit for bit."""
    from test_dask_lineage import kill_rank

    host, x = _on_device((64, 48), (16, 24), seed=7)
    with ftidask.init(client=client, **_kw(tmp_path)) as ctx:
        ctx.protect(1, x)
        ctx.checkpoint(1, 2)
        after = ctx.protected[1]
        kill_rank(client, ctx, 0, erase=True, replaced=False)
        assert _chunk_kinds(after) == {"cupy"} and _host(after).tobytes() == host.tobytes()
