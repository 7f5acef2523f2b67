"""File I/O for the collective levels: errors are recorded, never raised mid-collective.

An L2/L3 step is a sequence of collectives over a group; a rank that raised halfway would leave
its peers waiting forever. So the levels read and write through these helpers, which turn an
I/O failure into zeros (reads) or a dropped output (writes) plus a message, and report after the
last collective. Any exception counts (MemoryError included), not only I/O errors; other local
work between collectives goes through :func:`ftidask.transport.collective.guarded`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

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


def linked_dir(path: Path) -> Path | None:
    """The checkpoint's or level's directory of rank file ``path`` (the run's own, never a link) that is a symbolic
    link, or None: a link planted there had a rebuild write the file outside the run."""
    return next((made for made in (path.parent, path.parent.parent) if made.is_symlink()), None)


def clear_directory(path: Path) -> None:
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


class SafeOutput:
    """An atomic output file (temporary name, fsync, rename) whose failures are recorded, not raised."""

    def __init__(self, path: Path, errors: list[str]) -> None:
        self.path, self.errors = path, errors
        self._cm: Any = atomic_file(path)
        self.fh: BinaryIO | None
        try:
            if (made := linked_dir(path)) is not None:
                raise OSError(errno.ELOOP, "a symbolic link where the run keeps a directory", str(made))
            clear_directory(path)
            self.fh = self._cm.__enter__()
        except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
            self.fh = None
            errors.append(f"cannot write {path}: {reason(exc)}")

    def write(self, data: Any) -> None:
        """Append ``data`` (a block of 1 MiB or more is sent to the disk at once); a failure is recorded and drops the
        output. Nothing once dropped."""
        if self.fh is None:
            return
        try:
            # the disk starts on each block while the next one is exchanged
            write_then_writeback(self.fh, memoryview(data), WRITEBACK_MIN)
        except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
            self.errors.append(f"cannot write {self.path}: {reason(exc)}")
            self.abort()

    def abort(self) -> None:
        """Drop the output (the temporary file is removed, the target is untouched)."""
        if self.fh is not None:
            self.fh = None
            self._cm.__exit__(OSError, OSError("aborted"), None)

    def close(self) -> bool:
        """Commit the file; True when it was written completely."""
        if self.fh is None:
            return False
        self.fh = None
        try:
            self._cm.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - recorded, reported with the level's error
            self.errors.append(f"cannot write {self.path}: {reason(exc)}")
            return False
        return True
