"""The checkpoint protocol of one rank: plan, write, redundancy, the commit record last, then retire.

:class:`Committer` is owned by :class:`ftidask.Context` (``checkpoint``, iCP and ``finalize`` run
through it). Every step is collective: a local error on any rank fails the checkpoint on every rank
with the same :class:`CheckpointError`, and the previous checkpoint stays.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..ftiff.layout import Layout, plan_layout
from ..model.arrays import check_ckpt_id
from ..model.errors import CheckpointError, FTIError, UnkeepableCheckpoint
from ..model.level import Level
from ..storage import files as storage
from ..transport.collective import agree, attempt, gather_tagged, on_root
from .checkpointing import CheckpointInfo
from .pending import OneShotWriter, PendingCheckpoint, RankFileWriter, RankWriter
from .recovering import Progress
from .recovery import check_file
from .retention import Retention, in_l4, rank_path
from .run import Run, RunPart
from .runstate import CommitRecord, FileRecord
from .variables import Protected, declarations_problem, declared, encode_states, undeclared_problem, var_extras
from .writing import Writer

log = logging.getLogger("ftidask")


def _extras_of(variables: Mapping[int, Protected], var_id: int) -> dict[str, Any]:
    """Variable ``var_id``'s VarInfo.extra as it is protected now ({} for a plain array, or one not protected)."""
    p = variables.get(var_id)
    return {} if p is None else var_extras({var_id: p}).get(var_id, {})


