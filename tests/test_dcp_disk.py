"""Disk use of differential checkpointing stays bounded: retired spares are deleted (files, not only
directories), finalize leaves no trash, and start-up removes what a crash left (issue 12, item 4)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.storage import files as storage


def _kw(root: Path, **extra):
    kw = dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), enable_dcp=1,
              dcp_block_size=512, verbosity=3)
    kw.update(extra)
    return kw


def _disk_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # deleted in the background meanwhile
                pass
    return total


def _trash(root: Path) -> list[Path]:
    return [p for p in storage.find_paths(root, f"{storage.TRASH_PREFIX}*")]


@pytest.mark.parametrize("count", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_l5_l5_l1_l1_keeps_disk_use_bounded_and_finalize_leaves_no_trash(tmp_path, count):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.zeros(16_384, dtype=np.float64)  # 128 KiB of state
    ctx.protect(1, a)
    pattern = (5, 5, 1, 1)
    most = 0
    for i in range(count):
        a[(i * 97) % a.size] += 1.0
        ctx.checkpoint(i + 1, pattern[i % 4])
        most = max(most, _disk_bytes(tmp_path))
    state = a.nbytes
    # The newest checkpoint, one spare, the file being retired and one being deleted: a few states,
    # never one per checkpoint (before the fix: ~100 state-sized trash files after 200 checkpoints).
    assert most < 6 * state, f"disk use grew to {most} bytes ({most / state:.1f} states)"
    ctx.finalize()
    assert _trash(tmp_path) == []
    assert _disk_bytes(tmp_path) < state  # only run state and records are left


def _three_differential_checkpoints_then_killed(tmp_path: Path) -> tuple[ftidask.Context, np.ndarray]:
    """A run that wrote three L5 checkpoints and died (closed without finalize: nothing removed)."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(8192, dtype=np.float64)
    ctx.protect(1, a)
    for i in range(3):
        a[i] = -1.0
        ctx.checkpoint(i + 1, 5)
    ctx._close()
    return ctx, a


def test_crash_left_trash_and_spares_are_collected_at_the_next_start(tmp_path):
    ctx, a = _three_differential_checkpoints_then_killed(tmp_path)
    level_dir = ctx.paths.level_dir(1, 0)
    # What a process killed between renaming a spare to the trash and deleting it leaves behind
    # (and a trashed checkpoint directory, and a trashed file in the level directory).
    planted = [level_dir / storage.SPARE_DIR / ".trash-Spare-Rank0.fti-4242-0badf00d",
               level_dir / storage.SPARE_DIR / ".trash-SparePcof-Rank0.fti-4242-0badf00e",
               level_dir / ".trash-Ckpt9-Rank0.fti-4242-0badf00f"]
    for path in planted:
        path.write_bytes(os.urandom(a.nbytes))
    trashed_dir = level_dir / ".trash-ckpt9.s9-4242-0badcafe"
    trashed_dir.mkdir()
    (trashed_dir / "Ckpt9-Rank0.fti").write_bytes(os.urandom(1000))
    ctx2 = ftidask.init(**_kw(tmp_path))
    assert ctx2.status() == 1
    assert _trash(tmp_path) == []
    out = np.zeros_like(a)
    ctx2.protect(1, out)
    ctx2.recover()
    assert np.array_equal(out, a)
    ctx2.finalize()
    assert _trash(tmp_path) == []


def test_spares_are_removed_at_start_when_the_run_has_no_differential_checkpoints(tmp_path):
    _ctx, a = _three_differential_checkpoints_then_killed(tmp_path)  # the spares stay
    assert storage.find_paths(tmp_path, "dcp/Spare-Rank0.fti")
    ctx2 = ftidask.init(**_kw(tmp_path, enable_dcp=0))  # restarted without dCP: nothing will patch them
    assert storage.find_paths(tmp_path, storage.SPARE_DIR) == []
    out = np.zeros_like(a)
    ctx2.protect(1, out)
    ctx2.recover()
    assert np.array_equal(out, a)
    ctx2.finalize()


def test_remove_tree_removes_files_links_and_trees(tmp_path, caplog):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_bytes(b"x")
    target = tmp_path / "kept"
    target.mkdir()
    (target / "precious").write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(target)
    for path in (f, d, link, tmp_path / "absent"):
        storage.remove_tree(path)
        assert not os.path.lexists(path)
    assert (target / "precious").exists()  # a link is removed, never followed


def test_dask_l5_l5_l1_l1_keeps_disk_use_bounded_and_finalize_leaves_no_trash(tmp_path, dask_client):
    import pytest

    da = pytest.importorskip("dask.array")
    client = dask_client  # the shared cluster of 2 worker processes (conftest.py)
    ctx = ftidask.init(client=client, **_kw(tmp_path, dcp_block_size=1024))
    field = da.zeros((128, 128), chunks=(64, 128))  # 128 KiB, one chunk per worker
    state = 128 * 128 * 8
    pattern = (5, 5, 1, 1)
    most = 0
    for i in range(24):
        field = field + (da.arange(128)[:, None] == i)  # one row changes
        ctx.protect(1, field)
        ctx.checkpoint(i + 1, pattern[i % 4])
        field = ctx.protected[1]
        most = max(most, _disk_bytes(tmp_path))
    assert most < 6 * state, f"disk use grew to {most} bytes ({most / state:.1f} states)"
    ctx.finalize()
    assert _trash(tmp_path) == []
    assert _disk_bytes(tmp_path) < state
