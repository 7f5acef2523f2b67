"""Which checkpoints a run keeps: retirement after a commit, garbage of interrupted checkpoints.

The rule is a pure function (:func:`to_retire`), used by every path that commits (the ranks, the
MPI heads, the Dask client); :class:`Retention` carries it out for :class:`ftidask.Context`, which
owns one (the Dask backend, whose files live on the workers, owns a subclass).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..model.errors import CheckpointError, FTIError, UnkeepableCheckpoint
from ..storage import files as storage
from ..storage.files import RunPaths
from ..storage.swap import link_tree_atomic
from ..transport.collective import agree, attempt, everywhere, on_root
from .collecting import CollectSchedule, collection_roots, small
from .dcpstore import spare_hint_path
from .run import Run, RunPart
from .runstate import CommitRecord, FileRecord

log = logging.getLogger("ftidask")


def rank_path(paths: RunPaths, record: CommitRecord, node: int, rank: int) -> Path:
    """Rank ``rank``'s file of ``record`` on node ``node`` (a Zarr store for a Zarr L4 checkpoint; the
    spare for the fallback of a level, see :meth:`~ftidask.engine.runstate.RunState.write_fallback`)."""
    if record.fallback:
        return paths.level_dir(record.level, node) / storage.SPARE_DIR / storage.spare_file(rank)
    path = paths.level_dir(record.level, node) / record.dirname / storage.rank_file(record.ckpt_id, rank)
    return path.with_suffix(".zarr") if record.extra.get("l4_format") == "zarr" else path


def in_l4(record: CommitRecord) -> bool:
    """Whether ``record`` is a committed level-4 checkpoint (keep_last_ckpt keeps it where it is)."""
    return record.level == 4 and not record.fallback


def to_retire(records: Iterable[CommitRecord | None], new: CommitRecord, keep_l4: bool) -> list[CommitRecord]:
    """The checkpoints that committing ``new`` makes obsolete, oldest first (FTI's rule).

    A level-L checkpoint retires every earlier one of levels 1..L: it survives all that they survive.
    Higher levels stay (an L4 checkpoint outlives newer L1 ones), and so do L4 checkpoints when
    ``keep_l4`` (``keep_l4_ckpt = 1``). ``None`` entries (unreadable records) are skipped.
    """
    return sorted((old for old in records if old is not None and old.seq < new.seq and old.level <= new.level
                   and not (old.level == 4 and keep_l4)), key=lambda r: r.seq)


def move_to_spares(paths: RunPaths, record: CommitRecord, files: Iterable[FileRecord], drop_hints: bool = False,
                   who: str = "") -> None:
    """Move ``files`` of ``record``, a retired differential checkpoint, to their level's spares, where its fallback
    record points (:func:`rank_path` of ``record.as_fallback()``), each from the node ``record`` places it on.

    Best effort, as :meth:`~ftidask.engine.dcpstore.DcpStore.retire`: a file that is gone (a lost node) or cannot be
    moved leaves a spare that fails the fallback's FB hash check, passed over by a recovery. ``drop_hints``: remove
    the spare's hint first (:func:`~ftidask.engine.dcpstore.spare_hint_path`); ``who`` prefixes the log line."""
    for f in files:
        spare = rank_path(paths, record.as_fallback(), f.node, f.rank)
        try:
            storage.makedirs(spare.parent)
            if drop_hints:
                spare_hint_path(spare).unlink(missing_ok=True)
            os.replace(rank_path(paths, record, f.node, f.rank), spare)
        except OSError as exc:
            log.debug("%scheckpoint %d of rank %d not kept as its spare: %s", who, record.ckpt_id, f.rank, exc)


class Retention(RunPart):
    """Deleting what is no longer needed, never what recovery may still use.

    Collective: a local error on any rank is raised as the same :class:`FTIError` on every rank
    (:mod:`ftidask.transport.collective`). ``spares`` holds the rank's differential-checkpoint
    store once the writer has made one.
    """

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.trash_pool: ThreadPoolExecutor | None = None
        self._nodes: list[int] | None = None  # each rank's node (see _movers)
        # Committed directories looked into once after a newer commit (after any post-processing of theirs by a
        # head, which ends before the next checkpoint begins): nothing of this process writes there any more.
        self._settled: set[str] = set()
        # (seq, dirname) of the checkpoints still committed once retire_older is done, sorted: for the collection
        # that follows at once, so that the records are listed once for both (a run with keep_l4_ckpt keeps
        # thousands). Every backend's retirement hands them over so (hand_over), every collection takes them.
        self._remaining: list[tuple[int, str]] | None = None
        self._gone: list[int] | None = None  # see _gone_nodes: an earlier start's, found once (none appears since)
        self.schedule = CollectSchedule(bool(self.config.head))  # the committer counts its checkpoints begun

    def retire_older(self, record: CommitRecord) -> None:
        """After a level-L commit, drop earlier checkpoints of levels 1..L (L4 archived if asked)."""
        t = self.transport
        keep_l4 = bool(self.config.keep_l4_ckpt)

        def plan() -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
            records = self.state.records()
            retired = to_retire(records, record, keep_l4)
            gone = {r.seq for r in retired}
            return [r.to_json() for r in retired], [(r.seq, r.dirname) for r in records if r.seq not in gone]

        self.take_remaining()  # none from an earlier retirement: its collection failed before it took them
        # Only those retired cross to the ranks as records (see _remaining).
        older, remaining = on_root(t, plan, FTIError, "cannot read the run's commit records")
        for old in older:
            self.remove_checkpoint(CommitRecord.from_json(old))
        self.hand_over(remaining)
        self.schedule.retired(record.level)

    def hand_over(self, remaining: list[tuple[int, str]]) -> None:
        """After a retirement: ``remaining``, the (seq, dirname) still committed, sorted, for the collection next."""
        self._remaining = remaining

    def take_remaining(self) -> list[tuple[int, str]] | None:
        """What the retirement right before handed over (once); None when none did (then the collection lists)."""
        remaining, self._remaining = self._remaining, None
        return remaining

    def collect_garbage(self) -> None:
        """Remove what interrupted checkpoints left: directories no commit record names, temporary files; only where
        the checkpoint just committed wrote when nothing else can have left any (:mod:`ftidask.engine.collecting`)."""
        t = self.transport
        light = self.schedule.light_level()
        if t.size > 1:  # rank 0's answer: the ranks never differ in their collectives
            light = t.bcast(light)
        newest = self.take_remaining()
        if newest is None:
            newest = on_root(t, lambda: sorted((r.seq, r.dirname) for r in self.state.records()), FTIError,
                             "garbage collection: cannot read the run's commit records")
        committed = {name for _seq, name in newest}
        settled = self._settled & committed
        if t.rank == 0 and light is None and self._gone is None:
            self._gone = self._gone_nodes()
        roots = collection_roots(self.paths, self.state, t.rank, t.node, light, self._gone or [])

        def collect() -> None:
            for root in roots:  # trash too, unless our own remover is on it
                if self.paths.contains(root):  # never outside the run's directories, whatever its exec_id
                    storage.collect_level_garbage(root, committed, trash=self.trash_pool is None,
                                                  spares=bool(self.config.enable_dcp), settled=settled)

        everywhere(t, collect, FTIError, "garbage collection failed")
        # Light too: every directory made since the last full collection is a checkpoint of this process that
        # succeeded (anything else makes the next one full), clean in every level directory once written.
        self._settled = committed - {name for _seq, name in newest[-1:]}  # the newest is looked into once more
        self.schedule.collected(light is not None)

    def remove_dead_runs(self, runs: list[str]) -> None:
        """This node's directories of the dead runs ``runs``, which never committed a checkpoint (local; see
        :mod:`ftidask.api.abandoned`)."""
        for run in runs:
            node_dir = RunPaths(self.paths.ckpt_dir, self.paths.glbl_dir, self.paths.meta_dir, run).node_dir(
                self.transport.node)
            if self.paths.contains(node_dir):
                storage.remove_tree(node_dir)

    def _gone_nodes(self) -> list[int]:
        """The nodes, visible here, that hold a directory of this run and that no rank of this run has."""
        p, nodes = self.paths, []
        for node_dir in p.ckpt_dir.glob(f"node*/{p.exec_id}"):
            name = node_dir.parent.name[len("node"):]
            if name.isdigit() and int(name) >= self.transport.nnodes and node_dir == p.node_dir(int(name)):
                nodes.append(int(name))
        return sorted(nodes)

    def remove_checkpoint(self, record: CommitRecord, fallback: bool = True) -> None:
        """Drop ``record`` (collective); with ``fallback``, a differential checkpoint's files become the spares and
        what recovery falls back to (written before its files move and its commit record goes: a kill at any point
        leaves it named by one of the two). Without (finalize: the spares are cleared next), its files stay where
        its commit record points until the record is gone: the newest one, moved first, left nothing to recover."""
        t = self.transport
        failed = f"removing checkpoint {record.ckpt_id} (level {record.level}) failed"
        t.barrier()
        dcp = self.spares.store
        movers: dict[int, int] | None = None  # written on another layout: old rank -> the rank that keeps its file
        if self.config.enable_dcp and fallback:  # until the spares are patched, recovery may fall back to them
            # Named before its file is renamed to the spare: killed between the two, the checkpoint was named by its
            # commit record only, which points at its directory, and a damaged newest one left nothing to recover
            # while it was whole in the spare. Until the rename, the fallback record names a spare that still holds
            # an older file (it fails the FB hash check, passed over) and the commit record its own file.
            keeping = dcp is not None and dcp.keeps(record.level, record.seq)
            movers = self._movers(record)
            if movers is not None and not t.bcast(keeping):  # not recovered here (damaged, passed over): its files
                movers = None  # are not kept, and the older fallback (the checkpoint before it) stays
            on_root(t, lambda: self.state.note_retired(record, keeping), FTIError, failed)
        error = ""
        if movers is not None:  # each rank moves the files its commit record places on this rank's node
            _kept, error = attempt(t.rank, lambda: self._keep_elsewhere(record, movers))
            if dcp is not None:
                dcp.retired_elsewhere(record.level, record.seq)
        elif dcp is not None and fallback:  # its file becomes the spare that the next dCP checkpoint patches
            own = rank_path(self.paths, record, t.node, t.rank)
            _kept, error = attempt(t.rank, lambda: dcp.retire(record.level, record.seq, own, record.ckpt_id), False)
        if self.config.enable_dcp:
            # every rank has moved its file out of the shared directories before any is removed
            agree(t, error, FTIError, failed)
        on_root(t, lambda: self.state.delete_record(record.seq), FTIError, failed)
        # The global L4 directory (level_dir(4, *)) is rank 0's, after every rank has moved its own file out of it.
        local_levels = {record.level, 1, 2, 3} - {4}
        doomed = [self.paths.level_dir(level, t.node) / record.dirname for level in local_levels]
        l4_dir = self.paths.level_dir(4, 0)
        own_l4 = None
        if record.level == 4 and not record.fallback and t.rank != 0:
            # Each rank deletes its own file of the global directory, as FTI's ranks do: rank 0 deleting every
            # rank's (a GiB each) is a serial tail on one rank, under the next checkpoint, and on a parallel file
            # system one client's metadata operations for the whole job. Moved to the level's own trash: rank 0
            # renames the checkpoint's directory away below.
            own_l4 = rank_path(self.paths, record, 0, t.rank)
        if t.rank == 0:
            # Written on more nodes than this run has (a restart on fewer ranks, or more ranks per node): no rank
            # of this run is on those nodes, so rank 0 removes what it sees of them (local_test, shared node dirs).
            doomed += [self.paths.level_dir(level, node) / record.dirname for node in sorted(
                {f.node for f in record.files if f.node >= t.nnodes}) for level in local_levels]

        now = small(record)

        def remove() -> None:
            for path in doomed:
                if self.paths.contains(path):  # never outside the run's directories, whatever its exec_id
                    storage.discard(path, self.remover, now=now)
            if own_l4 is not None and self.paths.contains(own_l4):
                storage.discard(own_l4, self.remover, into=l4_dir, now=now)

        _r, removing = attempt(t.rank, remove)
        agree(t, error or removing, FTIError, failed)  # every rank's L4 file moved out before its directory goes

        def remove_l4_dir() -> None:
            if self.paths.contains(l4_dir / record.dirname):
                storage.discard(l4_dir / record.dirname, self.remover, now=now)

        on_root(t, remove_l4_dir, FTIError, failed)

    def _movers(self, record: CommitRecord) -> dict[int, int] | None:
        """For a differential ``record`` written on another layout (a restart on another number of ranks, or on other
        nodes): which rank of this run moves each old rank's file to the spares, one on the node the record places
        it (rank 0 for a node this run does not have). None otherwise: each rank retires its own file. Collective
        (the nodes of the ranks are gathered once). The caller keeps it only if this run recovered it (redistributed,
        verified: :meth:`~ftidask.engine.dcpstore.DcpStore.redistributed`)."""
        if self._nodes is None:
            self._nodes = [int(n) for n in self.transport.allgather(self.transport.node)]
        nodes = self._nodes
        if not record.extra.get("dcp") or (record.nranks == len(nodes) and all(
                f.rank < len(nodes) and nodes[f.rank] == f.node for f in record.files)):
            return None
        first = {n: r for r, n in reversed(list(enumerate(nodes)))}  # node -> its lowest rank
        return {f.rank: first.get(f.node, 0) for f in record.files}

    def _keep_elsewhere(self, record: CommitRecord, movers: dict[int, int]) -> None:
        """Move the files of ``record`` (written on another layout) that ``movers`` gives this rank to their level's
        spares (:func:`move_to_spares`), as the heads do. No hint is written, and a stale one is dropped: no rank
        patches such a spare from its own block hashes (it holds no file of this run's layout)."""
        mine = [f for f in record.files if movers[f.rank] == self.transport.rank]
        move_to_spares(self.paths, record, mine, drop_hints=True)

    def drop_local_copies(self, record: CommitRecord) -> None:
        """Remove the node-local directories of ``record``, a level-4 checkpoint that outlives the run (collective):
        the level-1 files of a head killed after it raised the checkpoint to L4, before it removed them, which the
        commit record named until now (nothing stays on the nodes: their directories are scratch)."""
        t = self.transport
        nodes = {t.node} | ({f.node for f in record.files if f.node >= t.nnodes} if t.rank == 0 else set())
        doomed = [self.paths.local_dir(level, node) / record.dirname for node in sorted(nodes) for level in (1, 2, 3)]

        def remove() -> None:
            for path in doomed:
                if self.paths.contains(path):
                    storage.discard(path, self.remover)

        everywhere(t, remove, FTIError, f"removing the node-local files of checkpoint {record.ckpt_id} failed")

    def archive_checkpoint(self, record: CommitRecord) -> None:
        """``keep_l4_ckpt`` at finalize: move a level-4 checkpoint to ``{glbl_dir}/{exec_id}/l4_archive`` (FTI's
        archive, which outlives the run) and drop its commit record, so that no later restart of this run
        recovers from it by itself (``recover_file`` reads an archived file)."""
        src = self.paths.level_dir(4, 0) / record.dirname
        dst = self.paths.l4_archive / record.dirname

        def archive() -> None:
            # Linked into the archive first, removed from l4 only once its record is gone: killed in between, the
            # record still names a whole checkpoint (moved, the newest one was gone and a restart recovered nothing).
            if src.exists() and self.paths.contains(dst):
                link_tree_atomic(src, dst)
            self.state.delete_record(record.seq)
            if self.paths.contains(src):
                storage.discard(src, self.remover)

        on_root(self.transport, archive, FTIError,
                f"archiving checkpoint {record.ckpt_id} (level 4) to {self.paths.l4_archive} failed")

    def remover(self) -> ThreadPoolExecutor:
        """The thread that deletes retired checkpoints off the critical path (they are no longer committed)."""
        if self.trash_pool is None:
            self.trash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-remove")
        return self.trash_pool

    def end_run(self, records: list[CommitRecord], flush_to_l4: Callable[[CommitRecord], None]) -> None:
        """FTI_Finalize's clean-up (collective): with ``keep_last_ckpt``, keep one of ``records`` (newest first), else
        remove them all (``keep_l4_ckpt``: level-4 ones go to the archive); clear the differential checkpoints'
        spares, wait for the deletions; mark the run finalized, last.

        The one kept: when the newest is a committed L4 checkpoint and no fallback is among ``records``, that one,
        where it is and NOT read (deliberate: no older one would be kept in its place, older L4 ones go to the archive
        with keep_l4_ckpt, and checking it would read every L4 byte; the next recovery verifies every file it uses).
        Otherwise the newest that ``flush_to_l4`` flushes (:meth:`_flush_newest`)."""
        t, failed = self.transport, "finalize failed"
        keep = bool(self.config.keep_last_ckpt and records)
        doomed = committed = [r for r in records if not r.fallback]  # the spares are cleared below
        if keep and in_l4(records[0]) and not any(r.fallback for r in records):
            doomed = committed[1:]  # nothing older to fall back to: kept as it is, unread (see above)
        elif keep:
            # The newest may be a damaged one that a restart passed over for the previous differential
            # checkpoint, at L4 too: the one kept is the newest that verifies (a committed L4 one stays where
            # it is). Any other's L4 copy is the one kept: as in FTI, nothing stays on the nodes (their
            # directories are scratch), and a restart that finds the global copy gone fails instead of
            # reading a local leftover.
            kept = self._flush_newest(records, flush_to_l4)
            doomed = [r for r in committed if r is not kept or not in_l4(r)]
        # The sequence numbers used so far, before any record goes: a run started again (fresh, or after a kill
        # below) must not take the names of this one's directories (l4_archive keeps them).
        used = on_root(t, self.state.mark_seq, FTIError, failed)
        on_root(t, self.state.delete_fallbacks, FTIError, failed)  # first: none outlives the run (a kill from
        # here on must not leave one beside no commit record: a fresh run of this exec_id would recover it)
        # The level-4 ones that stay (archived, or the last one kept where it is) keep nothing on the nodes either.
        going = {id(r) for r in doomed}  # (not "in doomed": finalize was quadratic in the records kept)
        for record in committed:
            if in_l4(record) and (self.config.keep_l4_ckpt or id(record) not in going):
                self.drop_local_copies(record)
        # Oldest first: killed part-way, the run keeps its newest checkpoint (and a restart goes back no further).
        for record in reversed(doomed):
            if record.level == 4 and self.config.keep_l4_ckpt:
                self.archive_checkpoint(record)
            else:
                self.remove_checkpoint(record, fallback=False)
        dcp = self.spares.store  # every rank takes part, with a store or not
        everywhere(t, dcp.clear if dcp is not None else lambda: None, FTIError, failed)
        if self.config.enable_dcp:  # once every rank's store is cleared: nothing else writes a spare
            on_root(t, self._sweep_spares, FTIError, failed)
        # Marked last, once every rank's trash is deleted: killed before, the run (its records gone) is started afresh
        # under its name, whose start removes what is left; marked finalized, nothing would ever look there again.
        everywhere(t, self.finish_removals, FTIError, failed)
        on_root(t, lambda: self.state.write_run(state="finalized", keep_last=keep, seq=used), FTIError, failed)

    def _sweep_spares(self) -> None:
        """The spares no store of this execution cleared (a rank without a dCP checkpoint since a restart on another
        layout, or an old node no rank holds now): the run is over and no record falls back to them."""
        p = self.paths
        spare_dirs = [p.level_dir(4, 0) / storage.SPARE_DIR]
        for node_dir in p.ckpt_dir.glob(f"node*/{p.exec_id}"):
            spare_dirs += [node_dir / f"l{level}" / storage.SPARE_DIR for level in (1, 2, 3, 4)]
        for path in spare_dirs:
            if path.is_dir() and p.contains(path):  # what the node directories visible here hold
                storage.remove_tree(path)

    @staticmethod
    def _flush_newest(records: list[CommitRecord], flush_to_l4: Callable[[CommitRecord], None]) -> CommitRecord:
        """keep_last_ckpt: flush the newest of ``records`` that can be (collective; L2/L3 files rebuilt first), which
        is returned. One whose files are damaged or lost (:class:`UnkeepableCheckpoint`) is passed over, said in a
        warning; any other failure is raised at once. None can be: the newest's error."""
        first: CheckpointError | None = None
        for record in records:
            try:
                flush_to_l4(record)
            except UnkeepableCheckpoint as exc:  # only its own files: a full disk passed over the newest before
                first = first or exc
                continue
            if first is not None:
                log.warning("keep_last_ckpt: the newest checkpoint cannot be kept (%s); kept checkpoint %d (level %d), "
                            "the newest a restart can recover", first, record.ckpt_id, record.level)
            return record
        assert first is not None  # records is not empty
        raise first

    def prune_run_dirs(self) -> None:
        """After finalize: remove the empty directories this run leaves (level directories, node
        directories of the run), never a file and never anything outside the run's own directories."""
        p = self.paths
        for root in (*p.ckpt_dir.glob(f"node*/{p.exec_id}"), p.glbl_dir / p.exec_id, p.stage_root):
            storage.prune_empty_dirs(root)
        for sub in (p.run_meta.iterdir() if p.run_meta.is_dir() else ()):  # the run's state stays
            if sub.is_dir():
                storage.prune_empty_dirs(sub)

    def finish_removals(self) -> None:
        """finalize, before the run is marked finalized: wait for the deletions under way (a backend whose deletions
        run elsewhere waits for them there, and removes what its dead processes left)."""
        self.close()

    def close(self) -> None:
        """Wait for the deletions under way."""
        if self.trash_pool is not None:
            self.trash_pool.shutdown(wait=True)
        self.trash_pool = None


#: How a Context makes its Retention: ``(transport, paths, state, config, spares)`` (a backend may pass its own).
RetentionFactory = Callable[[Run], Retention]
