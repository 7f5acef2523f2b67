"""Retention on a Dask cluster: the files to retire or collect live on the workers, one node each.

The rule is the engine's (:func:`ftidask.engine.retention.to_retire`), with one exception: a
checkpoint that live Dask arrays may still read back (their lineage was cut there, see
:mod:`.lineage`) is kept until the scheduler has forgotten every task that reads it, then retired
at the next checkpoint (before it is written) or commit. What differs otherwise is where the
deleting runs: a task on every worker, the global directory and the commit records on the client.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import logging
import os
from pathlib import Path

from ...engine.retention import Retention, to_retire
from ...engine.run import Run
from ...engine.runstate import CommitRecord
from ...model.errors import FTIError
from ...storage import files as storage
from . import fence, tasks
from .cluster import Cluster
from .lineage import Pins

log = logging.getLogger("ftidask")


class DaskRetention(Retention):
    """:class:`Retention` whose removals are tasks on the cluster's workers."""

    def __init__(self, cluster: Cluster, run: Run) -> None:
        # ``run.spares.store`` is the DaskSpares of a run with enable_dcp (ftidask.backends.dask.dcp_levels), or None.
        super().__init__(run)
        self.cluster = cluster
        self.started = False  # set by the first garbage collection (at init)
        # the lineage keys that read each checkpoint: the run's, whichever context of this process made them
        self.pins = Pins(cluster.client, (os.path.realpath(run.paths.meta_dir), run.paths.exec_id))
        self.deferred: list[CommitRecord] = []  # obsolete, but live arrays may still read them
        # While a commit's retirement runs: the retired directories, discarded on the workers by the collection that
        # follows it, in the same call (one round trip to every worker instead of two). None: discarded at once.
        self._discards: list[str] | None = None
        # The workers' share of the collection after a commit, started as its record is written (collect_early).
        self._early: concurrent.futures.Future | None = None

    def retire_older(self, record: CommitRecord) -> None:
        """After a commit, retire what FTI's rule retires, except the checkpoints live arrays may read."""
        carried, self.deferred = self.deferred, []
        self.take_remaining()  # none from an earlier retirement: its collection failed before it took them
        records = self.state.records()
        obsolete = to_retire(records, record, bool(self.config.keep_l4_ckpt))
        # Those kept for live arrays before stay obsolete, whatever this commit's level (an L1 commit's rule does not
        # name an L2 checkpoint an L2 commit retired: dropped from the list, it stayed on disk until finalize)
        known, committed = {r.seq for r in obsolete}, {r.seq for r in records}
        obsolete = sorted(obsolete + [r for r in carried if r.seq not in known and r.seq in committed],
                          key=lambda r: r.seq)
        # Their records are deleted here; were the collection not to run, it would remove their directories next time.
        self._discards = []
        try:
            self._retire(obsolete)
        except BaseException:  # no collection follows: what was retired so far is discarded now, as any other time
            discards, self._discards = self._discards, None
            with contextlib.suppress(Exception):  # (the collection of a later start removes them otherwise)
                self.cluster.run(tasks.discard_paths, discards)
            raise
        kept = {r.seq for r in self.deferred}
        gone = {r.seq for r in obsolete if r.seq not in kept}
        self.hand_over([(r.seq, r.dirname) for r in records if r.seq not in gone])  # records() is sorted

    def retire_deferred(self, carried: bool = False) -> list[str]:
        """Retire the checkpoints kept for live arrays that no live array reads any more. ``carried``: their
        directories on the workers are not discarded here but returned, for the tasks of the checkpoint about to
        be written to discard first (see :meth:`discard_now` when they do not run)."""
        if not self.deferred:
            return []
        committed = {r.seq for r in self.state.records()}
        deferred, self.deferred = self.deferred, []
        outer, self._discards = self._discards, ([] if carried else None)
        try:
            self._retire([r for r in deferred if r.seq in committed])
        except BaseException:  # what was retired so far is discarded now, as any other time
            self.discard_now(self._discards or [])
            raise
        finally:
            carry, self._discards = self._discards or [], outer
        return carry

    def discard_now(self, dirs: list[str]) -> None:
        """Discard ``dirs`` on every worker (best effort: the collection of a later start removes what is missed),
        those that :meth:`retire_deferred` handed to a checkpoint whose tasks may not have run."""
        if dirs:
            with contextlib.suppress(Exception):
                self.cluster.run(tasks.discard_paths, dirs)

    def _retire(self, obsolete: list[CommitRecord]) -> None:
        read = self.pins.read(obsolete)
        for old in obsolete:
            if (old.ckpt_id, old.seq) in read:
                log.debug("checkpoint %d (level %d) kept: live arrays may read chunks back from it", old.ckpt_id,
                          old.level)
                self.deferred.append(old)
            else:
                try:  # the client's share (its commit record, the global directory): a clean error, not errno's
                    self.remove_checkpoint(old)
                except OSError as exc:
                    raise FTIError(f"checkpoint {old.ckpt_id} (level {old.level}) could not be retired: {exc}") from exc
                self.pins.forget(old)

    def dirs(self, ckpt_id: int, seq: int, levels: set[int], nranks: int) -> list[str]:
        """A checkpoint's node-local directories, for every rank (L4's global one excluded)."""
        name = storage.ckpt_dirname(ckpt_id, seq)
        return [str(self.paths.level_dir(lv, r) / name) for lv in levels - {4} for r in range(nranks)]

    def remove_dirs(self, ckpt_id: int, seq: int, level: int, nranks: int, also: list[str] | None = None,
                    failed: bool = False) -> None:
        """Remove a checkpoint's directories on every worker (each sees its own node's); ``also``: other directories
        to discard in the same call. ``failed``: the checkpoint failed, and its tasks still running remove what they
        write after (:func:`ftidask.backends.dask.fence.abandon`), in the same call."""
        dirs = self.dirs(ckpt_id, seq, {1, 2, 3, level}, max(nranks, len(self.cluster.last_workers()))) + (also or [])
        if failed and self._discards is not None:
            self.cluster.run(fence.abandon, self.dir_patterns(ckpt_id, seq))
        if self._discards is not None:
            self._discards.extend(dirs)
        elif failed:
            self.cluster.run(tasks.abandon_checkpoint, self.dir_patterns(ckpt_id, seq), dirs)
        else:
            self.cluster.run(tasks.discard_paths, dirs)  # renamed now, deleted in the background
        storage.discard(self.paths.level_dir(4, 0) / storage.ckpt_dirname(ckpt_id, seq), self.remover)

    def dir_patterns(self, ckpt_id: int, seq: int) -> list[str]:
        """Glob patterns of every directory a checkpoint may write, in any node directory and in the global one
        (a few strings, whatever the number of workers: every task of the checkpoint carries them)."""
        name = glob.escape(storage.ckpt_dirname(ckpt_id, seq))
        return [f"{glob.escape(str(self.paths.ckpt_dir))}/node*/{glob.escape(self.paths.exec_id)}/l[1-4]/{name}",
                f"{glob.escape(str(self.paths.level_dir(4, 0)))}/{name}"]

    def collect_early(self, sealing: str) -> None:
        """Right before a commit: start the workers' collection (:meth:`collect_garbage`) now, keeping the directories
        of every commit record and ``sealing`` (the one being committed), so that it runs while the commit record is
        written and the lineage cut; :meth:`collect_garbage` waits for it (:meth:`settle` when none follows). What
        the retirement then retires is not in it: discarded by a call of its own (in a loop, a retired checkpoint
        is usually read by the step's array, retired at the next checkpoint's write: no call)."""
        if self.started and self._early is None:
            # The records as numbering this checkpoint listed them: nothing committed or retired since.
            committed = sorted({r.dirname for r in self.state.take_numbered()} | {sealing})
            self._early = self.cluster.run_soon(tasks.collect_garbage, str(self.paths.ckpt_dir), self.paths.exec_id,
                                                committed, False, bool(self.config.enable_dcp))

    def settle(self) -> None:
        """Wait for the collection :meth:`collect_early` started, if still running (best effort): never left
        running when the commit's work ends, for a directory made after its list was taken is not in it."""
        early, self._early = self._early, None
        if early is not None:
            with contextlib.suppress(Exception):
                early.result()

    def collect_garbage(self, trash: bool = False) -> None:
        """Remove interrupted checkpoints' leftovers on every worker (and in the global directory); the trash too
        at the start (nothing of ours is being deleted yet) or with ``trash`` (every deletion waited for)."""
        remaining = self.take_remaining()  # as retire_older left them, right before
        discards, self._discards = self._discards or [], None
        committed = ({name for _seq, name in remaining} if remaining is not None and not trash
                     else {r.dirname for r in self.state.records()})
        first = trash or not self.started
        if not self.started:  # the tasks a dead client of the run left running write nothing of ours from now on
            self.cluster.take_over(str(self.paths.meta_dir / self.paths.exec_id))
        self.started = True
        if self._early is not None and not first:  # its list named more: what was retired since is discarded
            early, self._early = self._early, None
            early.result()
            if discards:
                self.cluster.run(tasks.discard_paths, discards)
        else:
            self.settle()
            self.cluster.run(tasks.discard_and_collect, discards, str(self.paths.ckpt_dir), self.paths.exec_id,
                             sorted(committed), first, bool(self.config.enable_dcp))
        glob_root = self.paths.level_dir(4, 0)
        if glob_root.is_dir() and self.paths.contains(glob_root):
            # The listing's file types, not a stat and a Path per entry: every kept L4 checkpoint is one.
            with os.scandir(glob_root) as it:
                doomed = [entry.path for entry in it if (entry.name.startswith("ckpt") and entry.name not in committed
                                                         and storage.entry_is_dir(entry)) or (
                    first and entry.name.startswith(storage.TRASH_PREFIX)) or (
                    first and not self.config.enable_dcp and entry.name == storage.SPARE_DIR)]
            for path in doomed:
                storage.remove_tree(Path(path))
        for root in (self.state.records_dir, self.state.root):  # torn commit records (killed client)
            if root.is_dir():
                for tmp in root.glob(".*.tmp-*"):
                    tmp.unlink(missing_ok=True)

    def remove_dead_runs(self, runs: list[str]) -> None:
        """The node directories of the dead runs ``runs`` that every worker sees (:mod:`ftidask.api.abandoned`)."""
        self.cluster.run(tasks.remove_run_dirs, str(self.paths.ckpt_dir), list(runs))

    def finish_removals(self) -> None:
        """finalize, before the run is marked finalized (then nothing ever looks at its directories again): every
        worker's deletions done, then what killed workers left removed: the trash a worker's deletion thread left
        half deleted, the directories a failed checkpoint's discard missed while its worker was restarting."""
        super().finish_removals()
        self.cluster.run(tasks.wait_removals)
        self.collect_garbage(trash=True)

    def remove_checkpoint(self, record: CommitRecord, fallback: bool = True) -> None:
        """Drop ``record``; with ``fallback``, a differential checkpoint's files become the spares (if this client
        knows them sound, see :meth:`~ftidask.backends.dask.dcp_levels.DaskSpares.keep`) and what recovery falls
        back to, written before its files move and its commit record goes (a kill at any point leaves it named by
        one of the two). Without (finalize: the spares are cleared next), its files stay where its commit record
        points until the record is gone: the newest one, moved first, left nothing to recover."""
        spares = self.spares.store

        def named(keeping: bool) -> None:  # before any file is renamed (see DaskSpares.keep)
            if fallback and self.config.enable_dcp:
                self.state.note_retired(record, keeping)

        if spares is None or not fallback:
            if spares is not None:  # its ranks' spare directories are cleared next, those of more workers too
                spares.nranks = max(spares.nranks, record.nranks)
            named(False)
        else:
            spares.keep(record, named)  # its files become the spares to patch next
        self.state.delete_record(record.seq)
        self.remove_dirs(record.ckpt_id, record.seq, record.level, record.nranks)
