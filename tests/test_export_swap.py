"""``ftidask export --overwrite`` killed (SIGKILL) while it replaces a store: the old store or the new one is
there, whole, never neither (the old one was removed before the new one was renamed in)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from ftidask import load_config
from ftidask.storage import swap
from ftidask.tools.zarr_export import export_checkpoint, read_zarr

CHILD = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[3])
import crashpoints
from ftidask.tools.zarr_export import export_checkpoint
root = sys.argv[1]
dirs = dict(ckpt_dir=root + '/L', glbl_dir=root + '/G', meta_dir=root + '/M', verbosity=4)
ctx = ftidask.init(**dirs)
a = np.full(50_000, 1.0)
ctx.protect(1, a)
ctx.checkpoint(1, 1)
export_checkpoint(ftidask.load_config(**dirs), root + '/out.zarr')
a[:] = 2.0
ctx.checkpoint(2, 1)
crashpoints.install(sys.argv[2])
export_checkpoint(ftidask.load_config(**dirs), root + '/out.zarr', overwrite=True)
print("done", flush=True)
"""


@pytest.mark.skipif(swap._renameat2 is None, reason="no renameat2 in this libc")
@pytest.mark.parametrize(("point", "expect"), [("ftidask.storage.swap:exchange", 1.0),
                                                ("ftidask.storage.swap:exchange:after", 2.0),
                                                ("ftidask.storage.swap:remove_tree", 2.0)])
def test_export_overwrite_killed_leaves_the_old_store_or_the_new_one(tmp_path, point, expect):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), point, str(ROOT / "tests")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    arrays = read_zarr(tmp_path / "out.zarr")  # verified against its manifest
    assert len(arrays) == 1
    (_name, data), = arrays.values()
    assert np.array_equal(data, np.full(50_000, expect))


def test_replace_tree_swaps_and_removes_the_old_tree(tmp_path):
    old, new = tmp_path / "store", tmp_path / ".store.tmp"
    (old / "sub").mkdir(parents=True)
    (old / "sub" / "x").write_bytes(b"old")
    new.mkdir()
    (new / "y").write_bytes(b"new")
    swap.replace_tree(new, old)
    assert sorted(p.name for p in old.iterdir()) == ["y"] and (old / "y").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    (tmp_path / "file").write_bytes(b"a file where the tree goes")
    new.mkdir()
    swap.replace_tree(new, tmp_path / "file")
    assert (tmp_path / "file").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["file", "store"]


@pytest.mark.parametrize("point", [pytest.param("ftidask.zarrfmt.store:_hash_tree", marks=pytest.mark.slow),
                                   pytest.param("ftidask.storage.swap:exchange:after", marks=pytest.mark.slow),
                                   "ftidask.storage.swap:remove_tree"])
def test_the_next_export_removes_what_a_killed_export_left_beside_the_store(tmp_path, point):
    """An export killed while it built the new store (at a hidden temporary name beside the destination), or once it
    had swapped it in (the old store then at that name), left that tree there for good: each export names its
    temporary after its own pid and removed only its own. The next export, once its store is in place, removes the
    temporary trees of this host's processes that are gone."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), point, str(ROOT / "tests")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert any(p.name.startswith(".out.zarr.tmp-") for p in tmp_path.iterdir())  # what the kill left
    dirs = dict(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"), verbosity=4)
    export_checkpoint(load_config(**dirs), tmp_path / "out.zarr", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["L", "M", "out.zarr"]
    (_name, data), = read_zarr(tmp_path / "out.zarr").values()
    assert np.array_equal(data, np.full(50_000, 2.0))
