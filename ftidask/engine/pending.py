"""A checkpoint being written, variable by variable, before its commit.

:meth:`Context.checkpoint` writes every protected variable at once through it; incremental
checkpointing (:mod:`ftidask.engine.icp`) writes them one at a time as the application finishes with
them. The same object writes a full file (levels 1-4: a new file at a temporary name, renamed
when complete) or a differential one (levels 5-8: the spare file patched in place, see
:mod:`ftidask.engine.dcpstore`). Nothing is visible to recovery before the commit record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..dcp.files import DcpStats
from ..ftiff.layout import Layout
from ..ftiff.writer import WrittenFile, write_metadata, write_spans
from ..model.arrays import ArrayBytes, VarInfo
from ..model.errors import CheckpointError
from ..model.level import Level
from ..storage import interrupts
from ..storage.files import create_temp, fsync_dir, fsync_parents, located, makedirs
from . import device as device_vars
from . import pystate


class RankWriter(Protocol):
    """How a rank's file of a checkpoint is written: a full FTI-FF file variable by variable (iCP),
    every variable at once (compressed, or Zarr at L4), or the spare patched in place (dCP)."""

    #: What the commit record says of the files (``{}``, ``{"l4_format": "zarr"}``, ``{"dcp": True}``).
    record_extra: dict[str, Any]

    def write_var(self, var_id: int, source: Any) -> int:
        """Write variable ``var_id`` now (its array may change once this returns); the bytes written."""

    def complete(self, path: Path, seq: int, meta: Mapping[str, Any], trailer: Mapping[str, Any], *,
                 pt_fs: int | None, max_fs: int | None) -> tuple[WrittenFile, DcpStats | None]:
        """Finish the file at ``path`` (``trailer``: ``meta`` with the variable table); the file, and a
        differential checkpoint's statistics."""

    def abort(self) -> None:
        """Drop what was written; nothing is left open."""