class Committer(RunPart):
    """Checkpoints of one rank, from plan to commit.

    :meth:`checkpoint` runs a whole one; iCP runs :meth:`begin`, writes variables as the application
    adds them, then :meth:`finish`. It holds no reference back to the context. An asynchronous
    checkpoint runs :meth:`checkpoint` on a committer of its own (the snapshot's variables, the
    background transport) on the context's background thread.
    """

    def __init__(self, run: Run, variables: dict[int, Protected], progress: Progress, writer: Writer,
                 retention: Retention) -> None:
        super().__init__(run)
        self.variables = variables
        self.progress = progress
        self.writer = writer
        self.retention = retention

    def checkpoint(self, id: int, level: Level, sources: Mapping[int, Any] | None = None, *,
                   state_error: str = "") -> CheckpointInfo:
        """Write every protected variable as checkpoint ``id`` at ``level``, commit it, retire what it
        makes obsolete (collective). ``sources``: byte sources to read some variables through (a
        copy-on-write snapshot's) instead of their arrays; ``state_error``: why a Python state could
        not be encoded at the call (the checkpoint then fails on every rank)."""
        pending = self.begin(id, level)
        pending.error = pending.error or state_error
        try:
            if not pending.error:  # one local step for them all (one per variable cost 3 us each): the first
                given = sources or {}  # failure stops it, and the commit reports it on every rank
                each = ((vid, p.name, p.array, given.get(vid)) for vid, p in self.variables.items())
                _r, pending.error = attempt(self.transport.rank, functools.partial(pending.write_vars, each))
        except BaseException:  # interrupted: no file left open, nothing committed
            pending.abort()
            raise
        return self.finish(pending)

    def finish(self, pending: PendingCheckpoint) -> CheckpointInfo:
        """Finish every rank's file, add the level's redundancy, write the commit record (see
        :meth:`commit`), then retire what it makes obsolete and announce it."""
        info, record = self.commit(pending)
        self.retire_after(record, pending.level)
        self.announce(pending, record, info)
        return info

    def seal(self, record: CommitRecord, failed: str, discard: Callable[[], None]) -> None:
        """The commit point, for every backend: write ``record`` last, once every rank's file and the
        level's redundancy are done (collective: rank 0, or the Dask client, writes it). When it cannot
        be written, ``discard`` removes what the checkpoint left and the same :class:`CheckpointError`
        (``failed: why``) is raised on every rank: the previous checkpoint stays the newest."""
        try:
            on_root(self.transport, functools.partial(self.state.write_record, record), CheckpointError, failed)
        except CheckpointError:
            discard()
            raise

    def retire_after(self, record: CommitRecord, shown_level: int) -> None:
        """After ``record`` is committed: retire what it makes obsolete and collect interrupted checkpoints'
        leftovers (collective, for every backend). A failure here leaves the new checkpoint committed."""
        try:  # collective: their errors are agreed too (the same FTIError on every rank)
            self.retention.retire_older(record)
            self.retention.collect_garbage()
        except FTIError as exc:
            raise CheckpointError(f"checkpoint {record.ckpt_id} (level {shown_level}) is committed and "
                                  f"recoverable, but cleaning up after it failed: {exc}") from exc

    def begin(self, id: int, level: Level, incremental: bool = False) -> PendingCheckpoint:
        """Plan checkpoint ``id`` and open its file (shared by checkpoint and iCP; collective)."""
        ckpt_id = check_ckpt_id(id)
        self.retention.schedule.began()  # whatever becomes of it: the collection after the next commit sees it
        t = self.transport
        t.wait_post()  # a head still post-processing the previous checkpoint must finish first (as FTI)
        post_level = level.base
        level = Level(t.write_level(level.base, level.differential), level.differential)  # L1: a head raises it
        # before the layout: a state's size changes with its value (and a device array's mirror is filled)
        state_error = encode_states(self.variables, t.rank, bool(self.config.enable_dcp))

        def plan() -> tuple[Layout, int | None]:
            if incremental and not level.differential and (self.writer.codecs() or (
                    level.base == 4 and self.config.l4_format == "zarr")):
                raise CheckpointError("incremental checkpoints are written uncompressed as FTI-FF files: set "
                                      "compressor = none (and l4_format = ftiff for level 4), or use levels 5-8")
            return (plan_layout(self.progress.layout, [(vid, p.array.nbytes) for vid, p in self.variables.items()]),
                    self.state.next_seq() if t.rank == 0 else None, declared(self.variables))

        (layout, seq, mine), error = attempt(t.rank, plan, (None, None, {}))
        cannot = f"checkpoint {ckpt_id} cannot start; the previous checkpoint is kept"
        agreed = agree(t, error, CheckpointError, cannot, [seq, mine])
        seq = agreed[0][0]  # rank 0's sequence number, or the same error on every rank
        if problem := declarations_problem([decl for _seq, decl in agreed]):  # the same verdict on every rank
            raise CheckpointError(f"{cannot}: {problem}")
        if any(decl for _seq, decl in agreed):  # a rank protecting a declared id undeclared: one more step, only then
            agree(t, undeclared_problem(self.variables, [decl for _seq, decl in agreed], t.rank), CheckpointError,
                  cannot)
        base_level = level.base
        directory = self.paths.level_dir(base_level, t.node) / storage.ckpt_dirname(ckpt_id, seq)
        path = directory / storage.rank_file(ckpt_id, t.rank)

        def open_writer() -> RankWriter:
            if level.differential:
                return self.spares.get().begin(base_level, layout)
            if incremental:
                return RankFileWriter(path, layout, self.writer.hash_id, self.writer.hash_pool())
            # every variable at once, at commit: compression, Zarr L4 and progress bars apply
            zarr = base_level == 4 and self.config.l4_format == "zarr"
            return OneShotWriter(functools.partial(self.writer.write_full, ckpt_id, base_level, path, layout,
                                                   durable=not sync_at_commit),
                                 {"l4_format": "zarr"} if zarr else None)

        # L2/L3: the rank file is made durable after the partner copy or parity is written, not before: the
        # exchange then runs while the disk still writes the rank file, and the fsync waits for both at once.
        sync_at_commit = base_level in (2, 3) and not level.differential and not incremental
        writer, error = attempt(t.rank, open_writer)  # an error is reported, on every rank, at the commit
        return PendingCheckpoint(ckpt_id, level.number, seq, layout, directory, path,
                                 {vid: p.array.nbytes for vid, p in self.variables.items()}, writer,
                                 error=state_error or error, post_level=post_level, extras=var_extras(self.variables),
                                 sync_at_commit=sync_at_commit,
                                 extras_now=functools.partial(_extras_of, self.variables) if incremental else None)

    def commit(self, pending: PendingCheckpoint) -> tuple[CheckpointInfo, CommitRecord]:
        """Finish every rank's file, add the level's redundancy, write the commit record; what was committed.

        Each local step runs through :func:`~ftidask.transport.collective.attempt` and the ranks agree after
        it: an exception on any rank (an OS error, MemoryError, anything) fails the checkpoint on
        every rank with the same :class:`CheckpointError`, and the previous checkpoint stays.
        """
        t = self.transport
        ckpt_id, level, seq = pending.ckpt_id, pending.base_level, pending.seq
        failed = f"checkpoint {ckpt_id} at level {pending.level} failed; the previous checkpoint is kept"
        written = None
        try:
            sizes = gather_tagged(t, failed, pending.layout.fs, CheckpointError)  # (never another call's message)

            def finish() -> tuple[Any, dict[str, Any]]:
                done = pending.finish(
                    {"format": "ftidask", "exec_id": self.paths.exec_id, "ckpt_id": ckpt_id, "level": level,
                     "seq": seq, "rank": t.rank, "nranks": t.size, "node": t.node,
                     "backend": t.name, "time": time.time()},
                    pt_fs=self.partner_fs(sizes), max_fs=max(sizes[r] for r in t.group_of()))
                return done, FileRecord(t.rank, t.node, done.file_size, done.fb.hash.hex()).to_json()

            entry, error = None, pending.error
            if not error:
                (written, entry), error = attempt(t.rank, finish, (None, None))
            # Every file is complete before the level's collectives: none of them runs for a failed checkpoint.
            files = agree(t, error, CheckpointError, failed, entry)

            def protect() -> None:  # collective for L2/L3: the level keeps the ranks in step, reports at its end
                if pending.differential:
                    stats = pending.stats
                    try:
                        t.protect_files_delta(level, ckpt_id, pending.path, pending.directory,
                                              None if stats is None else stats.delta,
                                              xor=None if stats is None else stats.xor)
                    finally:  # the parity is patched (or not): the delta's scratch file goes now
                        if stats is not None and stats.xor is not None:
                            stats.xor.close()
                else:
                    t.protect_files(level, ckpt_id, pending.path, pending.directory)

            agree(t, attempt(t.rank, protect)[1], CheckpointError, failed)
            if pending.sync_at_commit:  # before the commit record names the file
                synced = attempt(t.rank, functools.partial(storage.make_durable, pending.path))[1]
                agree(t, synced, CheckpointError, failed)
        except CheckpointError:  # agreed: the same on every rank
            self.drop(pending, finished=written is not None)
            raise
        except BaseException:  # interrupted (Ctrl-C in a notebook) before the commit record: as a failure, no file
            self.drop(pending, finished=False)  # left open (a dCP spare's descriptor), nothing named by a record
            raise
        extra = dict(pending.record_extra)
        if t.size > 1:  # the L2/L3 groups (a head may raise an L1 checkpoint later): a restart on another number of
            extra["group_size"] = self.config.group_size  # ranks, with another group_size, rebuilds on these
        if t.hosts:  # hosts and placement: a restart on these hosts in another order puts each process back
            extra["hosts"] = {k: list(v) for k, v in t.hosts.items()}
        record = CommitRecord(seq, ckpt_id, level, time.time(), t.size, tuple(FileRecord(**f) for f in files), extra)
        self.seal(record, failed, functools.partial(self.drop, pending, finished=True))
        assert written is not None  # every rank succeeded
        self.progress.committed(ckpt_id, pending.layout)
        stats = pending.stats
        info = CheckpointInfo(ckpt_id, pending.level, seq, written.data_bytes,
                              written.file_size if stats is None else stats.file_bytes,
                              time.perf_counter() - pending.started,
                              None if stats is None else stats.blocks_changed,
                              None if stats is None else stats.blocks_total,
                              None if stats is None else stats.blocks_hashed)
        self.progress.last_checkpoint = info
        return info, record

    def announce(self, pending: PendingCheckpoint, record: CommitRecord, info: CheckpointInfo) -> None:
        """After the commit and the retirement: the head's post-processing (L2-L4 with heads), the log line."""
        self.transport.post_process(record, pending.post_level or record.level, self.paths.exec_id)
        log.info("checkpoint %d (level %d) written: %d bytes in %.3f s", record.ckpt_id, pending.level,
                 info.bytes_written, info.seconds)

    def drop(self, pending: PendingCheckpoint, finished: bool) -> None:
        """After a failed checkpoint: remove its files (and its record, had rank 0 written it before
        failing). Local and best effort: every rank raises the agreed error after it."""
        def drop() -> None:
            stats = pending.stats
            if stats is not None and stats.xor is not None:  # its scratch file (never handed to the level) goes
                stats.xor.close()  # now, not when the failed checkpoint's frames do (a notebook keeps the last)
            if not finished:
                pending.abort()
            storage.remove_tree(pending.directory)
            dcp = self.spares.store
            if dcp is not None:
                dcp.discard(pending.base_level, pending.seq)
            if self.transport.rank == 0:
                self.state.delete_record(pending.seq)

        _r, error = attempt(self.transport.rank, drop)
        if error:
            log.warning("cleaning up after the failed checkpoint %d: %s", pending.ckpt_id, error)

    def partner_fs(self, sizes: list[int]) -> int:
        """FTI's ``ptFs`` from every rank's file size (``sizes``, by rank): this rank's L2 partner's."""
        # FTI's ptFs: the size of the partner file this rank keeps (its left partner's).
        return sizes[self.transport.partner_of()]

    def flush_to_l4(self, record: CommitRecord, own: Path) -> None:
        """keep_last_ckpt: copy ``record`` (this rank's file ``own``) to L4 and commit the copy (collective); a
        committed L4 checkpoint is only verified where it is. A :class:`CheckpointError` if it does not verify.

        A checkpoint of another layout (the run restarted on another number of ranks, or its ranks on other nodes,
        and finalized before writing one of its own) is flushed whole, as its record places its files: old rank f's
        file by this run's rank ``f % size``, from f's node (visible with ``local_test``, or shared node
        directories; otherwise missing, as a lost file). Before, each rank copied its own rank's file from its own
        node: one placed elsewhere was missing (finalize failed), and the old ranks past this run's were never
        copied."""
        t = self.transport
        failed = "keep_last_ckpt: flushing the last checkpoint to L4 failed"
        mine = [(f, own if (f.rank, f.node) == (t.rank, t.node) else rank_path(self.paths, record, f.node, f.rank))
                for f in record.files if f.rank % t.size == t.rank]
        if in_l4(record):
            def verify() -> None:
                for f, path in mine:
                    verdict = check_file(path, record, f.rank)
                    if verdict.kind != "ok":
                        raise CheckpointError(verdict.message)

            agree(t, attempt(t.rank, verify)[1], UnkeepableCheckpoint, f"keep_last_ckpt: checkpoint "
                  f"{record.ckpt_id} (level 4) cannot be kept")
            return
        # Its files verified first, agreed apart: only a checkpoint of its own damage is passed over (a full global
        # directory is the flush's failure, raised: the newest stays, recoverable where it is)
        verdicts = {}

        def verify_all() -> None:
            for f, path in mine:
                verdict = verdicts[f.rank] = check_file(path, record, f.rank)
                if verdict.kind != "ok":
                    raise CheckpointError(verdict.message)

        agree(t, attempt(t.rank, verify_all)[1], UnkeepableCheckpoint, f"keep_last_ckpt: checkpoint {record.ckpt_id} "
              f"(level {record.level}) cannot be kept")
        seq = on_root(t, self.state.next_seq, CheckpointError, failed)
        as_zarr = self.config.l4_format == "zarr"

        def flush() -> list[dict[str, Any]]:
            out = []
            for f, path in mine:
                verdict = verdicts[f.rank]
                dst = self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq)
                if as_zarr:
                    from . import zarr_l4

                    written = zarr_l4.flush_file(verdict.parsed, dst / zarr_l4.store_name(record.ckpt_id, f.rank), seq)
                    out.append(FileRecord(f.rank, f.node, written.file_size, written.fb.hash.hex()).to_json())
                else:
                    storage.copy_file_atomic(path, dst / storage.rank_file(record.ckpt_id, f.rank))
            return out

        entries, error = attempt(t.rank, flush, [])
        copy_dir = self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq)
        try:
            agreed = agree(t, error, CheckpointError, failed, entries)
        except CheckpointError:  # the copies some ranks made: no record names them
            storage.remove_tree(copy_dir)
            raise
        files = sorted((e for each in agreed for e in each), key=lambda e: e["rank"])
        zarr_files = {"files": tuple(FileRecord(**f) for f in files), "extra": {"l4_format": "zarr"}} if as_zarr else {}
        flushed = record.committed_copy(seq=seq, level=4, timestamp=time.time(), **zarr_files)
        # If it cannot be committed, the last checkpoint stays where it is, committed; the copy goes.
        self.seal(flushed, failed, functools.partial(storage.remove_tree, copy_dir))
