"""The FTI API in Python's idiom: a :class:`Context` made by :func:`ftidask.init`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from . import constants, dirchecks, logsetup, runlock, storage
from .arrays import check_ckpt_id, check_id, check_protectable
from .checkpointing import CheckpointInfo
from .config import Config
from .context_recovery import RecoveryMixin
from .context_writing import WritingMixin
from .dcpstore import DcpStore
from .errors import CheckpointError, ConfigError, FTIError, LevelError, RunInUseError
from .ftiff import compression, hashing
from .ftiff.reader import FtiffFile
from .layout import Layout, plan_layout
from .pending import OneShotWriter, PendingCheckpoint, RankFileWriter
from .recovery import check_file
from .retention import RetentionMixin
from .runlock import RunLock
from .runstate import STATUS_FRESH, CommitRecord, FileRecord, RunState, claim_run
from .staging import StagingMixin
from .transport.base import Transport

log = logging.getLogger("ftidask")


@dataclasses.dataclass
class Protected:
    """One protected variable."""

    id: int
    name: str
    array: np.ndarray
    compressor: dict[str, Any] | None = None  # numcodecs config; None: the config's [advanced] compressor


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
        self._icp: Any = None  # the open incremental checkpoint (ftidask.icp)
        transport.barrier()
        self._collect_garbage()
        log.info("run %s: %s (%s backend, %d rank(s))", self.exec_id,
                 "fresh start" if self._status == STATUS_FRESH else f"restart (status {self._status})",
                 transport.name, transport.size)

    def _claim_run(self, meta_dir: Path) -> tuple[str, int]:
        """``(exec_id, status)``: rank 0 chooses and locks the run (:func:`ftidask.runstate.claim_run`);
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

    def protect(self, id: int, array: Any, name: str | None = None, compressor: Any = None) -> None:
        """FTI_Protect: register ``array`` under ``id`` (again: update its array and size).

        ``compressor`` (``"zstd"``, ``"lz4"``, ``"blosc"``, ``"none"``, a numcodecs codec...) overrides
        ``[advanced] compressor`` for this variable; see :mod:`ftidask.ftiff.compression`.
        """
        self._check_open()
        vid = check_id(id, "variable id")
        array = check_protectable(array)
        old = self._vars.get(vid)
        if name is None:
            name = old.name if old is not None else f"var{vid}"
        codec = old.compressor if old is not None and compressor is None else None
        if compressor is not None:
            codec = compression.parse_compressor(compressor) or {"id": "none"}
        self._vars[vid] = Protected(vid, str(name), array, codec)

    @property
    def protected(self) -> Mapping[int, np.ndarray]:
        """The protected arrays by id, in protection order."""
        return {vid: p.array for vid, p in self._vars.items()}

    def status(self) -> int:
        """FTI_Status, fixed at init: 0 fresh start, 1 restart, 2 restart from a kept L4 checkpoint."""
        return self._status

    # --- checkpoint ------------------------------------------------------------------------------

    def checkpoint(self, id: int, level: int, *, dcp: bool = False) -> CheckpointInfo:
        """FTI_Checkpoint: write every protected variable as checkpoint ``id`` at ``level``.

        Levels 5-8 (FTI's L1_DCP..L4_DCP), or ``dcp=True`` with levels 1-4, write a differential
        checkpoint (``enable_dcp = 1``): only the blocks that changed since the file being updated.
        """
        pending = self._begin_checkpoint(id, level + 4 if dcp and level in constants.LEVELS else level)
        try:
            for vid, p in self._vars.items():
                if pending.error:
                    break
                try:
                    pending.write_var(vid, p.name, p.array)
                except (OSError, FTIError) as exc:
                    pending.error = f"rank {self.transport.rank}: {exc}"
        except BaseException:  # interrupted: no file left open, nothing committed
            pending.abort()
            raise
        return self._commit_checkpoint(pending)

    def _begin_checkpoint(self, id: int, level: int, incremental: bool = False) -> PendingCheckpoint:
        """Plan checkpoint ``id`` and open its file (shared by checkpoint and iCP)."""
        self._check_open()
        if self._icp is not None:
            raise CheckpointError(f"incremental checkpoint {self._icp.ckpt_id} is open; finalize_icp() first")
        ckpt_id = check_ckpt_id(id)
        level = self._check_level(level)
        t = self.transport
        t.wait_post()  # a head still post-processing the previous checkpoint must finish first (as FTI)
        differential = level > 4  # L5-L8: differential L1-L4
        post_level = level - 4 if differential else level
        level = t.write_level(post_level) + (4 if differential else 0)
        layout = plan_layout(self._layout, [(vid, p.array.nbytes) for vid, p in self._vars.items()])
        seq = t.bcast(self.state.next_seq() if t.rank == 0 else None)
        base_level = level - 4 if level > 4 else level
        directory = self.paths.level_dir(base_level, t.node) / storage.ckpt_dirname(ckpt_id, seq)
        path = directory / storage.rank_file(ckpt_id, t.rank)
        if incremental and level <= 4 and (self._codecs() or (level == 4 and self.config.l4_format == "zarr")):
            raise CheckpointError("incremental checkpoints are written uncompressed as FTI-FF files: set "
                                  "compressor = none (and l4_format = ftiff for level 4), or use levels 5-8")
        writer: Any = None
        error = ""
        try:
            if level > 4:
                writer = self._dcp_store().begin(base_level, layout)
            elif incremental:
                writer = RankFileWriter(path, layout, self._hash_id, self._hash_pool())
            else:  # every variable at once, at commit: compression, Zarr L4 and progress bars apply
                writer = OneShotWriter(functools.partial(self._write_full, ckpt_id, level, path, layout))
        except (OSError, FTIError) as exc:
            error = f"rank {t.rank}: {exc}"
        return PendingCheckpoint(ckpt_id, level, seq, layout, directory, path,
                                 {vid: p.array.nbytes for vid, p in self._vars.items()}, writer, error=error,
                                 post_level=post_level)

    def _commit_checkpoint(self, pending: PendingCheckpoint) -> CheckpointInfo:
        """Finish every rank's file, add the level's redundancy, write the commit record."""
        t = self.transport
        ckpt_id, level, seq = pending.ckpt_id, pending.base_level, pending.seq
        sizes = t.allgather(pending.layout.fs)
        written = None
        if not pending.error:
            try:
                written = pending.finish(
                    {"format": "ftidask", "exec_id": self.exec_id, "ckpt_id": ckpt_id, "level": level,
                     "seq": seq, "rank": t.rank, "nranks": t.size, "node": t.node,
                     "backend": t.name, "time": time.time()},
                    pt_fs=self._partner_fs(sizes), max_fs=max(sizes[r] for r in t.group_of()))
            except (OSError, FTIError) as exc:
                pending.error = f"rank {t.rank}: {exc}"
        try:  # collective for L2/L3: every rank takes part, even one whose file failed
            if pending.differential:
                stats = None if pending.error else pending.stats
                t.protect_files_delta(level, ckpt_id, pending.path, pending.directory,
                                      None if stats is None else stats.delta, xor=None if stats is None else stats.xor)
            else:
                t.protect_files(level, ckpt_id, pending.path, pending.directory)
        except (OSError, FTIError) as exc:
            pending.error = pending.error or f"rank {t.rank}: {exc}"
        if pending.error:
            pending.abort()
        results = t.allgather((pending.error, None if written is None else
                               FileRecord(t.rank, t.node, written.file_size, written.fb.hash.hex()).to_json()))
        errors = [e for e, _ in results if e]
        if errors:
            storage.remove_tree(pending.directory)
            if self._dcp is not None:
                self._dcp.discard(level, seq)
            raise CheckpointError(f"checkpoint {ckpt_id} at level {pending.level} failed; the previous checkpoint "
                                  "is kept: " + "; ".join(errors))
        assert written is not None  # every rank succeeded
        record = CommitRecord(seq, ckpt_id, level, time.time(), t.size,
                              tuple(FileRecord(**f) for _e, f in results),
                              {"dcp": True} if pending.differential else
                              {"l4_format": "zarr"} if isinstance(pending.writer, OneShotWriter) and level == 4
                              and self.config.l4_format == "zarr" else {})
        failed = ""
        if t.rank == 0:
            try:
                self.state.write_record(record)  # the commit point
            except OSError as exc:  # a full or read-only meta_dir: the previous checkpoint stays the newest
                failed = f"writing its commit record in {self.state.records_dir} failed: {exc}"
        failed = next((e for e in t.allgather(failed) if e), "")  # as a barrier; every rank raises the same
        if failed:
            storage.remove_tree(pending.directory)
            if self._dcp is not None:
                self._dcp.discard(level, seq)
            raise CheckpointError(f"checkpoint {ckpt_id} at level {pending.level} failed; the previous checkpoint "
                                  f"is kept: {failed}")
        self._layout = pending.layout
        self._restart_file = None
        self._retire_older(record)
        self._collect_garbage()
        t.post_process(record, pending.post_level or level, self.exec_id)
        stats = pending.stats
        info = CheckpointInfo(ckpt_id, pending.level, seq, written.data_bytes,
                              written.file_size if stats is None else stats.file_bytes,
                              time.perf_counter() - pending.started,
                              None if stats is None else stats.blocks_changed,
                              None if stats is None else stats.blocks_total,
                              None if stats is None else stats.blocks_hashed)
        self.last_checkpoint = info
        self._next_ckpt_id = max(self._next_ckpt_id, ckpt_id + 1)
        log.info("checkpoint %d (level %d) written: %d bytes in %.3f s", ckpt_id, pending.level,
                 info.bytes_written, info.seconds)
        return info

    def _check_level(self, level: Any) -> int:
        if (self.config.enable_dcp and isinstance(level, (int, np.integer)) and not isinstance(level, bool)
                and int(level) in constants.DCP_LEVELS):
            # A backend with its own checkpoint() must say that it writes differential files.
            if type(self).checkpoint is not Context.checkpoint and not getattr(self, "writes_dcp", False):
                raise LevelError(f"level {level}: the {self.transport.name} backend does not write differential "
                                 "checkpoints; use levels 1-4")
            self.transport.check_level(int(level) - 4)
            return int(level)
        if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or int(level) not in constants.LEVELS:
            if isinstance(level, (int, np.integer)) and int(level) in constants.DCP_LEVELS:
                raise LevelError(f"level {level} (differential checkpointing) needs enable_dcp = 1")
            raise LevelError(f"unknown checkpoint level {level!r}; FTI's levels are 1, 2, 3 and 4")
        level = int(level)
        self.transport.check_level(level)
        return level

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
        try:
            t.wait_post()
            records = self._candidates(None, None)
            if self.config.keep_last_ckpt and records:
                last = records[0]
                if last.level != 4:
                    self._flush_to_l4(last)
                if t.rank == 0:
                    self.state.write_run(state="finalized", keep_last=True)
            else:
                for record in records:
                    self._remove_checkpoint(record)
                if t.rank == 0:
                    self.state.write_run(state="finalized", keep_last=False)
            if self._dcp is not None:
                self._dcp.clear()  # the spares of differential checkpoints
            t.barrier()
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
        seq = t.bcast(self.state.next_seq() if t.rank == 0 else None)
        verdict = check_file(self._rank_file(record), record, t.rank)
        error, entry = "", None
        as_zarr = self.config.l4_format == "zarr"
        if verdict.kind == "ok":
            dst = self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq)
            try:
                if as_zarr:
                    from .levels import zarr_l4

                    written = zarr_l4.flush_file(verdict.parsed, dst / zarr_l4.store_name(record.ckpt_id, t.rank), seq)
                    entry = FileRecord(t.rank, t.node, written.file_size, written.fb.hash.hex()).to_json()
                else:
                    storage.copy_file_atomic(self._rank_file(record), dst / storage.rank_file(record.ckpt_id, t.rank))
            except (OSError, FTIError) as exc:
                error = str(exc)
        else:
            error = verdict.message
        results = t.allgather((error, entry))
        errors = [e for e, _f in results if e]
        if errors:
            raise CheckpointError("keep_last_ckpt: flushing the last checkpoint to L4 failed: " + "; ".join(errors))
        failed = ""
        if t.rank == 0:
            zarr_files = ({"files": tuple(FileRecord(**f) for _e, f in results), "extra": {"l4_format": "zarr"}}
                          if as_zarr else {})
            try:
                self.state.write_record(dataclasses.replace(record, seq=seq, level=4, timestamp=time.time(),
                                                            **zarr_files))
            except OSError as exc:  # a full meta_dir: the last checkpoint stays where it is, committed
                failed = f"writing the commit record in {self.state.records_dir} failed: {exc}"
        failed = next((e for e in t.allgather(failed) if e), "")  # as a barrier; every rank raises the same
        if failed:
            storage.remove_tree(self.paths.level_dir(4, t.node) / storage.ckpt_dirname(record.ckpt_id, seq))
            raise CheckpointError(f"keep_last_ckpt: flushing the last checkpoint to L4 failed: {failed}")

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


