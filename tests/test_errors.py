"""Clear ftidask errors instead of raw exceptions from deep inside (issue 12, item 9).

Each case below once ended in a raw OSError, AttributeError, ValueError, UnicodeDecodeError,
OverflowError... or was silently accepted; now it is an FTIError subclass that says what is
wrong, and nothing is left half-done (no temporary file, no partly filled array, the previous
checkpoint intact).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask import storage

# --- a commit record on a full meta_dir ------------------------------------------------------------


class _FullDiskFile(io.FileIO):
    """A file on a full disk: every write fails with ENOSPC (as the kernel answers)."""

    def write(self, data):  # noqa: ANN001 - io.FileIO's signature
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def _check_previous_recovers(dirs, expected: np.ndarray) -> None:
    ctx = ftidask.init(**dirs)
    out = np.zeros_like(expected)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from == (1, 1)
    np.testing.assert_array_equal(out, expected)
    ctx.finalize()


def test_commit_record_on_full_disk_is_a_checkpoint_error(dirs, monkeypatch):
    ctx = ftidask.init(**dirs)
    data = np.arange(1000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    real_open = open

    def full_meta_open(path, mode="r", *args, **kwargs):  # noqa: ANN001, ANN202
        # Only the commit records' directory is full: the checkpoint file itself is written.
        if "/commits/" in os.fspath(path) and "w" in mode:
            return io.BufferedRandom(_FullDiskFile(path, "w+"))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(storage, "open", full_meta_open, raising=False)
    data += 1
    with pytest.raises(ftidask.CheckpointError, match="commit record.*No space left"):
        ctx.checkpoint(2, 1)
    monkeypatch.undo()
    assert _temp_files(Path(dirs["meta_dir"])) == []
    assert ctx.last_checkpoint.id == 1
    ctx._close()  # a crashed process: the next one restarts
    _check_previous_recovers(dirs, np.arange(1000.0))


@contextlib.contextmanager
def _tiny_tmpfs(where: Path):
    """A 256 KiB tmpfs mounted at ``where`` (root only: the test skips elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte; the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0")
    return filler


def test_commit_record_on_a_really_full_meta_dir(tmp_path, dirs):
    with _tiny_tmpfs(tmp_path / "small") as small:
        dirs = dict(dirs, meta_dir=str(small / "Meta"))
        ctx = ftidask.init(**dirs)
        data = np.arange(1000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, 1)
        filler = _fill(small)
        data += 1
        with pytest.raises(ftidask.CheckpointError, match="commit record"):
            ctx.checkpoint(2, 1)
        assert _temp_files(small) == []
        assert not list(Path(dirs["ckpt_dir"]).rglob("ckpt2.*"))  # the uncommitted files are gone too
        filler.unlink()
        ctx._close()
        _check_previous_recovers(dirs, np.arange(1000.0))


@pytest.mark.dask
@pytest.mark.timeout(240)
def test_dask_commit_record_on_full_disk_is_a_checkpoint_error(dirs, monkeypatch):
    da = pytest.importorskip("dask.array")
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        ctx = ftidask.init(client=client, **dirs)
        first = da.arange(64.0, chunks=16).persist()
        ctx.protect(1, first)
        ctx.checkpoint(1, 1)
        real_open = open

        def full_meta_open(path, mode="r", *args, **kwargs):  # noqa: ANN001, ANN202
            if "/commits/" in os.fspath(path) and "w" in mode:  # the client writes the commit records
                return io.BufferedRandom(_FullDiskFile(path, "w+"))
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(storage, "open", full_meta_open, raising=False)
        ctx.protect(1, (first + 1).persist())
        with pytest.raises(ftidask.CheckpointError, match="commit record.*No space left"):
            ctx.checkpoint(2, 1)
        monkeypatch.undo()
        assert _temp_files(Path(dirs["meta_dir"])) == []
        assert not list(Path(dirs["ckpt_dir"]).rglob("ckpt2.*"))
        ctx.protect(1, da.zeros(64, chunks=16).persist())
        ctx.recover()
        assert ctx.recovered_from == (1, 1)
        np.testing.assert_array_equal(ctx.protected[1].compute(), np.arange(64.0))
        ctx.finalize()
