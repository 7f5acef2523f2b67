"""Writing one differential file: :class:`DcpHandle`, a rank's spare patched for its :class:`DcpStore`, and
:func:`write_differential`, the same without any state kept between checkpoints (a Dask task).

Separate from :mod:`ftidask.engine.dcpstore` (which file is patched, the spares and their block states),
which makes the handles.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dcp.files import DcpFileWriter, DcpStats, load_state
from ..ftiff.layout import Layout
from ..ftiff.writer import WrittenFile
from ..storage import files as storage

if TYPE_CHECKING:
    from .dcpstore import DcpStore


class DcpHandle:
    """One differential file being written: the writer, and where it goes on commit."""

    def __init__(self, store: DcpStore, level: int, fd: int, writer: DcpFileWriter, path: Path) -> None:
        self.store, self.level, self.fd, self.writer = store, level, fd, writer
        self.path = path  # the spare being patched (or, after a fallback recovery, a new file)
        self.closed = False

    def write_var(self, var_id: int, source: Any) -> int:
        """Patch variable ``var_id``'s changed blocks into the spare (unchanged pages are not hashed); bytes written."""
        tracking = self.store.tracking
        known = tracking.before_hash(var_id, source.view(0, source.nbytes))
        written = self.writer.write_var(var_id, source, known)
        tracking.after_hash(var_id, self.writer.var_digests(var_id))
        return written

    #: What the commit record of a checkpoint written so says of it (see engine.pending.RankWriter).
    record_extra: dict[str, Any] = {"dcp": True}

    def complete(self, path: Path, seq: int, meta: Mapping[str, Any], trailer: Mapping[str, Any], *,
                 pt_fs: int | None, max_fs: int | None) -> tuple[WrittenFile, DcpStats]:
        """:class:`~ftidask.engine.pending.RankWriter`'s finish: the spare patched, renamed to ``path``."""
        return self.finish(path, seq, trailer, pt_fs=pt_fs, max_fs=max_fs)

    def finish(self, final_path: Path, seq: int, trailer: Mapping[str, Any], *, pt_fs: int | None = None,
               max_fs: int | None = None) -> tuple[WrittenFile, DcpStats]:
        """Finish the file, fsync it and rename it to ``final_path`` (not yet committed)."""
        written, stats, state = self.writer.finish(trailer, pt_fs=pt_fs, max_fs=max_fs)
        try:
            self.close()
            storage.rename_into(self.path, final_path)
            storage.fsync_dir(self.path.parent)
        except BaseException:  # the delta's scratch file goes now, not with the frames of the error (a notebook's)
            if stats.xor is not None:
                stats.xor.close()
            raise
        self.store._files[self.level, seq] = state
        if stats.delta is not None and stats.data_runs:  # patched from a known base
            self.store._recent_writes[self.level].append((stats.data_bytes, stats.data_runs))
        return written, stats

    def abort(self) -> None:
        """Give up: the spare's content is now unknown (it is rewritten in full next time)."""
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.drain()
            finally:  # interrupted (Ctrl-C) while draining: the descriptor is closed all the same
                os.close(self.fd)
                self.writer.discard_xor()  # a scratch file not handed to the finished file's delta

    def __del__(self) -> None:
        # Lost before the checkpoint held it (Ctrl-C in a notebook): its descriptor must not stay open for ever.
        if not getattr(self, "closed", True):
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


def clear_spare_place(spare: Path) -> None:
    """Make the directory of the spare ``spare`` and clear its name for a regular file. A link (or a file) found at
    the directory's name is removed, never followed: the spares were written, and removed at finalize, wherever it
    pointed. A link, FIFO or directory at the spare's own name is removed: every differential checkpoint of the
    level failed on it, across restarts."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(spare.parent).st_mode):
            os.unlink(spare.parent)
    storage.makedirs(spare.parent)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(spare).st_mode):
            storage.remove_tree(spare)  # never followed


def write_differential(spare: Path, final: Path, expected_fb_hash: bytes | None, layout: Layout,
                       sources: Mapping[int, Any], infos: list[Any], meta: Mapping[str, Any], *, block_size: int,
                       bid: int, hash_id: int, pool: ThreadPoolExecutor, pt_fs: int | None = None,
                       max_fs: int | None = None, capture_xor: bool = False,
                       spill_dir: Path | None = None) -> tuple[WrittenFile, DcpStats]:
    """One rank's differential file without any state kept between checkpoints (e.g. a Dask task).

    ``spare`` is the file of a retired checkpoint (renamed there by the backend) whose FB hash
    its commit record gave as ``expected_fb_hash``; its block digests are read from the file
    (:func:`~ftidask.dcp.files.load_state`). Any other spare, or none, is rewritten in full. The
    result is fsynced and renamed to ``final``; the caller then writes the commit record.
    ``capture_xor`` keeps old XOR new of what is rewritten (``DcpStats.xor``, for an L3 parity update), past
    ``dcp.files.XOR_IN_MEMORY`` in a scratch file in ``spill_dir`` when one is given (the caller closes it).
    """
    from ..dcp.files import write_dcp_file

    base = load_state(spare, expected_fb_hash) if expected_fb_hash is not None else None
    clear_spare_place(spare)
    fd = storage.open_regular(spare, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, storage.FILE_MODE)
    try:
        written, stats, _state = write_dcp_file(fd, layout, sources, infos, meta, base, block_size=block_size,
                                                bid=bid, hash_id=hash_id, pool=pool, pt_fs=pt_fs, max_fs=max_fs,
                                                capture_xor=capture_xor, spill_dir=spill_dir)
    finally:
        os.close(fd)
    storage.rename_into(spare, final)
    return written, stats
