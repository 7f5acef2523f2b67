"""A test seam: the commit records' directory is on a full disk (every write fails with ENOSPC)."""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable
from typing import Any

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
