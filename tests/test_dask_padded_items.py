"""Every byte of a structured item (padding, bytes no field covers) comes back through the Dask backend: Dask joins
and rechunks structured chunks with NumPy's field-by-field copy, which dropped those bytes (found by a review)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = pytest.mark.dask

PADDED = {"partial16": np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [0], "itemsize": 16}),
          "aligned": np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<u2")], align=True)}


def _random(dtype: np.dtype, shape=(40, 30), seed=1) -> np.ndarray:
    """A writable array over random bytes (never ``.copy()`` one: NumPy copies a structured array of more than a few
    items field by field, padding not included)."""
    n = dtype.itemsize * int(np.prod(shape))
    return np.frombuffer(bytearray(np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes()),
                         dtype).reshape(shape)


def _items(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array.view(np.dtype((np.void, array.dtype.itemsize)))).tobytes()


def _dirs(base: Path) -> dict:
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 1}


@pytest.mark.parametrize(("writer", "strided"), [("dask", False), ("dask", True), ("dask-async", False),
                                                ("dask-async", True), ("serial", False)])
@pytest.mark.parametrize("name", sorted(PADDED))
def test_a_numpy_variable_comes_back_with_every_byte(dask_client, tmp_path, name, writer, strided):
    """Written by the Dask backend (sent to a worker as it is, or as a copy for an asynchronous checkpoint; from a
    C-contiguous or a strided array) or by one process (stitched back on the workers), recovered into a NumPy array:
    the bytes of the padding too."""
    dtype = PADDED[name]
    src = _random(dtype, (40, 60))[:, ::2] if strided else _random(dtype)
    ctx = ftidask.init(client=dask_client, **_dirs(tmp_path)) if writer != "serial" else ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, src)
    if writer == "dask-async":
        ctx.checkpoint(1, 1, wait=False).result()
    else:
        ctx.checkpoint(1, 4 if writer == "serial" else 1)
    ctx._close()
    again = ftidask.init(client=dask_client, **_dirs(tmp_path))
    out = np.zeros(src.shape, src.dtype)
    again.protect(1, out)
    again.recover()
    assert _items(out) == _items(src)
    again.finalize()


def _block(seed: int, name: str, rows: int, cols: int, block_info=None) -> np.ndarray:
    """A block of random bytes made on the worker (Dask's own copies of a structured chunk, from_array's among them,
    go field by field: the padding a test sends would not arrive)."""
    row = block_info[None]["array-location"][0][0]
    return _random(PADDED[name], (rows, cols), seed + row)


def _chunk_bytes(client, arr) -> bytes:
    """Every byte of each chunk of ``arr`` (C order of the grid), taken on the worker that holds it."""
    arr = client.persist(arr)
    futures = {f.key: f for f in distributed.futures_of(arr)}
    keys = [k for row in arr.__dask_keys__() for k in row]
    return b"".join(client.gather([client.submit(_items, futures[k], pure=False) for k in keys]))


def _expected(dtype: np.dtype) -> bytes:
    return b"".join(_items(_random(dtype, (10, 30), 100 + row)) for row in range(0, 40, 10))


@pytest.mark.parametrize("name", sorted(PADDED))
def test_a_dask_variable_rechunked_at_recovery_keeps_every_byte(dask_client, tmp_path, name):
    """Recovered into other chunks than those written: the rechunk joins and splits items as bytes (each block's
    bytes compared on its worker)."""
    dtype = PADDED[name]
    blocks = da.map_blocks(_block, 100, name, 10, 30,
                           chunks=((10,) * 4, (30,)), dtype=dtype, meta=np.empty((0, 0), dtype))
    ctx = ftidask.init(client=dask_client, **_dirs(tmp_path))
    assert _chunk_bytes(dask_client, blocks) == _expected(dtype)
    ctx.protect(1, blocks)
    ctx.checkpoint(1, 1)
    ctx._close()
    again = ftidask.init(client=dask_client, **_dirs(tmp_path))
    got = again.recover(chunks={1: (16, 30)})[1]
    assert got.chunks == ((16, 16, 8), (30,))
    assert _chunk_bytes(dask_client, got) == _expected(dtype)
    again.finalize()