def init(config: str | os.PathLike[str] | Config | None = None, *, comm: Any = None, client: Any = None,
         **overrides: Any) -> Context:
    """FTI_Init: read the config (an FTI-style INI file, or defaults) and start or restart a run.

    ``comm`` (an mpi4py communicator) selects the MPI backend, ``client`` (a distributed.Client)
    the Dask backend; with neither, one process. ``verbosity`` set here or in the config file
    (1 debug, 2 a line per checkpoint and recovery, 3 warnings, 4 errors) prints ftidask's log on
    stderr, unless the application has configured :mod:`logging` itself (see
    :func:`ftidask.log_to_stderr`).
    """
    from .config import keys_in_file, load_config

    cfg = load_config(config, **overrides).with_absolute_dirs()  # every backend, MPI heads included
    if isinstance(config, Config):  # built by the application: explicit where it differs from the default
        explicit = "verbosity" in overrides or config.verbosity != Config().verbosity
    else:
        explicit = "verbosity" in overrides or (config is not None and "verbosity" in keys_in_file(config))
    logsetup.apply_verbosity(cfg.verbosity, explicit, 0 if comm is None else _rank_of(comm))
    if comm is not None and client is not None:
        raise FTIError("pass comm= (MPI) or client= (Dask), not both")
    if comm is not None:
        from .transport.mpi import make_mpi_context

        return make_mpi_context(cfg, comm)
    if client is not None:
        from .dask_backend import make_dask_context

        return make_dask_context(cfg, client)
    from .transport.base import SerialTransport

    return Context(cfg, SerialTransport())
