"""Recovery: the newest committed checkpoint that every rank can verify (or rebuild), then the arrays.

:class:`Recovery` is owned by :class:`ftidask.Context`: it fills the context's protected variables
and notes what it recovered in the :class:`Progress` that the context's commits update too. What a restart's
stored_size() and realloc() read is its base, :class:`~ftidask.engine.restart_sizes.RestartSizes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff.layout import Layout
from ..ftiff.reader import FtiffFile, identity_of, unchanged
from ..model.errors import CheckpointError, FTIError, NoCheckpointError, RecoveryError, says_disk_failure
from ..transport.collective import agree, agree_call, attempt, guarded, on_root
from . import pagemove, recoverplan, reshard
from .checkpointing import CheckpointInfo
from .dcpstore import distrust_spare, reclaim_retired
from .filerecovery import PreparedFile, prepare_file
from .pagemove import Stager, release_all
from .prefault import Prefault
from .recovery import Verdict, check_file, load_file, newest_recoverable
from .restart_sizes import RestartSizes
from .retention import rank_path
from .run import Run
from .runstate import CommitRecord
from .variables import Protected

log = logging.getLogger("ftidask")


@dataclasses.dataclass
class Progress:
    """Where a context's run stands: what the last commit or recovery left for the next checkpoint."""

    planned: Layout | None = None  # the containers of the last file written (the next plan's start): see layout
    # a file recovered last, whose containers are the next plan's start: made into a Layout only when one is planned
    # (a Slot per container, 20% of a recovery of thousands of small arrays, for a checkpoint that may never come)
    layout_file: Any = None  # an FtiffFile (or a Zarr L4 store): its layout()
    restart_file: FtiffFile | None = None  # the checkpoint to recover, parsed once (stored_size, realloc)
    restart_record: CommitRecord | None = None  # its record, while its file, verified, may be loaded as it is
    # restart_record is what a recover() without ckpt_id/level loads (found as it finds, or refused as the newest):
    # False when a refused recover(ckpt_id=...)/recover(level=...) set it, which only such a request may reuse
    restart_newest: bool = True
    # The newest checkpoint recovered last, and its file as verified: what recover_var() (a recovery of some ids)
    # loads again as it is while every rank's file is unchanged. Each one verified the whole file again: n variables
    # recovered one by one read n files' worth (10,000 of 1 KiB: 0.85 s a call). A full recover() verifies again.
    verified: tuple[CommitRecord, FtiffFile] | None = None
    recovered: bool = False
    recovered_all: bool = False  # a full recover() succeeded: FTI_Status is 0 after it (FTI_Exec.reco = 0)
    recovered_ids: set[int] = dataclasses.field(default_factory=set)  # the variables recovered (snapshot's rest)
    recovered_from: tuple[int, int] | None = None  # (ckpt_id, level)
    last_checkpoint: CheckpointInfo | None = None
    next_ckpt_id: int = 1  # snapshot's next id
    resharded: tuple[CommitRecord, str] | None = None  # what recover() redistributed, and how its layout differs

    @property
    def layout(self) -> Layout | None:
        """The containers of the last file written or recovered: the next checkpoint's plan starts from them."""
        if self.planned is None and self.layout_file is not None:
            self.planned, self.layout_file = self.layout_file.layout(), None
        return self.planned

    @layout.setter
    def layout(self, layout: Layout | None) -> None:
        self.planned, self.layout_file = layout, None

    def committed(self, ckpt_id: int, layout: Layout | None) -> None:
        """After checkpoint ``ckpt_id`` is committed with ``layout``."""
        self.layout = layout
        self.restart_file, self.restart_record, self.resharded, self.verified = None, None, None, None
        self.next_ckpt_id = max(self.next_ckpt_id, ckpt_id + 1)

    def plan_from(self, parsed: Any) -> None:
        """The next checkpoint plans its containers from those of ``parsed``, the file recovered (an FTI-FF file or a
        Zarr store: its ``layout()``, made into a :class:`Layout` only then)."""
        self.planned, self.layout_file = None, parsed

    def restored(self, ckpt_id: int, level: int, parsed: Any = None) -> None:
        """After checkpoint ``ckpt_id`` of ``level`` is recovered from ``parsed`` (:meth:`plan_from`; None: the
        next checkpoint plans afresh)."""
        self.plan_from(parsed)
        self.restart_file = None if parsed is None else self.restart_file
        self.restart_record = self.resharded = self.verified = None
        self.recovered = True
        self.recovered_from = (ckpt_id, level)
        self.next_ckpt_id = max(self.next_ckpt_id, ckpt_id + 1)