class RankFileWriter:
    """A full FTI-FF file written variable by variable at a temporary name, renamed on finish."""

    record_extra: dict[str, Any] = {}  # a plain FTI-FF file: the record says nothing more (never mutated)

    def __init__(self, path: Path, layout: Layout, hash_id: int, pool: ThreadPoolExecutor | None = None) -> None:
        self._created: list[Path] = []  # the directories made for it: durable with the file (makedirs)
        makedirs(path.parent, self._created)
        self.path, self.layout, self.hash_id = path, layout, hash_id
        with interrupts.held_off():  # Ctrl-C never between the descriptor and its file object
            fd, self.tmp = create_temp(path)
            self.fh = os.fdopen(fd, "w+b")  # closed by finish or abort
        self.digests: dict[tuple[int, int], bytes] = {}
        self.data_bytes = 0
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")

    def write_var(self, var_id: int, source: Any) -> int:
        """Write and hash every container of ``var_id`` now (the array may change afterwards)."""
        spans = [((bi, si), slot.fptr, source, slot.dptr, slot.dptr + slot.chunksize)
                 for bi, si, slot in self.layout.positions_of(var_id) if slot.hascontent]
        self.digests.update(write_spans(self.fh, spans, self.hash_id, self._pool))
        written = sum(stop - start for _key, _offset, _source, start, stop in spans)
        self.data_bytes += written
        return written

    def complete(self, path: Path, seq: int, meta: Mapping[str, Any], trailer: Mapping[str, Any], *,
                 pt_fs: int | None, max_fs: int | None) -> tuple[WrittenFile, DcpStats | None]:
        """:class:`RankWriter`'s finish (``path`` is the one it was opened with)."""
        return self.finish(trailer, pt_fs=pt_fs, max_fs=max_fs), None

    def finish(self, trailer: Mapping[str, Any], *, pt_fs: int | None = None,
               max_fs: int | None = None) -> WrittenFile:
        """Write the metadata and ``trailer`` (the variable table), fsync, rename to ``path``; the file written."""
        written = write_metadata(self.fh, self.layout, self.digests, hash_id=self.hash_id, trailer=trailer,
                                 pt_fs=pt_fs, max_fs=max_fs)
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        fsync_parents(self._created)
        return dataclasses.replace(written, data_bytes=self.data_bytes)

    def abort(self) -> None:
        """Close and remove the temporary file."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def close(self) -> None:
        """Close the file (and the hashing pool if it is this writer's own); idempotent."""
        if not self.fh.closed:
            self.fh.close()
            if self._own_pool:
                self._pool.shutdown(wait=True)


class OneShotWriter:
    """Writes the whole file at once when the checkpoint is finished (a plain ``checkpoint()``):
    ``write(meta=..., pt_fs=..., max_fs=...)`` does it, with compression or Zarr L4 if configured."""

    def __init__(self, write: Callable[..., WrittenFile], record_extra: dict[str, Any] | None = None) -> None:
        self.write = write
        self.record_extra = record_extra or {}  # {"l4_format": "zarr"} when ``write`` makes a Zarr store

    def complete(self, path: Path, seq: int, meta: Mapping[str, Any], trailer: Mapping[str, Any], *,
                 pt_fs: int | None, max_fs: int | None) -> tuple[WrittenFile, DcpStats | None]:
        """:class:`RankWriter`'s finish: the whole file written now, from ``meta`` (``write`` knows where)."""
        return self.write(meta=meta, pt_fs=pt_fs, max_fs=max_fs), None

    #: the variables' sources and descriptions are made by ``write`` at finish (here neither is needed before)
    at_finish = True

    def write_var(self, var_id: int, source: Any) -> int:
        """Nothing yet (0 bytes): :meth:`complete` writes every variable, from the arrays as they are then."""
        return 0  # written by finish, from the protected arrays as they are then

    def abort(self) -> None:
        """Nothing is open before finish; a failed write cleans up after itself."""


@dataclasses.dataclass
class PendingCheckpoint:
    """Checkpoint ``ckpt_id`` between its start and its commit, on one rank."""

    ckpt_id: int
    level: int  # as asked: 1-4, or 5-8 for a differential checkpoint
    seq: int
    layout: Layout
    directory: Path
    path: Path
    sizes: dict[int, int]  # var id -> bytes planned
    writer: RankWriter | None  # None when opening it failed (see error)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    written: set[int] = dataclasses.field(default_factory=set)
    infos: dict[int, VarInfo] = dataclasses.field(default_factory=dict)
    error: str = ""
    result: WrittenFile | None = None
    stats: DcpStats | None = None
    post_level: int = 0  # the level a head raises the checkpoint to afterwards (0: none)
    extras: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # var id -> VarInfo.extra
    sync_at_commit: bool = False  # the file is renamed unsynced; the commit fsyncs it after the level's redundancy
    #: iCP: a variable's VarInfo.extra as it is protected now. ``extras`` are those of the start, the bytes those
    #: of the add: a variable protected as another kind in between (an array for a Python state, another global
    #: array declaration) would be recorded as what it no longer is, so its add is refused.
    extras_now: Callable[[int], dict[str, Any]] | None = None

    @property
    def base_level(self) -> int:
        """Where the files live: L5-L8 are differential L1-L4."""
        return Level.of(self.level).base

    @property
    def differential(self) -> bool:
        """Whether the checkpoint is differential (levels 5-8)."""
        return Level.of(self.level).differential

    def write_var(self, var_id: int, name: str, array: np.ndarray, extra: Mapping[str, Any] | None = None, *,
                  source: Any = None) -> None:
        """Write variable ``var_id`` now; its array may change once this returns. ``source``: read its
        bytes through this byte source instead (a snapshot's), ``array`` giving only its description."""
        if var_id in self.written:
            raise CheckpointError(f"variable {var_id} was already added to checkpoint {self.ckpt_id}")
        if var_id not in self.sizes:
            raise CheckpointError(f"variable {var_id} was not protected when checkpoint {self.ckpt_id} started "
                                  "(init_icp): it is not part of it; protect it before init_icp")
        if self.sizes.get(var_id) != array.nbytes:
            raise CheckpointError(f"variable {var_id} has {array.nbytes} bytes, {self.sizes.get(var_id)} when "
                                  f"checkpoint {self.ckpt_id} started; its size must not change in between")
        if self.extras_now is not None:
            now, then = self.extras_now(var_id), self.extras.get(var_id, {})
            if now != then:
                raise CheckpointError(f"variable {var_id} is {_described(now)}, {_described(then)} when checkpoint "
                                      f"{self.ckpt_id} started; what it is must not change in between: protect it "
                                      "as it was then and add it again")
        if self.writer is None:
            raise CheckpointError(self.error or "checkpoint file not open")
        if self._at_finish:  # described and read at finish: nothing to make per variable
            self.written.add(var_id)
            return
        self.infos[var_id] = VarInfo.of(var_id, name, array, **self.extras.get(var_id, {}))
        try:
            self.writer.write_var(var_id, source if source is not None else ArrayBytes(array))
        except OSError as exc:
            raise located(exc, self.path) from None
        self.written.add(var_id)

    def write_vars(self, variables: Iterable[tuple[int, str, np.ndarray, Any]]) -> None:
        """:meth:`write_var` of each ``(var_id, name, array, source)`` in turn; the first failure raises."""
        if not self._at_finish:
            for vid, name, array, source in variables:
                self.write_var(vid, name, array, source=source)
            return
        written, sizes = self.written, self.sizes
        for vid, name, array, _source in variables:  # described and read at finish: only checked here
            if vid in written or sizes.get(vid) != array.nbytes:
                self.write_var(vid, name, array)  # raises the error
            written.add(vid)

    def finish(self, meta: Mapping[str, Any], *, pt_fs: int | None, max_fs: int | None) -> WrittenFile:
        """Complete this rank's file (every variable must have been written)."""
        missing = sorted(set(self.sizes) - self.written)
        if missing:
            raise CheckpointError(f"checkpoint {self.ckpt_id}: protected variables {missing} were not added")
        trailer = dict(meta)
        if not self._at_finish:
            trailer["vars"] = [self.infos[vid].to_json() for vid in self.sizes]
        if self.writer is None:
            raise CheckpointError(self.error or "checkpoint file not open")
        try:
            self.result, self.stats = self.writer.complete(self.path, self.seq, meta, trailer, pt_fs=pt_fs,
                                                           max_fs=max_fs)
        except OSError as exc:
            raise located(exc, self.path) from None
        return self.result

    @property
    def _at_finish(self) -> bool:
        """Whether the writer describes and reads every variable itself at finish (:class:`OneShotWriter`)."""
        return getattr(self.writer, "at_finish", False)

    @property
    def record_extra(self) -> dict[str, Any]:
        """What the commit record says of this checkpoint's files (its writer's kind)."""
        return self.writer.record_extra if self.writer is not None else {}

    def abort(self) -> None:
        """Drop what the writer wrote (an OSError while doing so is ignored)."""
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.abort()


def _described(extra: Mapping[str, Any]) -> str:
    """What a variable with VarInfo.extra ``extra`` is, in words (a Python state, an array, where it lies)."""
    rest = dict(extra)
    kind = rest.pop(pystate.EXTRA_KEY, None)
    if kind is not None:
        return f"a Python state ({kind})"
    device = rest.pop(device_vars.EXTRA_KEY, None)
    words = "an array" + (f" on {device}" if device is not None else "")
    return words + (" declared " + ", ".join(f"{k}={v!r}" for k, v in sorted(rest.items())) if rest else "")
