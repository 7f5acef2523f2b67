"""The FTI API in Python's idiom: a :class:`Context` made by :func:`ftidask.init`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import pystate
from ..engine.checkpointing import CheckpointInfo
from ..engine.dcpstore import DcpStore
from ..engine.pending import OneShotWriter, PendingCheckpoint, RankFileWriter
from ..engine.recovering import RecoveryMixin
from ..engine.recovery import check_file
from ..engine.retention import RetentionMixin
from ..engine.runstate import STATUS_FRESH, CommitRecord, FileRecord, RunState, claim_run
from ..engine.writing import WritingMixin
from ..ftiff import compression, hashing
from ..ftiff.layout import Layout, plan_layout
from ..ftiff.reader import FtiffFile
from ..model import constants
from ..model.arrays import check_ckpt_id, check_id, check_protectable
from ..model.config import Config
from ..model.decomposition import declaration, still_fits
from ..model.errors import CheckpointError, ConfigError, FTIError, ProtectError, RunInUseError
from ..model.level import Level
from ..staging.stager import StagingMixin
from ..storage import dirchecks, runlock
from ..storage import files as storage
from ..storage.runlock import RunLock
from ..transport.base import Transport
from ..transport.collective import agree, attempt, everywhere, on_root, reason
from . import logsetup

log = logging.getLogger("ftidask")


@dataclasses.dataclass
class Protected:
    """One protected variable."""

    id: int
    name: str
    array: np.ndarray
    compressor: dict[str, Any] | None = None  # numcodecs config; None: the config's [advanced] compressor
    decomp: dict[str, Any] | None = None  # its place in a global array (model.decomposition), for resharding
    state: pystate.Holder | None = None  # a Python state (ftidask.engine.pystate): ``array`` holds its bytes


class Context(WritingMixin, RecoveryMixin, RetentionMixin, StagingMixin):
    """One process's handle on a run: protected variables, checkpoints, recovery."""

    def __init__(self, config: Config, transport: Transport) -> None:
        self._closed = False
        self._run_lock: RunLock | None = None
        config = config.with_absolute_dirs()  # a later os.chdir of the application moves nothing
        self.config = config
        self.transport = transport
        logsetup.apply_verbosity(config.verbosity, False, transport.rank)
        storage.set_permissions(config.permissions)
        dirchecks.check(transport, [Path(config.ckpt_dir), Path(config.glbl_dir), Path(config.meta_dir)])
        self.exec_id, self._status = self._claim_run(Path(config.meta_dir))
        self.paths = storage.RunPaths(Path(config.ckpt_dir), Path(config.glbl_dir), Path(config.meta_dir),
                                      self.exec_id)
        self.state = RunState(Path(config.meta_dir), self.exec_id)
        dirchecks.check(transport, dirchecks.run_dirs(self.paths, transport.node, self.state.records_dir))
        self._vars: dict[int, Protected] = {}
        self._layout: Layout | None = None
        self._hash_id = hashing.hash_id(config.hash)
        self._pool: ThreadPoolExecutor | None = None
        self._trash_pool: ThreadPoolExecutor | None = None
        self._recovered = False
        self._restart_file: FtiffFile | None = None
        self.last_checkpoint: CheckpointInfo | None = None
        self.recovered_from: tuple[int, int] | None = None
        self._iteration = 0
        self._last_time = [time.monotonic()] * 4
        self._next_ckpt_id = 1
        self._dcp: DcpStore | None = None
        self._icp: Any = None  # the open incremental checkpoint (ftidask.engine.icp)
        transport.barrier()
        self._collect_garbage()
        log.info("run %s: %s (%s backend, %d rank(s))", self.exec_id,
                 "fresh start" if self._status == STATUS_FRESH else f"restart (status {self._status})",
                 transport.name, transport.size)

    def _claim_run(self, meta_dir: Path) -> tuple[str, int]:
        """``(exec_id, status)``: rank 0 chooses and locks the run (:func:`ftidask.engine.runstate.claim_run`);
        every rank gets its choice, or the same error."""
        t = self.transport
        outcome: dict[str, Any] | None = None
        error: FTIError | None = None
        if t.rank == 0:
            try:
                claim = claim_run(meta_dir, self.config.exec_id)
            except FTIError as exc:
                error = exc
                outcome = {"error": type(exc).__name__, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - an OS error, anything: every rank must hear of it
                error = FTIError(f"ftidask.init: cannot start or resume the run in {meta_dir}: rank 0: {reason(exc)}")
                error.__cause__ = exc
                outcome = {"error": "FTIError", "message": str(error)}
            else:
                self._run_lock = claim.lock
                outcome = {"exec_id": claim.exec_id, "status": claim.status}
                if claim.beside is not None:
                    log.warning("meta_dir %s is in use by the live run %s (%s): this run is a new one, %s. A restart "
                                "without exec_id restarts %s; to restart this run, pass exec_id=%r", meta_dir,
                                claim.beside, runlock.holder(meta_dir / claim.beside), claim.exec_id, claim.beside,
                                claim.exec_id)
        outcome = t.bcast(outcome)
        if "error" in outcome:
            if error is not None:
                raise error
            kind = {"RunInUseError": RunInUseError, "ConfigError": ConfigError}.get(outcome["error"], FTIError)
            raise kind(outcome["message"])
        return str(outcome["exec_id"]), int(outcome["status"])

    # --- protection ----------------------------------------------------------------------------

    def protect(self, id: int, array: Any, name: str | None = None, compressor: Any = None, *,
                global_shape: Any = None, offset: Any = None, replicated: bool = False) -> None:
        """FTI_Protect: register ``array`` under ``id`` (again: update its array and size).

        ``compressor`` (``"zstd"``, ``"lz4"``, ``"blosc"``, ``"none"``, a numcodecs codec...) overrides
        ``[advanced] compressor`` for this variable; see :mod:`ftidask.ftiff.compression`.
        ``global_shape`` and ``offset`` (or ``global_shape=ftidask.Block(shape, offset)``) declare the
        array as a block of a global array, ``replicated=True`` as held whole by every rank: a restart
        on another number of ranks then redistributes it (see docs/mpi.md).
        ``array`` may also be Python state, stored as JSON and recovered in place: an
        ``ftidask.State`` (or dict) or ``ftidask.Value`` of JSON values, or a ``numpy.random``
        Generator/BitGenerator (its state); anything else is refused (never pickled).
        """
        self._check_open()
        vid = check_id(id, "variable id")
        state = pystate.holder_of(array)  # a Python state (stored as JSON bytes), or None for an array
        array = state.encode() if state is not None else check_protectable(array)
        old = self._vars.get(vid)
        if name is None:
            name = old.name if old is not None else f"var{vid}"
        codec = old.compressor if old is not None and compressor is None else None
        if compressor is not None:
            codec = compression.parse_compressor(compressor) or {"id": "none"}
        if state is not None and (global_shape is not None or offset is not None or replicated):
            raise ProtectError(f"variable {vid}: a Python state takes no global_shape, offset or replicated (it is "
                               "recovered whole, on the checkpoint's number of ranks)")
        decomp = declaration(array, global_shape, offset, replicated)
        if decomp is None and old is not None and global_shape is None and not replicated:
            decomp = still_fits(array, old.decomp)  # protect again (or realloc): the declaration stays if it fits
        self._vars[vid] = Protected(vid, str(name), array, codec, decomp=decomp, state=state)

    @property
    def protected(self) -> Mapping[int, np.ndarray]:
        """The protected arrays (and Python-state objects) by id, in protection order."""
        return {vid: p.state.obj if p.state is not None else p.array for vid, p in self._vars.items()}

    def status(self) -> int:
        """FTI_Status, fixed at init: 0 fresh start, 1 restart, 2 restart from a kept L4 checkpoint."""
        return self._status

    # --- checkpoint ------------------------------------------------------------------------------

    def checkpoint(self, id: int, level: int, *, dcp: bool = False) -> CheckpointInfo:
        """FTI_Checkpoint: write every protected variable as checkpoint ``id`` at ``level``.

        Levels 5-8 (FTI's L1_DCP..L4_DCP), or ``dcp=True`` with levels 1-4, write a differential
        checkpoint (``enable_dcp = 1``): only the blocks that changed since the file being updated.
        """
        self._check_open()
        pending = self._begin_checkpoint(id, self._check_level(level, dcp))
        try:
            for vid, p in self._vars.items():
                if pending.error:
                    break
                _r, pending.error = attempt(self.transport.rank,
                                            functools.partial(pending.write_var, vid, p.name, p.array))
        except BaseException:  # interrupted: no file left open, nothing committed
            pending.abort()
            raise
        return self._commit_checkpoint(pending)

    def _begin_checkpoint(self, id: int, level: Level, incremental: bool = False) -> PendingCheckpoint:
        """Plan checkpoint ``id`` and open its file (shared by checkpoint and iCP)."""
        self._check_open()
        if self._icp is not None:
            raise CheckpointError(f"incremental checkpoint {self._icp.ckpt_id} is open; finalize_icp() first")
        ckpt_id = check_ckpt_id(id)
        t = self.transport
        t.wait_post()  # a head still post-processing the previous checkpoint must finish first (as FTI)
        post_level = level.base
        level = Level(t.write_level(level.base), level.differential)  # L1 when a head raises it later
        state_error = self._encode_states()  # before the layout: a state's size changes with its value

        def plan() -> tuple[Layout, int | None]:
            if incremental and not level.differential and (self._codecs() or (
                    level.base == 4 and self.config.l4_format == "zarr")):
                raise CheckpointError("incremental checkpoints are written uncompressed as FTI-FF files: set "
                                      "compressor = none (and l4_format = ftiff for level 4), or use levels 5-8")
            return (plan_layout(self._layout, [(vid, p.array.nbytes) for vid, p in self._vars.items()]),
                    self.state.next_seq() if t.rank == 0 else None)

        (layout, seq), error = attempt(t.rank, plan, (None, None))
        seq = agree(t, error, CheckpointError, f"checkpoint {ckpt_id} cannot start; the previous checkpoint is kept",
                    seq)[0]  # rank 0's sequence number, or the same error on every rank
        base_level = level.base
        directory = self.paths.level_dir(base_level, t.node) / storage.ckpt_dirname(ckpt_id, seq)
        path = directory / storage.rank_file(ckpt_id, t.rank)

        def open_writer() -> Any:
            if level.differential:
                return self._dcp_store().begin(base_level, layout)
            if incremental:
                return RankFileWriter(path, layout, self._hash_id, self._hash_pool())
            # every variable at once, at commit: compression, Zarr L4 and progress bars apply
            return OneShotWriter(functools.partial(self._write_full, ckpt_id, base_level, path, layout))

        writer, error = attempt(t.rank, open_writer)  # an error is reported, on every rank, at the commit
        return PendingCheckpoint(ckpt_id, level.number, seq, layout, directory, path,
                                 {vid: p.array.nbytes for vid, p in self._vars.items()}, writer,
                                 error=state_error or error, post_level=post_level, extras=self._var_extras())

    def _commit_checkpoint(self, pending: PendingCheckpoint) -> CheckpointInfo:
        """Finish every rank's file, add the level's redundancy, write the commit record.

        Each local step runs through :func:`~ftidask.transport.collective.attempt` and the ranks agree after
        it: an exception on any rank (an OS error, MemoryError, anything) fails the checkpoint on
        every rank with the same :class:`CheckpointError`, and the previous checkpoint stays.
        """
        t = self.transport
        ckpt_id, level, seq = pending.ckpt_id, pending.base_level, pending.seq
        failed = f"checkpoint {ckpt_id} at level {pending.level} failed; the previous checkpoint is kept"
        written = None
        try:
            sizes = t.allgather(pending.layout.fs)

            def finish() -> tuple[Any, dict[str, Any]]:
                done = pending.finish(
                    {"format": "ftidask", "exec_id": self.exec_id, "ckpt_id": ckpt_id, "level": level,
                     "seq": seq, "rank": t.rank, "nranks": t.size, "node": t.node,
                     "backend": t.name, "time": time.time()},
                    pt_fs=self._partner_fs(sizes), max_fs=max(sizes[r] for r in t.group_of()))
                return done, FileRecord(t.rank, t.node, done.file_size, done.fb.hash.hex()).to_json()

            entry, error = None, pending.error
            if not error:
                (written, entry), error = attempt(t.rank, finish, (None, None))
            # Every file is complete before the level's collectives: none of them runs for a failed checkpoint.
            files = agree(t, error, CheckpointError, failed, entry)

            def protect() -> None:  # collective for L2/L3: the level keeps the ranks in step, reports at its end
                if pending.differential:
                    stats = pending.stats
                    t.protect_files_delta(level, ckpt_id, pending.path, pending.directory,
                                          None if stats is None else stats.delta,
                                          xor=None if stats is None else stats.xor)
                else:
                    t.protect_files(level, ckpt_id, pending.path, pending.directory)

            agree(t, attempt(t.rank, protect)[1], CheckpointError, failed)
            record = CommitRecord(seq, ckpt_id, level, time.time(), t.size, tuple(FileRecord(**f) for f in files),
                                  {"dcp": True} if pending.differential else
                                  {"l4_format": "zarr"} if isinstance(pending.writer, OneShotWriter) and level == 4
                                  and self.config.l4_format == "zarr" else {})
            on_root(t, functools.partial(self.state.write_record, record), CheckpointError, failed)  # the commit
        except CheckpointError:  # agreed: the same on every rank
            self._drop_checkpoint(pending, finished=written is not None)
            raise
        assert written is not None  # every rank succeeded
        self._layout = pending.layout
        self._restart_file = None
        stats = pending.stats
        info = CheckpointInfo(ckpt_id, pending.level, seq, written.data_bytes,
                              written.file_size if stats is None else stats.file_bytes,
                              time.perf_counter() - pending.started,
                              None if stats is None else stats.blocks_changed,
                              None if stats is None else stats.blocks_total,
                              None if stats is None else stats.blocks_hashed)
        self.last_checkpoint = info
        self._next_ckpt_id = max(self._next_ckpt_id, ckpt_id + 1)
        try:  # collective: their errors are agreed too (the same FTIError on every rank)
            self._retire_older(record)
            self._collect_garbage()
        except FTIError as exc:
            raise CheckpointError(f"checkpoint {ckpt_id} (level {pending.level}) is committed and recoverable, "
                                  f"but cleaning up after it failed: {exc}") from exc
        t.post_process(record, pending.post_level or level, self.exec_id)
        log.info("checkpoint %d (level %d) written: %d bytes in %.3f s", ckpt_id, pending.level,
                 info.bytes_written, info.seconds)
        return info

    def _drop_checkpoint(self, pending: PendingCheckpoint, finished: bool) -> None:
        """After a failed checkpoint: remove its files (and its record, had rank 0 written it before
        failing). Local and best effort: every rank raises the agreed error after it."""
        def drop() -> None:
            if not finished:
                pending.abort()
            storage.remove_tree(pending.directory)
            if self._dcp is not None:
                self._dcp.discard(pending.base_level, pending.seq)
            if self.transport.rank == 0:
                self.state.delete_record(pending.seq)

        _r, error = attempt(self.transport.rank, drop)
        if error:
            log.warning("cleaning up after the failed checkpoint %d: %s", pending.ckpt_id, error)

    def _encode_states(self) -> str:
        """Store each protected Python state's current value as its bytes; why one cannot be, or ''."""
        for p in self._vars.values():
            if p.state is not None:
                try:
                    p.array = p.state.encode()
                except FTIError as exc:  # reported on every rank by the commit, nothing written
                    return f"rank {self.transport.rank}: variable {p.id} ({p.name}): {exc}"
        return ""

    def _var_extras(self) -> dict[int, dict[str, Any]]:
        """What the variable table records beyond the array: a Python state's kind, a block's place
        in a global array (resharding)."""
        out: dict[int, dict[str, Any]] = {}
        for vid, p in self._vars.items():
            extra = dict(p.decomp or {})
            if p.state is not None:
                extra[pystate.EXTRA_KEY] = p.state.kind
            if extra:
                out[vid] = extra
        return out

    def _check_level(self, level: Any, dcp: bool = False) -> Level:
        """The level a checkpoint asks for, parsed once (1-4; 5-8 or ``dcp=True`` with enable_dcp), and
        refused here when this run's transport cannot provide it."""
        parsed = Level.parse(level, dcp=dcp, enable_dcp=bool(self.config.enable_dcp))
        self.transport.check_level(parsed.base)
        return parsed

    def _partner_fs(self, sizes: list[int]) -> int:
        # FTI's ptFs: the size of the partner file this rank keeps (its left partner's).
        return sizes[self.transport.partner_of()]

    # --- snapshot and finalize ---------------------------------------------------------------------

    def snapshot(self) -> int:
        """FTI_Snapshot: recover on a restart, otherwise checkpoint the levels that are due.

        Returns FTI_SCES (nothing to do, or recovered) or FTI_DONE (a checkpoint was written).
        """
        self._check_open()
        if self._status != STATUS_FRESH and not self._recovered:
            self.recover()
            return constants.FTI_SCES
        self._iteration += 1
        now = time.monotonic()
        due = []
        for level in constants.LEVELS:
            interval = self.config.interval(level)
            if interval <= 0 or level not in self.transport.levels():
                continue
            if self.config.snapshot_unit == "iterations":
                is_due = self._iteration % interval == 0
            else:
                is_due = now - self._last_time[level - 1] >= interval * 60
            if is_due:
                due.append(level)
        # Ranks must agree (minutes are measured per process).
        due = self.transport.bcast(due)
        if not due:
            return constants.FTI_SCES
        level = max(due)
        self.checkpoint(self._next_ckpt_id, level)
        for lv in due:
            self._last_time[lv - 1] = now
        return constants.FTI_DONE

    def finalize(self) -> None:
        """FTI_Finalize: flush the last checkpoint to L4 if ``keep_last_ckpt``, else clean up."""
        if self._closed:
            return
        t = self.transport
        staging_failed = self._finish_staging()  # wait for pending SendFile requests (stage_timeout)
        failed = "finalize failed"
        try:
            t.wait_post()
            records = self._candidates(None, None, FTIError)
            if self.config.keep_last_ckpt and records:
                last = records[0]
                if last.level != 4:
                    self._flush_to_l4(last)
                on_root(t, lambda: self.state.write_run(state="finalized", keep_last=True), FTIError, failed)
            else:
                for record in records:
                    self._remove_checkpoint(record)
                on_root(t, lambda: self.state.write_run(state="finalized", keep_last=False), FTIError, failed)
            # the spares of differential checkpoints (every rank takes part, with a store or not)
            everywhere(t, self._dcp.clear if self._dcp is not None else lambda: None, FTIError, failed)
        finally:
            self._close()
        self._prune_run_dirs()
        self._staging_report(staging_failed)

    def _prune_run_dirs(self) -> None:
        """After finalize: remove the empty directories this run leaves (level directories, node
        directories of the run), never a file and never anything outside the run's own directories."""
        p = self.paths
        for root in (*p.ckpt_dir.glob(f"node*/{p.exec_id}"), p.glbl_dir / p.exec_id, p.stage_root):
            storage.prune_empty_dirs(root)
        for sub in (p.run_meta.iterdir() if p.run_meta.is_dir() else ()):  # the run's state stays
            if sub.is_dir():
                storage.prune_empty_dirs(sub)

    def _close(self) -> None:
        self._closed = True
        self._icp = None
        if self._dcp is not None:
            self._dcp.close()
        for pool in (self._pool, self._trash_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._trash_pool = None
        try:
            self.transport.close()
        finally:
            if self._run_lock is not None:  # last: the run is no longer written by this process
                self._run_lock.release()

    def _flush_to_l4(self, record: CommitRecord) -> None:
        t = self.transport
        failed = "keep_last_ckpt: flushing the last checkpoint to L4 failed"
        seq = on_root(t, self.state.next_seq, CheckpointError, failed)
        as_zarr = self.config.l4_format == "zarr"

        def flush() -> dict[str, Any] | None:
            verdict = check_file(self._rank_file(record), record, t.rank)
            if verdict.kind != "ok":
                raise CheckpointError(verdict.message)
            dst = self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq)
            if as_zarr:
                from ..engine import zarr_l4

                written = zarr_l4.flush_file(verdict.parsed, dst / zarr_l4.store_name(record.ckpt_id, t.rank), seq)
                return FileRecord(t.rank, t.node, written.file_size, written.fb.hash.hex()).to_json()
            storage.copy_file_atomic(self._rank_file(record), dst / storage.rank_file(record.ckpt_id, t.rank))
            return None

        entry, error = attempt(t.rank, flush)
        files = agree(t, error, CheckpointError, failed, entry)
        zarr_files = {"files": tuple(FileRecord(**f) for f in files), "extra": {"l4_format": "zarr"}} if as_zarr else {}
        flushed = dataclasses.replace(record, seq=seq, level=4, timestamp=time.time(), **zarr_files)
        try:
            on_root(t, functools.partial(self.state.write_record, flushed), CheckpointError, failed)
        except CheckpointError:  # the last checkpoint stays where it is, committed; the copy goes
            storage.remove_tree(self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq))
            raise

    @property
    def comm(self) -> Any:
        """The communicator the application must use (FTI_COMM_WORLD: heads excluded); None without MPI."""
        return getattr(self.transport, "comm", None)

    def wait_post_processing(self) -> Any:
        """Wait until the head has finished post-processing the last checkpoint (L2-L4 with heads)."""
        return self.transport.wait_post()

    def post_processing_done(self) -> bool:
        """Whether the head has finished post-processing the last checkpoint (never blocks)."""
        return self.transport.post_done()

    def _check_open(self) -> None:
        if self._closed:
            raise FTIError("this context is finalized; call ftidask.init() again")

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            # Died with an error: keep the checkpoints so that the next run can restart.
            self._finish_staging()  # failures are logged; the application's error is the one to see
            self._close()

    def __repr__(self) -> str:
        vars_ = ", ".join(f"{p.id}:{p.name} {p.array.dtype}{list(p.array.shape)}" for p in self._vars.values())
        last = self.last_checkpoint
        return (f"<ftidask.Context exec_id={self.exec_id!r} backend={self.transport.name} rank={self.transport.rank}"
                f"/{self.transport.size} status={self._status} vars=[{vars_}]"
                f" last_checkpoint={None if last is None else (last.id, last.level)}"
                f"{' finalized' if self._closed else ''}>")

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{p.id}</td><td>{html.escape(p.name)}</td><td>{p.array.dtype}</td>"
            f"<td>{tuple(p.array.shape)}</td><td>{p.array.nbytes:,}</td></tr>" for p in self._vars.values())
        last = self.last_checkpoint
        return (f"<div><b>ftidask.Context</b> run <code>{html.escape(self.exec_id)}</code>, "
                f"{self.transport.name} backend, status {self._status}, "
                f"last checkpoint: {'none' if last is None else f'id {last.id}, level {last.level}'}"
                f"<table><tr><th>id</th><th>name</th><th>dtype</th><th>shape</th><th>bytes</th></tr>{rows}"
                "</table></div>")


