"""A directory ftidask creates is durable before any commit record names what it holds.

POSIX makes a new directory's name durable only when its parent is fsynced: ext4 and XFS commit it with any later
fsync, other file systems need not, and after a power loss a commit record could then name a checkpoint whose
directory is gone (its predecessor already retired). Every fsync of a directory is recorded here through the
storage module's one fsync seam (``files._fsync``); the commit record is the fsync of the ``commits`` directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.storage import files as storage
from ftidask.storage.files import find_paths


@pytest.fixture
def synced_dirs(monkeypatch) -> list[Path]:
    seen: list[Path] = []
    real = storage._fsync

    def recording(path: Path, flags: int) -> None:
        if flags & os.O_DIRECTORY:
            seen.append(Path(path))
        real(path, flags)

    monkeypatch.setattr(storage, "_fsync", recording)
    return seen


def test_makedirs_fsyncs_the_parent_of_each_directory_it_creates(tmp_path, synced_dirs):
    (tmp_path / "a").mkdir()
    storage.makedirs(tmp_path / "a" / "b" / "c")
    assert set(synced_dirs) == {tmp_path / "a", tmp_path / "a" / "b"}
    synced_dirs.clear()
    storage.makedirs(tmp_path / "a" / "b" / "c")  # nothing new: nothing to wait for
    assert synced_dirs == []


def test_makedirs_can_leave_the_parents_to_the_caller(tmp_path, synced_dirs):
    created: list[Path] = []
    storage.makedirs(tmp_path / "x" / "y", created)
    assert created == [tmp_path / "x", tmp_path / "x" / "y"] and synced_dirs == []
    storage.fsync_parents(created)
    assert synced_dirs == [tmp_path, tmp_path / "x"]


def _commits(seen: list[Path]) -> list[int]:
    return [i for i, path in enumerate(seen) if path.name == "commits"]


@pytest.mark.parametrize("level, l4_format", [(1, "ftiff"), (4, "ftiff"), (4, "zarr")])
def test_every_directory_of_a_checkpoint_is_durable_before_its_commit_record(tmp_path, synced_dirs, level, l4_format):
    """A Zarr store's parents were made by Zarr (no fsync): the newest checkpoint's directory could be lost in a crash
    after its record was published and the older checkpoints retired."""
    if l4_format == "zarr":
        pytest.importorskip("zarr")
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "local"), glbl_dir=str(tmp_path / "global"),
                       meta_dir=str(tmp_path / "meta"), keep_last_ckpt=False, l4_format=l4_format)
    a = np.arange(10_000.0)
    ctx.protect(0, a)
    suffix = ".zarr" if l4_format == "zarr" else ".fti"
    for ckpt_id in (1, 2):
        start = len(synced_dirs)
        ctx.checkpoint(ckpt_id, level)
        rank_file = next(p for p in find_paths(tmp_path, f"Ckpt{ckpt_id}-Rank0{suffix}"))
        before_record = set(synced_dirs[start:start + _commits(synced_dirs[start:])[0]])
        chain = [rank_file.parent] if ckpt_id == 2 else [d for d in rank_file.parents if tmp_path in d.parents]
        for directory in chain:  # the second checkpoint made only its own directory
            assert directory.parent in before_record, (ckpt_id, directory)
    ctx.finalize()


def test_directories_the_staging_mover_creates_are_durable(tmp_path, monkeypatch):
    """Sending to ``sub/deeper/f.dat`` made ``sub`` and ``sub/deeper``; only the last one was fsynced (the file's
    rename in it) before the staged source was removed: a power loss could lose the published file, its source gone.
    Each directory the mover creates has its parent fsynced now."""
    fsynced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "l"), glbl_dir=str(tmp_path / "g"), meta_dir=str(tmp_path / "m"),
                       enable_staging=1, stage_mover="thread")
    src = ctx.stage_dir() / "f.dat"
    src.write_bytes(b"x" * 1000)
    assert ctx.wait_staged(ctx.send_file(src, "sub/deeper/f.dat")) == ftidask.SI_SCES
    ctx.finalize()
    published = tmp_path / "g" / "sub" / "deeper" / "f.dat"
    assert published.read_bytes() == b"x" * 1000 and not src.exists()
    assert {str(tmp_path / "g"), str(tmp_path / "g" / "sub")} <= set(fsynced), fsynced