class _Passed(Exception):
    """A checkpoint to redistribute (its blocks moved) found damaged: for ``_recover_here`` to try the older ones."""

    def __init__(self, error: NoCheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


class Recovery(RestartSizes):
    """FTI_Recover for one context (FTI_GetStoredSize and FTI_Realloc: :class:`RestartSizes`)."""

    def __init__(self, run: Run, variables: dict[int, Protected], progress: Progress) -> None:
        super().__init__(run)
        self.variables = variables
        self.progress = progress

    def candidates(self, ckpt_id: int | None, level: int | None,
                   error: type[FTIError] = RecoveryError, fallbacks: bool = False) -> list[CommitRecord]:
        """The committed checkpoints (``fallbacks``: and the previous differential checkpoints kept as spares),
        newest first, read by rank 0 and sent to every rank in one message."""
        def read() -> list[Any]:
            return [r.to_json() for r in [*self.state.records(), *(self.state.fallbacks() if fallbacks else [])]]

        raw = on_root(self.transport, read, error, "cannot read the run's commit records")
        records = [r for r in (CommitRecord.from_json(x) for x in raw)
                   if r is not None and ckpt_id in (None, r.ckpt_id) and level in (None, r.level)]
        return sorted(records, key=lambda r: r.seq, reverse=True)

    def arrays(self, ids: list[int] | None) -> dict[int, np.ndarray]:
        """The protected arrays (not Python states) a recovery of ``ids`` (None: all) fills, by id."""
        return {vid: p.array for vid, p in self.variables.items() if p.state is None and (ids is None or vid in ids)}

    def rank_file(self, record: CommitRecord) -> Path:
        return rank_path(self.paths, record, self.transport.node, self.transport.rank)

    def repair(self, record: CommitRecord) -> None:
        """keep_last_ckpt's flush of an L2/L3 checkpoint: this rank's file lost or damaged is rebuilt from its group
        first, as a restart would (collective); a checkpoint of another layout is flushed as its record places it."""
        t = self.transport
        nodes = t.allgather(t.node)
        if record.fallback or record.level not in (2, 3) or reshard.layout_change(record, t.size, nodes):
            return
        path = self.rank_file(record)
        intact = self.check(record).kind in ("ok", "unreadable")
        _have, error = attempt(t.rank, lambda: t.rebuild_file(record.level, record.ckpt_id, path, path.parent, intact,
                                                              record=record), False)
        if error:
            log.warning("keep_last_ckpt: rebuilding checkpoint %d (level %d): %s", record.ckpt_id, record.level, error)
        # A disk that cannot take the rebuilt file (full, read-only) says nothing of the checkpoint: raised, not
        # passed over (its lost file then counted as damage, and finalize kept an older checkpoint in its place)
        agree(t, error if says_disk_failure(error) else "", CheckpointError, f"keep_last_ckpt: checkpoint "
              f"{record.ckpt_id} (level {record.level}) could not be rebuilt before its flush")

    def check(self, record: CommitRecord, stage: Stager | None = None) -> Verdict:
        """This rank's verdict on its file of ``record`` (an unexpected error is a damaged file, never raised)."""
        path, errors = self.rank_file(record), []
        if record.extra.get("dcp") and not record.fallback and not os.path.lexists(path):  # a retirement cut short
            mine = next((f for f in record.files if f.rank == self.transport.rank), None)
            spare = rank_path(self.paths, record.as_fallback(), self.transport.node, self.transport.rank)
            if mine is not None and reclaim_retired(spare, path, mine.fb_hash):
                log.warning("checkpoint %d (level %d): this rank's file was its level's spare already (a retirement "
                            "interrupted), put back", record.ckpt_id, record.level)
        verdict = guarded(errors, lambda: check_file(path, record, self.transport.rank, stage), None,
                          f"checking {path}")
        return verdict if verdict is not None else Verdict("damaged", "; ".join(errors))

    def find(self, ckpt_id: int | None = None, level: int | None = None, stage: Stager | None = None,
             records: list[CommitRecord] | None = None) -> tuple[CommitRecord, Verdict]:
        """The newest committed checkpoint that every rank can verify (or rebuild); among ``records`` if given.

        ``stage``: arrays to read into staged pages while verifying (:mod:`.pagemove`); the verdict
        returned holds them, the verdicts of checkpoints passed over release theirs.
        """
        t = self.transport
        nodes = t.allgather(t.node)

        def verify(record: CommitRecord) -> tuple[Verdict | None, str]:
            change = reshard.layout_change(record, t.size, nodes)
            if change:  # never rank r's old file into rank r blindly: recover() redistributes it, or says why not
                return None, f"{change}; {reshard.advice(record)}"
            verdict = self.check(record, stage)
            path = self.rank_file(record)
            ok = verdict.kind == "ok"
            intact = ok or verdict.kind == "unreadable"  # its bytes matched their hashes: nothing to rebuild
            # Collective (L2/L3); the transport keeps the ranks in step, an error after its end is this rank's.
            # A fallback's redundancy was the committed checkpoint's: never rebuilt (the same on every rank).
            before = guarded([], lambda: identity_of(os.stat(path)), None) if intact else None
            have, error = (False, "") if record.fallback else attempt(
                t.rank, lambda: t.rebuild_file(record.level, record.ckpt_id, path, path.parent, intact, record=record),
                False)
            if error:
                log.warning("rebuilding checkpoint %d (level %d): %s", record.ckpt_id, record.level, error)
            if (not intact and have) or (intact and guarded([], lambda: identity_of(os.stat(path)), None) != before):
                release_all(verdict.staged)  # or L3 rebuilt a sound file, not the one its whole-file hash recorded
                verdict = self.check(record, stage)
            elif not ok and error:  # why the level could not bring the file back (a full disk, a read error)
                verdict = Verdict(verdict.kind, f"{verdict.message}; rebuilding it failed: {error}")
            # Consensus: every rank sees every verdict, so that all agree and raise the same error.
            verdicts = t.allgather([verdict.kind, verdict.message])
            if all(k == "ok" for k, _m in verdicts):
                return verdict, ""
            release_all(verdict.staged)
            unreadable = next(((r, m) for r, (k, m) in enumerate(verdicts) if k == "unreadable"), None)
            if unreadable is not None:  # every rank raises it (all saw every verdict); nothing older is recovered
                raise RecoveryError(f"checkpoint {record.ckpt_id} (level {record.level}) cannot be read on rank "
                                    f"{unreadable[0]}: {unreadable[1]}; nothing was recovered, and no older "
                                    "checkpoint in its place (the next checkpoint would retire this one)")
            if self.spares.store is not None and not record.fallback:  # never a spare (nor a fallback) once retired
                self.spares.store.discard(record.level, record.seq)
            if record.fallback and not ok:  # this rank's spare: never patched as if it were whole
                distrust_spare(self.spares.store, record.level, path)
            bad = [(r, m) for r, (k, m) in enumerate(verdicts) if k != "ok"]
            return None, f"{len(bad)} rank(s) cannot verify or rebuild their file, first rank {bad[0][0]}: {bad[0][1]}"

        return newest_recoverable(self.all_candidates(ckpt_id, level) if records is None else records, verify,
                                  self.paths, ckpt_id, level)

    def all_candidates(self, ckpt_id: int | None, level: int | None,
                       error: type[FTIError] = RecoveryError) -> list[CommitRecord]:
        """:meth:`candidates` and the previous differential checkpoints kept as spares (see
        :meth:`~ftidask.engine.runstate.RunState.write_fallback`), newest first: a fallback is newer than an
        older checkpoint of another level. Without dCP the spares are removed at the start of the run."""
        return self.candidates(ckpt_id, level, error, fallbacks=bool(self.config.enable_dcp))

    def recover(self, ckpt_id: int | None, level: int | None, ids: Any,
                check: Callable[[], None] = lambda: None) -> dict[int, Any]:
        """:meth:`ftidask.Context.recover` (collective); ``check``: the context's own refusals (an incremental
        checkpoint open), made with the arguments' so that a rank refused tells the others."""
        ckpt_id, level, wanted = self._same_request(ckpt_id, level, ids, check)
        # Newest first, whatever layout wrote them: each run of candidates of one layout in turn, those written on
        # another number of ranks or node layout redistributed. Before, the newest's layout chose the only ones tried:
        # NoCheckpointError with a sound checkpoint of the other kind (e.g. the previous differential checkpoint,
        # written on 4 ranks and recovered on 2, once the checkpoint written after it on 2 ranks was damaged).
        failed: list[NoCheckpointError] = []
        passed = ""  # a partial recovery passes over older checkpoints of another layout: the error names them
        candidates = self.all_candidates(ckpt_id, level)
        for i, (change, records) in enumerate(reshard.by_layout(self, candidates)):
            if change and wanted is not None and i > 0:
                passed = passed or f"\n{change}: recover() without ids redistributes it"
                continue  # never redistributed in part; refused (RecoveryError) when it is the newest
            try:
                if change:
                    return reshard.recover_other_layout(self, records, change, wanted, candidates)
                return self._recover_here(ckpt_id, level, wanted, records)
            except NoCheckpointError as exc:  # agreed: the same on every rank; nothing was touched
                failed.append(exc)
        if not failed:
            return self._recover_here(ckpt_id, level, wanted, [])  # raises: no committed checkpoint
        if len(failed) == 1 and not passed:
            raise failed[0]
        raise NoCheckpointError("\n".join(map(str, failed)) + passed)

    def _recover_here(self, ckpt_id: int | None, level: int | None, wanted: list[int] | None,
                      records: list[CommitRecord]) -> dict[int, Any]:
        """Recover the newest of ``records`` (written on this run's layout) that verifies (collective). One whose
        blocks sit elsewhere than declared is redistributed (:meth:`_load`); found damaged then (a forged block
        record, a container that fails its hash), the older ones are tried, as for a file that does not verify."""
        passed: list[NoCheckpointError] = []
        verified = self._verified_before(ckpt_id, level, wanted is not None)
        newest = ckpt_id is None and level is None  # what the next recover_var() looks for
        while True:
            try:
                if verified is not None and any(r.seq == verified[0].seq and r.fallback == verified[0].fallback
                                                for r in records):
                    record, verdict = verified
                    return self._load(record, verdict, wanted, newest)
                with self._verifying(wanted) as stage:
                    record, verdict = self.find(ckpt_id, level, stage, records)
                try:
                    return self._load(record, verdict, wanted, newest)
                finally:
                    release_all(verdict.staged)  # committed ones are gone already
            except _Passed as exc:  # agreed, nothing touched: the older ones of this layout
                passed.append(exc.error)
                verified, records = None, records[records.index(record) + 1:]
            except NoCheckpointError as exc:
                if not passed:
                    raise
                raise NoCheckpointError("\n".join(map(str, [*passed, exc]))) from None

    def _same_request(self, ckpt_id: Any, level: Any, ids: Any,
                      check: Callable[[], None]) -> tuple[int | None, int | None, list[int] | None]:
        """The checkpoint id, level and variable ids (None: all) to recover, checked, once every rank is known to
        ask for the same (collective). Recovery is collective here, where FTI's FTI_Recover and FTI_RecoverVar
        read local files after FTI_Init: an application that calls recover() on some ranks and recover_var() (or
        checkpoint()) on others would pair unrelated collectives and hang; :func:`agree_call` makes it the same
        RecoveryError everywhere. The ids may differ (each rank its own variables, as FTI's RecoverVar allows:
        ids given by name in another order on each rank); the call, the checkpoint and the level may not."""
        def step() -> tuple[dict[str, Any], tuple[int | None, int | None, list[int] | None]]:
            check()
            request = recoverplan.normalize_request(ckpt_id, level, ids)
            return {"ckpt_id": request[0], "level": request[1], "all": request[2] is None}, request

        shown = [f"ckpt_id={ckpt_id!r}"] * (ckpt_id is not None) + [f"level={level!r}"] * (level is not None)
        shown += [f"ids={ids!r}"] * (ids is not None)  # as the application wrote them (the ids may differ)
        return agree_call(self.transport, "recover", step, RecoveryError, f"({', '.join(shown)})")

    @contextlib.contextmanager
    def _verifying(self, ids: list[int] | None) -> Iterator[Stager | None]:
        """Around the verification of the file(s) to recover variables ``ids`` (None: all) from: fresh
        arrays get verified pages to move under them (the stager given), the others' pages are faulted
        in while the disk is read."""
        arrays = self.arrays(ids)
        movable = pagemove.movable_arrays(arrays)
        with Prefault(a for vid, a in arrays.items() if vid not in movable):
            yield pagemove.stager(movable)

    def _load(self, record: CommitRecord, verdict: Verdict, wanted: list[int] | None,
              newest: bool = False) -> dict[int, Any]:
        """Plan, agree and fill the arrays from ``record``, which every rank verified (collective). ``newest``: it is
        the newest checkpoint that verifies, which the next recover_var() loads again as it is while every rank's
        file is unchanged (:meth:`_verified_before`), not read and hashed again."""
        assert verdict.parsed is not None
        t = self.transport
        untouched = (f"cannot recover checkpoint {record.ckpt_id} (level {record.level}); the protected arrays "
                     "are untouched")
        # Every rank agrees on each step before the next: what to fill, then the Python states decoded.
        targets, error = attempt(t.rank, lambda: recoverplan.plan(self.variables, verdict.parsed, wanted))
        moved = [f"rank {r}: {m}" for r, m in enumerate(t.allgather("" if error else targets.moved)) if m]
        if moved:  # the blocks moved between ranks: redistributed as declared, never old rank r's into rank r
            change = f"checkpoint {record.ckpt_id} (level {record.level}) has this run's ranks, but its blocks sit " \
                     f"elsewhere ({moved[0]})"
            try:
                return reshard.recover_other_layout(self, [record], change, wanted)
            except NoCheckpointError as exc:  # damaged: _recover_here tries the older ones of this layout
                raise _Passed(exc) from None
        try:
            problem = "" if error or not targets.problem else f"rank {t.rank}: {targets.problem}"
            agree(t, error or problem, RecoveryError, untouched)
            problem, error = attempt(t.rank, targets.load_states)
            agree(t, error or (f"rank {t.rank}: {problem}" if problem else ""), RecoveryError, untouched)
        except RecoveryError:  # an array of another size (FTI: realloc it): verified by every rank, the one to recover
            # stored_size() and realloc() now answer for it, not for the one written or recovered last in this run
            # (the newest, failed its hash; or an older one recover(ckpt_id=...) gave): else they size the arrays for
            # a checkpoint this recover() does not load, and it refuses them again, for ever. Agreed on every rank.
            self.progress.restart_file, self.progress.restart_record = verdict.parsed, record
            self.progress.restart_newest = newest
            raise

        def load() -> None:
            load_file(verdict.parsed, targets.arrays, config=self.config, staged=verdict.staged)
            targets.apply_states()
            if record.fallback:
                self.spares.get().recovered_fallback(record.level, self.rank_file(record), verdict.parsed)
            elif self.config.enable_dcp:
                self.spares.get().recovered(record.level, record.seq, self.rank_file(record), verdict.parsed)

        agree(t, attempt(t.rank, load)[1], RecoveryError,
              f"recovering checkpoint {record.ckpt_id} (level {record.level}) failed while loading, and the protected "
              "arrays may hold part of it: recover again")
        self.progress.restored(record.ckpt_id, record.level, verdict.parsed)
        self.progress.restart_file = verdict.parsed  # stored_size's sizes (its layout holds compressed bytes)
        self.progress.verified = (record, verdict.parsed) if newest else None
        log.info("recovered checkpoint %d from level %d%s%s", record.ckpt_id, record.level,
                 "" if wanted is None else f" (variables {wanted})",
                 " (the previous differential checkpoint, kept as the spare)" if record.fallback else "")
        return targets.recovered()

    def recover_file(self, path: Any, meta: Any = None, rank: Any = None) -> dict[int, Any]:
        """:meth:`ftidask.Context.recover_file` (this rank only; ``rank``: whose part of FTI's MPI-IO file)."""
        return self.prepare_file(path, meta, rank).load()

    def prepare_file(self, path: Any, meta: Any = None, rank: Any = None) -> PreparedFile:
        """:meth:`recover_file` verified and planned, no array written: its ``load()`` fills them
        (:mod:`ftidask.engine.filerecovery`)."""
        return prepare_file(self.variables, self.progress, path, meta, rank, self.transport.rank,
                            lambda: self._verifying(None))

    def _verified_before(self, ckpt_id: int | None, level: int | None,
                         partial: bool = False) -> tuple[CommitRecord, Verdict] | None:
        """The checkpoint :meth:`restart_metadata` found and verified (stored_size, realloc, var_id before a
        recover(), FTI's order), or for a ``partial`` recovery (recover_var()) the newest one recovered last, when it
        is the one this recovery asks for and every rank's file is unchanged since: it is then loaded as it is, not
        read and hashed again. Collective."""
        record, parsed = self.progress.restart_record, self.progress.restart_file
        if ckpt_id is None and level is None and not self.progress.restart_newest:
            record = None  # an older checkpoint a refused recover(ckpt_id=...) named: not the newest asked for now
        if record is None and partial and self.progress.verified is not None:
            record, parsed = self.progress.verified
        # The same on every rank (set and cleared by collective steps, the request agreed): no message needed
        # to pass over it, and none in an ordinary recovery.
        if (record is None or parsed is None or ckpt_id not in (None, record.ckpt_id)
                or level not in (None, record.level) or str(parsed.path).endswith(".zarr")):
            return None
        if not all(self.transport.allgather(unchanged(parsed))):  # each rank's own file: agreed
            return None
        return record, Verdict("ok", parsed=parsed)