def _rank_of(comm: Any) -> int:
    try:
        return int(comm.Get_rank())
    except Exception:  # not a communicator: make_mpi_context says so
        return 0



#: The backends ``init`` can start, by name: ``module:function`` making their Context. They sit above
#: this layer (they build on :class:`Context`) and their modules import mpi4py or distributed, so they
#: are imported only when a run asks for one.
BACKENDS = {
    "mpi": "ftidask.backends.mpi.transport:make_mpi_context",
    "dask": "ftidask.backends.dask.context:make_dask_context",
}


def backend(name: str) -> Any:
    """The Context factory of backend ``name`` (imported on first use)."""
    module, _, function = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), function)

def init(config: str | os.PathLike[str] | Config | None = None, *, comm: Any = None, client: Any = None,
         **overrides: Any) -> Context:
    """FTI_Init: read the config (an FTI-style INI file, or defaults) and start or restart a run.

    ``comm`` (an mpi4py communicator) selects the MPI backend, ``client`` (a distributed.Client)
    the Dask backend; with neither, one process. ``verbosity`` set here or in the config file
    (1 debug, 2 a line per checkpoint and recovery, 3 warnings, 4 errors) prints ftidask's log on
    stderr, unless the application has configured :mod:`logging` itself (see
    :func:`ftidask.log_to_stderr`).
    """
    from ..model.config import keys_in_file, load_config

    cfg = load_config(config, **overrides).with_absolute_dirs()  # every backend, MPI heads included
    if isinstance(config, Config):  # built by the application: explicit where it differs from the default
        explicit = "verbosity" in overrides or config.verbosity != Config().verbosity
    else:
        explicit = "verbosity" in overrides or (config is not None and "verbosity" in keys_in_file(config))
    logsetup.apply_verbosity(cfg.verbosity, explicit, 0 if comm is None else _rank_of(comm))
    if comm is not None and client is not None:
        raise FTIError("pass comm= (MPI) or client= (Dask), not both")
    if comm is not None:
        return backend("mpi")(cfg, comm)
    if client is not None:
        return backend("dask")(cfg, client)
    from ..transport.base import SerialTransport

    return Context(cfg, SerialTransport())
