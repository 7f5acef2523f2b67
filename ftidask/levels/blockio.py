"""File I/O for the collective levels: errors are recorded, never raised mid-collective.

An L2/L3 step is a sequence of collectives over a group; a rank that raised halfway would leave
its peers waiting forever. So the levels read and write through these helpers, which turn an
I/O failure into zeros (reads) or a dropped output (writes) plus a message, and report after the
last collective. Any exception counts (MemoryError included), not only I/O errors; other local
work between collectives goes through :func:`ftidask.transport.collective.guarded`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..storage.direct import DirectStream, open_stream
from ..storage.files import atomic_file, move_to_trash, open_read, remove_tree, write_then_writeback
from ..transport.collective import reason


def open_input(path: Path, errors: list[str]) -> BinaryIO | None:
    """``path`` opened for reading, or None (the error recorded)."""
    try:
        return open_read(path)  # closed by the caller
    except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
        errors.append(f"cannot read {path}: {reason(exc)}")
        return None


def read_block(fh: BinaryIO | None, offset: int, length: int, valid: int) -> np.ndarray:
    """``length`` bytes at ``offset``; zeros past the ``valid`` bytes (padding), or where the file cannot be read."""
    out = np.zeros(length, dtype=np.uint8)
    n = max(0, min(length, valid - offset))
    if fh is not None and n:
        with contextlib.suppress(OSError):
            fh.seek(offset)
            fh.readinto(memoryview(out)[:n])
    return out


def _clear_directory(path: Path) -> None:
    """Move a directory found at ``path`` out of the way and remove it: a file of a checkpoint replaced by a
    directory is a lost file, which the rename of its rebuilt copy could not replace. Never followed (lstat)."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return
    if is_dir:
        trash = move_to_trash(path)
        if trash is not None:
            remove_tree(trash)


WRITEBACK_MIN = 1 << 20  # blocks from this size on are sent to the disk as soon as they are written
#: Smaller outputs are written through the page cache even when ``direct`` is asked (a direct stream's threads and
#: buffers cost more than they save on a file of a few blocks).
DIRECT_MIN = 1 << 20


class SafeOutput:
    """An atomic output file (temporary name, fsync, rename) whose failures are recorded, not raised. ``direct``: a
    file nobody reads back soon (a partner copy, a parity file) of ``size`` bytes, at least :data:`DIRECT_MIN`, written
    around the page cache where the file system allows (:mod:`ftidask.storage.direct`)."""

    def __init__(self, path: Path, errors: list[str], direct: bool = False, size: int = 0) -> None:
        self.path, self.errors = path, errors
        self._cm: Any = atomic_file(path)
        self.fh: BinaryIO | None = None
        self.stream: DirectStream | None = None
        self.pos = 0
        try:
            _clear_directory(path)
            self.fh = self._cm.__enter__()
            if direct and size >= DIRECT_MIN:
                self.stream = open_stream(self.fh.fileno())  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
            errors.append(f"cannot write {path}: {reason(exc)}")
            self.abort()

    def write(self, data: Any) -> None:
        """Append ``data`` (a block of 1 MiB or more is sent to the disk at once); a failure is recorded and drops the
        output. Nothing once dropped."""
        if self.fh is None:
            return
        try:
            if self.stream is not None:  # written by the stream's threads while the next block is exchanged
                view = memoryview(data).cast("B")
                self.stream.write(self.pos, view)
                self.pos += view.nbytes
            else:  # the disk starts on each block while the next one is exchanged
                write_then_writeback(self.fh, memoryview(data), WRITEBACK_MIN)
        except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
            self.errors.append(f"cannot write {self.path}: {reason(exc)}")
            self.abort()

    def abort(self) -> None:
        """Drop the output (the temporary file is removed, the target is untouched)."""
        if self.stream is not None:
            self.stream.abort()  # no write in flight when the temporary file is removed
            self.stream = None
        if self.fh is not None:
            self.fh = None
            with contextlib.suppress(OSError):
                self._cm.__exit__(OSError, OSError("aborted"), None)

    def close(self) -> bool:
        """Commit the file; True when it was written completely."""
        if self.fh is None:
            return False
        if self.stream is not None:
            try:
                self.stream.close()
            except Exception as exc:  # noqa: BLE001 - recorded, reported with the level's error
                self.errors.append(f"cannot write {self.path}: {reason(exc)}")
                self.abort()
                return False
            self.stream = None
        self.fh = None
        try:
            self._cm.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - recorded, reported with the level's error
            self.errors.append(f"cannot write {self.path}: {reason(exc)}")
            return False
        return True
