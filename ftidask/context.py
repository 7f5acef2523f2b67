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

from . import constants, storage
from .arrays import ArrayBytes, VarInfo, check_protectable
from .checkpointing import CheckpointInfo, write_rank_file
from .dcpstore import DcpStore
from .config import Config
from .errors import CheckpointError, FTIError, LevelError, NoCheckpointError, ProtectError, RecoveryError
from .ftiff import blockhash, compression, hashing
from .ftiff.reader import FtiffFile
from .layout import Layout, plan_layout
from .pending import OneShotWriter, PendingCheckpoint, RankFileWriter
from .progress import Tracked, tracked
from .recovery import Verdict, check_file, check_sizes, load_file
from .runstate import STATUS_FRESH, CommitRecord, FileRecord, RunState, resolve_run
from .staging import StagingMixin
from .transport.base import Transport

log = logging.getLogger("ftidask")
_VERBOSITY = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_INT32 = (-(2**31), 2**31 - 1)


@dataclasses.dataclass
class Protected:
    """One protected variable."""

    id: int
    name: str
    array: np.ndarray
    compressor: dict[str, Any] | None = None  # numcodecs config; None: the config's [advanced] compressor


def _check_id(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProtectError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if not _INT32[0] <= value <= _INT32[1]:
        raise ProtectError(f"{what} {value} does not fit FTI's 32-bit ids")
    return value


class Context(StagingMixin):
    """One process's handle on a run: protected variables, checkpoints, recovery."""

    def __init__(self, config: Config, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        logging.getLogger("ftidask").setLevel(_VERBOSITY[config.verbosity])
        exec_status = transport.bcast(
            resolve_run(Path(config.meta_dir), config.exec_id) if transport.rank == 0 else None)
        self.exec_id: str = exec_status[0]
        self._status: int = exec_status[1]
        self.paths = storage.RunPaths(Path(config.ckpt_dir), Path(config.glbl_dir), Path(config.meta_dir),
                                      self.exec_id)
        self.state = RunState(Path(config.meta_dir), self.exec_id)
        self._vars: dict[int, Protected] = {}
        self._layout: Layout | None = None
        self._hash_id = hashing.hash_id(config.hash)
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        self._trash_pool: ThreadPoolExecutor | None = None
        self._recovered = False
        self._restart_file: FtiffFile | None = None
        self._restart_record: CommitRecord | None = None
        self.last_checkpoint: CheckpointInfo | None = None
        self.recovered_from: tuple[int, int] | None = None
        self._iteration = 0
        self._last_time = [time.monotonic()] * 4
        self._next_ckpt_id = 1
        self._dcp: DcpStore | None = None
        self._icp: Any = None  # the open incremental checkpoint (ftidask.icp)
        if transport.rank == 0:
            storage.makedirs(self.state.root)
            if self._status == STATUS_FRESH:
                self.state.write_run(state="running", seq=0, keep_last=False)
        transport.barrier()
        self._collect_garbage()
        log.info("ftidask run %s on %s backend, rank %d of %d, status %d", self.exec_id, transport.name,
                 transport.rank, transport.size, self._status)

    # --- protection ----------------------------------------------------------------------------

    def protect(self, id: int, array: Any, name: str | None = None, compressor: Any = None) -> None:
        """FTI_Protect: register ``array`` under ``id`` (again: update its array and size).

        ``compressor`` (``"zstd"``, ``"lz4"``, ``"blosc"``, ``"none"``, a numcodecs codec...) overrides
        ``[advanced] compressor`` for this variable; see :mod:`ftidask.ftiff.compression`.
        """
        self._check_open()
        vid = _check_id(id, "variable id")
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
        ckpt_id = _check_id(id, "checkpoint id")
        if ckpt_id == 0:
            raise CheckpointError("checkpoint id 0 is reserved by FTI; use a non-zero id")
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
                t.protect_files_delta(level, ckpt_id, pending.path, pending.directory,
                                      None if pending.stats is None or pending.error else pending.stats.delta)
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
        if t.rank == 0:
            self.state.write_record(record)  # the commit point
        t.barrier()
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
                              None if stats is None else stats.blocks_total)
        self.last_checkpoint = info
        self._next_ckpt_id = max(self._next_ckpt_id, ckpt_id + 1)
        log.info("checkpoint %d (level %d) written: %d bytes in %.3f s", ckpt_id, pending.level,
                 info.bytes_written, info.seconds)
        return info

    def _dcp_store(self) -> DcpStore:
        """This rank's differential-checkpoint files (created on first use)."""
        if self._dcp is None:
            t = self.transport
            self._dcp = DcpStore(self.paths, t.rank, t.node, block_size=self.config.dcp_block_size,
                                 bid=blockhash.block_hash_id(self.config.dcp_mode), hash_id=self._hash_id)
        return self._dcp

    # --- incremental checkpointing (FTI_InitICP / AddVarICP / FinalizeICP) -------------------------

    def init_icp(self, id: int, level: int) -> None:
        """FTI_InitICP: open checkpoint ``id``; add each protected variable with :meth:`add_var_icp`."""
        from .icp import init_icp

        init_icp(self, id, level)

    def add_var_icp(self, var_id: int) -> None:
        """FTI_AddVarICP: write protected variable ``var_id`` into the open checkpoint now."""
        from .icp import add_var_icp

        add_var_icp(self, var_id)

    def finalize_icp(self) -> CheckpointInfo:
        """FTI_FinalizeICP: commit the open checkpoint (refused if a protected variable is missing)."""
        from .icp import finalize_icp

        return finalize_icp(self)

    def incremental(self, id: int, level: int) -> Any:
        """``with ctx.incremental(id, level) as icp: icp.add(var_id)``: iCP as a context manager."""
        from .icp import Incremental

        return Incremental(self, id, level)

    def _write_zarr_l4(self, path: Path, layout: Layout, arrays: Mapping[int, ArrayBytes], infos: list[VarInfo],
                       *, meta: Mapping[str, Any], **_ignored: Any) -> Any:
        """Level 4 as a Zarr store (``l4_format = zarr``), in place of the FTI-FF file."""
        from .levels import zarr_l4

        bar = next((a.bar for a in arrays.values() if isinstance(a, Tracked)), None)
        return zarr_l4.write_rank_store(path.with_suffix(zarr_l4.SUFFIX), {vid: a.array for vid, a in arrays.items()},
                                        infos, meta, progress=bar)

    def _codecs(self) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Per variable to compress: ``(numcodecs codec, its JSON config)``."""
        default = compression.parse_compressor(self.config.compressor)
        out = {}
        for vid, p in self._vars.items():
            config = p.compressor if p.compressor is not None else default
            if config is not None and config.get("id") != "none" and p.array.nbytes:
                out[vid] = (compression.get_codec(config), config)
        return out

    def _write_full(self, ckpt_id: int, level: int, path: Path, layout: Layout, *, meta: Mapping[str, Any],
                    pt_fs: int | None, max_fs: int | None) -> Any:
        """Write this rank's whole file of a level 1-4 checkpoint (compressed, or as Zarr at L4, if so configured)."""
        zarr_l4 = level == 4 and self.config.l4_format == "zarr"
        codecs = self._codecs()
        infos = [VarInfo.of(vid, p.name, p.array, **({"codec": codecs[vid][1]} if vid in codecs else {}))
                 for vid, p in self._vars.items()]
        write = self._write_zarr_l4 if zarr_l4 else write_rank_file
        streams, bar = tracked({vid: ArrayBytes(p.array) for vid, p in self._vars.items()}, self.config,
                               f"checkpoint {ckpt_id} (L{level})")
        with bar:
            return write(
                path, layout, streams, infos,
                codecs={vid: (codec, self._vars[vid].array.dtype.itemsize) for vid, (codec, _c) in codecs.items()},
                hash_id=self._hash_id, pool=self._hash_pool(), pt_fs=pt_fs, max_fs=max_fs, meta=meta)

    def _hash_pool(self) -> ThreadPoolExecutor:
        # One long-lived thread hashes a container while the caller writes it.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")
        return self._pool

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

    def _retire_older(self, record: CommitRecord) -> None:
        """After a level-L commit, drop earlier checkpoints of levels 1..L (L4 archived if asked)."""
        t = self.transport
        older = t.bcast([r.to_json() for r in self.state.records()] if t.rank == 0 else None)
        for raw in older:
            old = CommitRecord.from_json(raw)
            if old is None or old.seq >= record.seq or old.level > record.level:
                continue
            if old.level == 4 and self.config.keep_l4_ckpt:
                continue
            self._remove_checkpoint(old)

    def _collect_garbage(self) -> None:
        """Remove what interrupted checkpoints left: directories no commit record names, temporary files."""
        t = self.transport
        committed = t.bcast({r.dirname for r in self.state.records()} if t.rank == 0 else None)
        roots = [self.paths.local_dir(level, t.node) for level in (1, 2, 3, 4)]
        if t.rank == 0:
            roots += [self.paths.level_dir(4, 0), self.state.records_dir, self.state.root]
        for root in roots:
            if not root.is_dir():
                continue
            for entry in root.iterdir():
                if entry.name.startswith(storage.TRASH_PREFIX):
                    if self._trash_pool is None:  # else our own remover is on it
                        storage.remove_tree(entry)
                elif entry.name.startswith(".") and ".tmp-" in entry.name:
                    entry.unlink(missing_ok=True)
                elif entry.is_dir() and entry.name.startswith("ckpt") and entry.name not in committed:
                    storage.remove_tree(entry)
                elif entry.is_dir():
                    for tmp in entry.glob(".*.tmp-*"):
                        if tmp.is_dir():  # a Zarr store being written (l4_format = zarr)
                            storage.remove_tree(tmp)
                        else:
                            tmp.unlink(missing_ok=True)
        t.barrier()

    def _remove_checkpoint(self, record: CommitRecord) -> None:
        t = self.transport
        t.barrier()
        if t.rank == 0:
            self.state.delete_record(record.seq)
        t.barrier()
        if self._dcp is not None:  # its file becomes the spare that the next dCP checkpoint patches
            self._dcp.retire(record.level, record.seq, self._rank_file(record), record.ckpt_id)
        if self.config.enable_dcp:
            t.barrier()  # every rank has moved its file out of the shared directories before any is removed
        doomed = [self.paths.level_dir(level, t.node) / record.dirname for level in {record.level, 1, 2, 3}]
        if t.rank == 0:
            doomed.append(self.paths.level_dir(4, 0) / record.dirname)
        for path in doomed:
            trash = storage.move_to_trash(path)
            if trash is not None:
                self._remover().submit(storage.remove_tree, trash)

    def _remover(self) -> ThreadPoolExecutor:
        # Retired checkpoints are deleted off the critical path (they are no longer committed).
        if self._trash_pool is None:
            self._trash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-remove")
        return self._trash_pool

    # --- recovery --------------------------------------------------------------------------------

    def _candidates(self, ckpt_id: int | None, level: int | None) -> list[CommitRecord]:
        t = self.transport
        raw = t.bcast([r.to_json() for r in self.state.records()] if t.rank == 0 else None)
        records = [r for r in (CommitRecord.from_json(x) for x in raw) if r is not None]
        if ckpt_id is not None:
            records = [r for r in records if r.ckpt_id == ckpt_id]
        if level is not None:
            records = [r for r in records if r.level == level]
        return sorted(records, key=lambda r: r.seq, reverse=True)

    def _rank_file(self, record: CommitRecord) -> Path:
        path = (self.paths.level_dir(record.level, self.transport.node) / record.dirname
                / storage.rank_file(record.ckpt_id, self.transport.rank))
        return path.with_suffix(".zarr") if record.extra.get("l4_format") == "zarr" else path

    def _find(self, ckpt_id: int | None = None, level: int | None = None) -> tuple[CommitRecord, Verdict]:
        """The newest committed checkpoint that every rank can verify (or rebuild)."""
        t = self.transport
        reasons = []
        for record in self._candidates(ckpt_id, level):
            verdict = check_file(self._rank_file(record), record, t.rank)
            if verdict.kind != "ok":
                have = t.rebuild_file(record.level, record.ckpt_id, self._rank_file(record),
                                      self._rank_file(record).parent, False, record=record)
                if have:
                    verdict = check_file(self._rank_file(record), record, t.rank)
            else:
                t.rebuild_file(record.level, record.ckpt_id, self._rank_file(record),
                               self._rank_file(record).parent, True, record=record)
            # Consensus: every rank sees every verdict, so that all agree and raise the same error.
            verdicts = t.allgather([verdict.kind, verdict.message])
            if all(k == "ok" for k, _m in verdicts):
                return record, verdict
            bad = [(r, m) for r, (k, m) in enumerate(verdicts) if k != "ok"]
            why = f"{len(bad)} rank(s) cannot verify or rebuild their file, first rank {bad[0][0]}: {bad[0][1]}"
            reasons.append(f"checkpoint {record.ckpt_id} (level {record.level}): {why}")
            log.warning("cannot recover checkpoint %d (level %d): %s", record.ckpt_id, record.level, why)
        what = "no committed checkpoint" if not reasons else "no checkpoint verifies"
        raise NoCheckpointError(f"{what} for run {self.exec_id} in {self.paths.meta_dir}"
                                + (f" (ckpt_id={ckpt_id})" if ckpt_id is not None else "")
                                + (f" (level={level})" if level is not None else "")
                                + ("".join(f"\n  - {r}" for r in reasons)))

    def recover(self, ckpt_id: int | None = None, level: int | None = None) -> dict[int, np.ndarray]:
        """FTI_Recover: fill the protected arrays from the newest checkpoint that verifies.

        Every hash is checked before any array is written; on failure nothing is touched.
        Raises :class:`NoCheckpointError` when nothing can be recovered.
        """
        self._check_open()
        record, verdict = self._find(ckpt_id, level)
        assert verdict.parsed is not None
        arrays = {vid: p.array for vid, p in self._vars.items()}
        problem = check_sizes(verdict.parsed, arrays)
        problems = [p for p in self.transport.allgather(problem) if p]
        if problems:
            raise RecoveryError("; ".join(problems))
        load_file(verdict.parsed, arrays, config=self.config)
        if self.config.enable_dcp:
            self._dcp_store().recovered(record.level, record.seq, self._rank_file(record), verdict.parsed)
        self._layout = verdict.parsed.layout()
        self._recovered = True
        self.recovered_from = (record.ckpt_id, record.level)
        self._next_ckpt_id = max(self._next_ckpt_id, record.ckpt_id + 1)
        log.info("recovered checkpoint %d from level %d", record.ckpt_id, record.level)
        return dict(arrays)

    def recover_file(self, path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
        """Fill the protected arrays from one FTI-FF file (ftidask's, or one written by FTI 1.1).

        For files outside a run's directories, e.g. checkpoints copied by hand. Verified first.
        """
        self._check_open()
        verdict = check_file(Path(path), None, self.transport.rank)
        if verdict.kind != "ok" or verdict.parsed is None:
            raise RecoveryError(f"cannot recover from {os.fspath(path)}: {verdict.message}")
        arrays = {vid: p.array for vid, p in self._vars.items()}
        problem = check_sizes(verdict.parsed, arrays)
        if problem:
            raise RecoveryError(problem)
        load_file(verdict.parsed, arrays)
        self._layout = verdict.parsed.layout()
        self._recovered = True
        return dict(arrays)

    def _restart_metadata(self) -> FtiffFile:
        if self._restart_file is None:
            self._restart_file = self._find()[1].parsed
        assert self._restart_file is not None
        return self._restart_file

    def stored_size(self, id: int) -> int:
        """FTI_GetStoredSize: bytes of variable ``id`` in the checkpoint (last written, or to recover)."""
        self._check_open()
        vid = _check_id(id, "variable id")
        if self._layout is not None and self._restart_file is None and (self.last_checkpoint or self._recovered):
            sizes = {s.var_id: 0 for s in self._layout.slots()}
            for s in self._layout.slots():
                sizes[s.var_id] += s.chunksize
        else:
            sizes = self._restart_metadata().var_nbytes()
        if vid not in sizes:
            raise RecoveryError(f"variable {vid} is not in the checkpoint (it holds ids {sorted(sizes)})")
        return sizes[vid]

    def realloc(self, id: int, array: Any = None) -> np.ndarray:
        """FTI_Realloc: a new array of the stored size, which becomes the protected one."""
        self._check_open()
        vid = _check_id(id, "variable id")
        parsed = self._restart_metadata()
        info = parsed.vars.get(vid)
        if info is not None:
            new = info.empty()
        else:
            nbytes = parsed.var_nbytes().get(vid)
            if nbytes is None:
                raise RecoveryError(f"variable {vid} is not in the checkpoint")
            dtype = (array.dtype if isinstance(array, np.ndarray) else
                     self._vars[vid].array.dtype if vid in self._vars else np.dtype(np.uint8))
            if nbytes % dtype.itemsize:
                raise RecoveryError(f"variable {vid}: {nbytes} stored bytes are not a whole number of {dtype}")
            new = np.empty(nbytes // dtype.itemsize, dtype)
        if isinstance(array, np.ndarray) and array.dtype == new.dtype and array.shape == new.shape:
            new = array
        name = info.name if info is not None else None
        self.protect(vid, new, name=name if vid not in self._vars else self._vars[vid].name)
        return new

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
        self._staging_report(staging_failed)

    def _close(self) -> None:
        self._closed = True
        self._icp = None
        if self._dcp is not None:
            self._dcp.close()
        for pool in (self._pool, self._trash_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._trash_pool = None
        self.transport.close()

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
        if t.rank == 0:
            zarr_files = ({"files": tuple(FileRecord(**f) for _e, f in results), "extra": {"l4_format": "zarr"}}
                          if as_zarr else {})
            self.state.write_record(dataclasses.replace(record, seq=seq, level=4, timestamp=time.time(), **zarr_files))
        t.barrier()

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


def init(config: str | os.PathLike[str] | None = None, *, comm: Any = None, client: Any = None,
         **overrides: Any) -> Context:
    """FTI_Init: read the config (an FTI-style INI file, or defaults) and start or restart a run.

    ``comm`` (an mpi4py communicator) selects the MPI backend, ``client`` (a distributed.Client)
    the Dask backend; with neither, one process.
    """
    from .config import load_config

    cfg = load_config(config, **overrides)
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
