"""Which checkpoints a run keeps: retirement after a commit, garbage of interrupted checkpoints.

The rule is a pure function (:func:`to_retire`), used by every path that commits (the ranks, the
MPI heads, the Dask client); :class:`RetentionMixin` carries it out for :class:`ftidask.Context`
(which provides ``transport``, ``paths``, ``state``, ``config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..model.errors import FTIError
from ..storage import files as storage
from ..transport.collective import agree, attempt, everywhere, on_root
from .runstate import CommitRecord


def to_retire(records: Iterable[CommitRecord | None], new: CommitRecord, keep_l4: bool) -> list[CommitRecord]:
    """The checkpoints that committing ``new`` makes obsolete, oldest first (FTI's rule).

    A level-L checkpoint retires every earlier one of levels 1..L: it survives all that they survive.
    Higher levels stay (an L4 checkpoint outlives newer L1 ones), and so do L4 checkpoints when
    ``keep_l4`` (``keep_l4_ckpt = 1``). ``None`` entries (unreadable records) are skipped.
    """
    return sorted((old for old in records if old is not None and old.seq < new.seq and old.level <= new.level
                   and not (old.level == 4 and keep_l4)), key=lambda r: r.seq)


class RetentionMixin:
    """Deleting what is no longer needed, never what recovery may still use.

    Collective: a local error on any rank is raised as the same :class:`FTIError` on every rank
    (:mod:`ftidask.transport.collective`).
    """

    transport: Any
    paths: Any
    state: Any
    config: Any
    _dcp: Any
    _trash_pool: ThreadPoolExecutor | None

    def _retire_older(self, record: CommitRecord) -> None:
        """After a level-L commit, drop earlier checkpoints of levels 1..L (L4 archived if asked)."""
        t = self.transport
        older = on_root(t, lambda: [r.to_json() for r in self.state.records()], FTIError,
                        "cannot read the run's commit records")
        for old in to_retire(map(CommitRecord.from_json, older), record, bool(self.config.keep_l4_ckpt)):
            self._remove_checkpoint(old)

    def _collect_garbage(self) -> None:
        """Remove what interrupted checkpoints left: directories no commit record names, temporary files."""
        t = self.transport
        committed = on_root(t, lambda: sorted({r.dirname for r in self.state.records()}), FTIError,
                            "garbage collection: cannot read the run's commit records")
        roots = [self.paths.local_dir(level, t.node) for level in (1, 2, 3, 4)]
        if t.rank == 0:
            roots += [self.paths.level_dir(4, 0), self.state.records_dir, self.state.root]

        def collect() -> None:
            for root in roots:  # trash too, unless our own remover is on it
                if self.paths.contains(root):  # never outside the run's directories, whatever its exec_id
                    storage.collect_level_garbage(root, set(committed), trash=self._trash_pool is None,
                                                  spares=bool(self.config.enable_dcp))

        everywhere(t, collect, FTIError, "garbage collection failed")

    def _remove_checkpoint(self, record: CommitRecord) -> None:
        t = self.transport
        failed = f"removing checkpoint {record.ckpt_id} (level {record.level}) failed"
        t.barrier()
        on_root(t, lambda: self.state.delete_record(record.seq), FTIError, failed)
        if self._dcp is not None:  # its file becomes the spare that the next dCP checkpoint patches
            dcp = self._dcp
            _r, error = attempt(t.rank, lambda: dcp.retire(record.level, record.seq, self._rank_file(record),
                                                           record.ckpt_id))
        else:
            error = ""
        if self.config.enable_dcp:
            # every rank has moved its file out of the shared directories before any is removed
            agree(t, error, FTIError, failed)
        doomed = [self.paths.level_dir(level, t.node) / record.dirname for level in {record.level, 1, 2, 3}]
        if t.rank == 0:
            doomed.append(self.paths.level_dir(4, 0) / record.dirname)

        def remove() -> None:
            for path in doomed:
                if self.paths.contains(path):  # never outside the run's directories, whatever its exec_id
                    storage.discard(path, self._remover)

        _r, removing = attempt(t.rank, remove)
        agree(t, error or removing, FTIError, failed)

    def _remover(self) -> ThreadPoolExecutor:
        # Retired checkpoints are deleted off the critical path (they are no longer committed).
        if self._trash_pool is None:
            self._trash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-remove")
        return self._trash_pool
