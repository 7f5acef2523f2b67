"""The state files' cache (:class:`ftidask.engine.records.JsonFiles`) where file timestamps are coarse.

A cached value is trusted while its file keeps its signature (inode, size, times). Where timestamps are coarse (1 s
on ext4 with 128-byte inodes, a kernel clock tick on ext4/XFS before Linux 6.13's fine-grained timestamps), a file
removed and written again within one tick often gets the freed inode, the same size and the same times. A run that
retires a full L4 checkpoint and a differential L1 one at the next L4 commit does just that to ``fallback-l1.json``
(dropped by the first, written by the second): the run then kept the dropped fallback as its view, and a recovery
in the same process fell back to spares that no longer held it (no checkpoint verified).

The test needs such a file system: it makes one (a loop-mounted ext4 image with 128-byte inodes), as root only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import ftidask
from ftidask.engine.records import seal_json, unsealed_record
from ftidask.storage.files import find_paths


def _sh(*cmd: str) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0


@pytest.fixture
def coarse_fs(tmp_path):
    """A directory on a file system whose timestamps are whole seconds and that gives a freed inode to the next
    file (skipped where none can be mounted: not root, no mkfs.ext4, no loop device)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not shutil.which("mount"):
        pytest.skip("needs root, mkfs.ext4 and mount (a loop-mounted ext4 with 128-byte inodes)")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(64 << 20)
    if not _sh("mkfs.ext4", "-q", "-F", "-I", "128", str(image)) or not _sh("mount", "-o", "loop", str(image),
                                                                             str(mnt)):
        pytest.skip("cannot make or loop-mount an ext4 image here")
    try:
        probe = mnt / "probe"
        probe.write_bytes(b"x")
        first = os.stat(probe)
        probe.unlink()
        probe.write_bytes(b"y")
        second = os.stat(probe)
        if first.st_mtime_ns % 10**9 or (first.st_ino, first.st_size) != (second.st_ino, second.st_size):
            pytest.skip("this file system's timestamps are not coarse, or it does not reuse a freed inode")
        probe.unlink()
        yield mnt
    finally:
        if not _sh("umount", str(mnt)):
            time.sleep(0.5)
            _sh("umount", "-l", str(mnt))


def test_a_fallback_dropped_and_written_again_within_one_tick_is_read_again(coarse_fs):
    for attempt in range(8):  # a collision needs the freed inode to be the one given next: most attempts, not all
        root = coarse_fs / f"run{attempt}"
        ctx = ftidask.init(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"),
                           enable_dcp=1, dcp_block_size=512, verbosity=2, exec_id="r")
        a = np.zeros(4096)
        ctx.protect(1, a)
        # L4 full, L1 differential (5), ...: checkpoint 5 retires 3 (in full: drops fallback 2) and 4 (fallback 4).
        for i, level in enumerate((4, 5, 4, 5, 4), 1):
            a[:] = i
            ctx.checkpoint(i, level)
        on_disk = unsealed_record(json.loads((ctx.state.records_dir / "fallback-l1.json").read_text()))
        assert on_disk is not None and on_disk.ckpt_id == 4
        assert [(r.level, r.ckpt_id) for r in ctx.state.fallbacks()] == [(1, 4)], f"attempt {attempt}"
        (newest,) = find_paths(root / "g", "r/l4/ckpt5.s*/Ckpt5-Rank0.fti")
        os.truncate(newest, os.path.getsize(newest) - 1000)
        a[:] = 0
        ctx.recover()  # checkpoint 5 fails its check: back to 4, in the L1 spares
        assert ctx.recovered_from == (4, 1) and (a == 4).all(), f"attempt {attempt}"
        ctx._close()


_HEAD = """
import os, sys
path, text = sys.argv[1], sys.argv[2]
old = os.stat(path).st_ino
os.unlink(path)
others = []  # what the writer creates meanwhile (a head copies files to L4) takes the lower free inodes
for n in range(1000):
    tmp = f"{path}.tmp-{n}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:  # as ftidask writes it
        if os.fstat(fh.fileno()).st_ino == old:
            fh.write(text)
            break
    others.append(tmp)
os.replace(tmp, path)
for other in others:
    os.unlink(other)
"""


def _drop_and_write_from_another_process(path, value: dict) -> None:
    """What a head's retirement does to a fallback record (``retired_in_full`` then ``write_fallback``), from
    another process: the file removed, then a new one renamed in its place, which gets the freed inode."""
    subprocess.run([sys.executable, "-c", _HEAD, str(path), json.dumps(value, sort_keys=True)], check=True)


def test_a_fallback_dropped_and_written_again_by_another_process_within_one_tick_is_read_again(coarse_fs):
    for attempt in range(4):  # the same second as the fallback replaced: most attempts, not all
        root = coarse_fs / f"run{attempt}"
        ctx = ftidask.init(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"),
                           enable_dcp=1, dcp_block_size=512, verbosity=2, exec_id="r")
        a = np.zeros(4096)
        ctx.protect(1, a)
        for i in (1, 2):
            a[:] = i
            ctx.checkpoint(i, 5)
        path = ctx.state.records_dir / "fallback-l1.json"
        raw = json.loads(path.read_text())
        assert [r.ckpt_id for r in ctx.state.fallbacks()] == [raw["ckpt_id"]] == [1]
        raw.update(seq=7, ckpt_id=7)  # the same size
        _drop_and_write_from_another_process(path, seal_json(raw))
        assert [r.ckpt_id for r in ctx.state.fallbacks()] == [7], f"attempt {attempt}"
        ctx._close()
