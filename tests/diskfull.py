"""Full disks for tests: a real one (a small tmpfs, filled), and a seam where only the commit records'
directory is full (every write fails with ENOSPC)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftidask.storage import files as storage


class FullDiskFile(io.FileIO):
    """A file on a full disk: every write fails with ENOSPC, as the kernel answers."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.name))


def full_commit_records(setattr_: Callable[[Any, str, Any], None] = setattr, where: str = "/commits/") -> None:
    """Make :func:`ftidask.storage.files.open_temp` give a full-disk file for paths containing ``where``
    (``setattr_``: pytest's ``monkeypatch.setattr``, or plain ``setattr`` in a child process)."""
    real = storage.open_temp

    def open_temp(path: Any, mode: str = "w+b") -> tuple[Any, Any]:
        fh, tmp = real(path, mode)
        if where in os.fspath(path):
            fd = os.dup(fh.fileno())
            fh.close()
            return io.BufferedRandom(FullDiskFile(fd, "r+")), tmp
        return fh, tmp

    setattr_(storage, "open_temp", open_temp)


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: "256k", "16m") mounted at ``where``; root only, the test
    skips elsewhere. Unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the file system of ``directory`` up to ``leave`` bytes free (0: the last byte); the filler file."""
    filler = directory / "filler"

    def free() -> int:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize

    with open(filler, "wb", buffering=0) as fh, contextlib.suppress(OSError):
        for step in (1 << 20, 4096):
            while free() >= leave + step:
                fh.write(b"\0" * step)
        while leave == 0:
            fh.write(b"\0")
    return filler
