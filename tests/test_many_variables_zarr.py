"""A Zarr export of thousands of small variables (and its verification): each array's checks scanned every file of
the store's manifest (n arrays x n files: 109 s to verify 10,000), and every file and directory was fsynced one after
another. The store must still hold every variable bit for bit, and a file missing from one array still be named.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import zarr

import ftidask
from ftidask.model.errors import FormatError
from ftidask.tools.zarr_export import export_checkpoint
from ftidask.zarrfmt import store as zstore

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
N = 1000


def _values(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(-(2**31), 2**31, 3 + i % 41, dtype=np.int32) if i % 2 else rng.random((2, 1 + i % 13))


def _exported(tmp_path):
    dirs = dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m")
    with ftidask.init(**dirs) as ctx:
        for i in range(N):
            ctx.protect(i, _values(i), name=f"v{i}", compressor="zstd" if i % 3 == 0 else None)
        ctx.checkpoint(1, 1)
        out = tmp_path / "many.zarr"
        export_checkpoint(None, out, **dirs)
    return out


def test_thousands_of_variables_export_and_verify_bit_for_bit(tmp_path):
    out = _exported(tmp_path)
    manifest = zstore.verify_store(out)
    assert len(manifest["vars"]) == N
    group = zarr.open_group(str(out), mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(group[f"v{i}"][...].tobytes() == _values(i).tobytes() for i in range(N))


@pytest.mark.parametrize("vid", [0, 999])
def test_a_chunk_file_missing_from_one_of_thousands_of_arrays_is_named(tmp_path, vid):
    """The manifest resealed without the array's chunk file (and the file gone): its array named, no other."""
    out = _exported(tmp_path)
    manifest = json.loads((out / zstore.MANIFEST).read_text())
    (chunk,) = [rel for rel in manifest["files"] if rel.startswith(f"v{vid}/c")]
    del manifest["files"][chunk]
    (out / chunk).unlink()
    (out / zstore.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=f"array 'v{vid}' has 1 chunks, the manifest lists 0 chunk files"):
        zstore.verify_store(out)
