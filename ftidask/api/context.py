"""The FTI API in Python's idiom: a :class:`Context` made by :func:`ftidask.init`."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import icp
from ..engine.asyncckpt import AsyncCheckpoints
from ..engine.checkpointing import CheckpointInfo
from ..engine.claim import claim_everywhere
from ..engine.commit import Committer
from ..engine.dcpstore import DcpSlot, DcpStore
from ..engine.inflight import CheckpointHandle
from ..engine.recovering import Progress, Recovery
from ..engine.retention import Retention, RetentionFactory
from ..engine.run import Run
from ..engine.runstate import STATUS_FRESH, CommitRecord, RunState
from ..engine.schedule import SnapshotSchedule
from ..engine.variables import Protected, check_name, protected_var, user_array
from ..engine.vartable import VarTable
from ..engine.writing import Writer
from ..ftiff import hashing
from ..model import constants
from ..model.arrays import check_id
from ..model.config import Config
from ..model.errors import FTIError
from ..model.level import Level
from ..staging.stager import Staging
from ..storage import dirchecks
from ..storage import files as storage
from ..storage.runlock import RunLock
from ..transport.base import Transport
from ..transport.collective import agree_call
from . import abandoned, display, lifecycle, logsetup
from .callguard import CallGuard, one_at_a_time
from .names import VarNames, restart_names
from .recovercalls import RecoveryCalls
from .stagecalls import StagingCalls

log = logging.getLogger("ftidask")


class Context(RecoveryCalls, StagingCalls):
    """A handle on a run, what :func:`ftidask.init` returns (the MPI and Dask backends' contexts are ones too):
    protected variables, checkpoints, recovery and staging, FTI's calls as methods (see docs/guide.md)."""

    def __init__(self, config: Config, transport: Transport, *, retention: RetentionFactory = Retention) -> None:
        """``retention`` makes the collaborator that retires checkpoints (a backend with files elsewhere: its own)."""
        self._calls = CallGuard()  # one API call at a time (api/callguard.py)
        self._closed = False
        self._pid = os.getpid()  # the process whose run this is (a forked child's copy must not write it)
        self._unfinished: BaseException | None = None  # why the context closed with its run not finalized
        self._run_lock: RunLock | None = None
        config = config.with_absolute_dirs()  # a later os.chdir of the application moves nothing
        self.config = config
        self.transport = transport
        logsetup.apply_verbosity(config.verbosity, False, transport.rank)
        storage.set_permissions(config.permissions)
        dirchecks.check(transport, [Path(config.ckpt_dir), Path(config.glbl_dir), Path(config.meta_dir)], True)
        self.exec_id, self._status, self._run_lock = claim_everywhere(transport, Path(config.meta_dir),
                                                                      config.exec_id, bool(config.enable_dcp))
        self.paths = storage.RunPaths(Path(config.ckpt_dir), Path(config.glbl_dir), Path(config.meta_dir),
                                      self.exec_id)
        lifecycle.settle_older(self)  # an older context of this process on this run: its checkpoint in flight committed
        self.state = RunState(Path(config.meta_dir), self.exec_id)
        dirchecks.check(transport, dirchecks.run_dirs(self.paths, transport.node, self.state.records_dir))
        self._vars: dict[int, Protected] = VarTable()  # names indexed (var_id, protect(..., name=...))
        self._names = VarNames()  # ids given by name (var_id)
        self._hash_id = hashing.hash_id(config.hash)
        self._writer = Writer(config, transport, self.paths, self._vars, self._hash_id)
        # No collaborator holds the context: dropping an unfinalized context releases the run lock at once.
        self._spares = DcpSlot(self._writer.new_dcp_store)
        self.progress = Progress()  # internal: what the last commit or recovery left (backends update it)
        run = Run(transport, self.paths, self.state, config, self._spares)
        self.recovery = Recovery(run, self._vars, self.progress)  # internal: the backends' recovery uses it
        self._retention = retention(run)
        self._committer = Committer(run, self._vars, self.progress, self._writer, self._retention)
        self._async = AsyncCheckpoints(run, self.progress, retention, self._hash_id)
        self._async.inflight.keep_while_busy(self)  # a context dropped with a checkpoint in flight lives until it ends
        self._staging = Staging(config, transport, self.paths.stage_root)
        self._schedule = SnapshotSchedule(config, transport)
        self._icp_slot = icp.IcpSlot()  # the open incremental checkpoint, whichever backend opened it
        self._icp = icp.IncrementalCheckpoints(self._icp_slot, self._vars, self._committer, self._async.settle,
                                               functools.partial(icp.checked_level, dcp=False, transport=transport,
                                                                 enable_dcp=bool(config.enable_dcp)))
        transport.barrier()
        lifecycle.register(self)  # a second context of this run in this process: its finalize leaves the run alone
        self._retention.collect_garbage()
        abandoned.sweep(transport, self.paths, self._retention)  # dead runs that never committed (side runs)
        log.info("run %s: %s (%s backend, %s)", self.exec_id,
                 "fresh start" if self._status == STATUS_FRESH else f"restart (status {self._status})",
                 transport.name, transport.ranks_text())

    # --- protection ----------------------------------------------------------------------------

    @one_at_a_time
    def protect(self, id: int, array: Any, name: str | None = None, compressor: Any = None, *,
                global_shape: Any = None, offset: Any = None, replicated: bool = False) -> None:
        """FTI_Protect: register ``array`` under ``id`` (again: update its array and size).

        ``compressor`` (``"zstd"``, ``"lz4"``, ``"blosc"``, ``"none"``, a numcodecs codec...) overrides
        ``[advanced] compressor`` for this variable; see docs/zarr.md.
        ``global_shape`` and ``offset`` (or ``global_shape=ftidask.Block(shape, offset)``) declare the
        array as a block of a global array, ``replicated=True`` as held whole by every rank: a restart
        on another number of ranks then redistributes it (see docs/mpi.md).
        ``array`` may also be Python state, stored as JSON and recovered in place: an
        ``ftidask.State`` (or dict) or ``ftidask.Value`` of JSON values, or a ``numpy.random``
        Generator/BitGenerator (its state); anything else is refused (never pickled). A state that every
        rank holds alike, protected with ``replicated=True``, comes back on another number of ranks too.
        """
        self._check_open()
        vid = check_id(id, "variable id")
        name = name if name is not None else self._names.name_of(vid)
        check_name(name, vid, self._vars, self._names.owner(name))
        self._names.check_default(vid, name, self._vars)
        self._vars[vid] = protected_var(vid, array, name, compressor, self._vars.get(vid), global_shape=global_shape,
                                        offset=offset, replicated=replicated)

    def var_id(self, name: str, *, create: bool = True) -> int | None:
        """FTI_setIDFromString / FTI_getIDFromString (``create=False``): the id named ``name``, else a new one or
        None (docs/guide.md). On a restart, on MPI, every rank calls the first one (collective)."""
        self._check_open()
        return self._names.id_for(name, self._vars, create, self._stored_names)

    def _stored_names(self) -> dict[int, str]:  # the Dask backend reads its commit records instead
        self._async.quiesce()  # a recovery's search: never beside a checkpoint committing, retiring or raised
        return restart_names(self._status, self.recovery)

    @property
    def protected(self) -> Mapping[int, np.ndarray]:
        """The protected arrays (and Python-state objects) by id, in protection order."""
        return {vid: p.state.obj if p.state is not None else user_array(p) for vid, p in self._vars.items()}

    @property
    def variables(self) -> dict[int, Protected]:
        """Internal: the protected variables as registered, the context's own dict (for the backends'
        writing and recovery, which may register recovered arrays in it)."""
        return self._vars

    @property
    def last_checkpoint(self) -> CheckpointInfo | None:
        """The last checkpoint this context wrote (its id, level, bytes and time), or None."""
        return self.progress.last_checkpoint

    @last_checkpoint.setter
    def last_checkpoint(self, info: CheckpointInfo | None) -> None:
        """Set what :attr:`last_checkpoint` reports (a :class:`CheckpointInfo`, or None)."""
        self.progress.last_checkpoint = info

    @property
    def finalized(self) -> bool:
        """Whether :meth:`finalize` ran (or the context was closed after an error)."""
        return self._closed

    # --- checkpoint ------------------------------------------------------------------------------

    @one_at_a_time
    def checkpoint(self, id: int, level: int, *, dcp: bool = False,
                   wait: bool | None = None) -> CheckpointInfo | CheckpointHandle:
        """FTI_Checkpoint: write every protected variable as checkpoint ``id`` at ``level``.

        Levels 5-8 (FTI's L1_DCP..L4_DCP), or ``dcp=True`` with levels 1-4, write a differential
        checkpoint (``enable_dcp = 1``): only the blocks that changed since the file being updated.

        ``wait=False`` (or ``[advanced] async_ckpt = 1``) returns a :class:`CheckpointHandle` as soon as
        a snapshot of every protected variable is taken: the arrays may be changed at once, the
        checkpoint holds their values at the call (see docs/async.md). Otherwise the checkpoint is
        committed when this returns its :class:`CheckpointInfo`.
        """
        self._check_open()
        ckpt_id, parsed, asynchronous = icp.agreed_request(  # collective: every rank the same id, level and wait
            self.transport, "checkpoint", id, lambda: self._check_level(level, dcp), self._icp_slot, wait=wait,
            asynchronous=lambda: self._asynchronous(wait))
        if asynchronous:
            return self._checkpoint_async(ckpt_id, parsed)
        self._async.settle()
        return self._committer.checkpoint(ckpt_id, parsed)

    def _checkpoint_async(self, ckpt_id: int, level: Level) -> CheckpointHandle:
        self._icp_slot.check_none_open()
        copies, state_error = self._async.encode_at_call(self._vars, level, self.transport.rank)  # values at the call

        def blocking() -> CheckpointInfo:
            self._async.settle()
            return self._committer.checkpoint(ckpt_id, level)

        return self._async.submit(ckpt_id, level, self._vars, state_error, blocking, copies)

    def _asynchronous(self, wait: bool | None) -> bool:  # wait=None: as async_ckpt says
        return wait is False or (wait is None and self.config.async_ckpt)

    @one_at_a_time
    def wait(self) -> None:
        """Wait until every asynchronous checkpoint in flight is committed (or failed); raise the first
        failure whose handle nobody asked (:class:`CheckpointError`)."""
        self._check_open()
        self._async.settle()

    @property
    def _dcp(self) -> DcpStore | None:  # this rank's dCP store, if made (the Dask backend puts its spares here)
        return self._spares.store

    @_dcp.setter
    def _dcp(self, store: DcpStore | None) -> None:
        self._spares.store = store

    def _check_level(self, level: Any, dcp: bool = False) -> Level:
        """The level a checkpoint asks for (1-4; 5-8 or ``dcp=True`` with enable_dcp), refused if unavailable."""
        return icp.checked_level(level, dcp, enable_dcp=bool(self.config.enable_dcp), transport=self.transport)

    # --- incremental checkpointing (FTI_InitICP / AddVarICP / FinalizeICP: ftidask.engine.icp) -------------

    @one_at_a_time
    def init_icp(self, id: int, level: int, activate: bool = True) -> None:
        """FTI_InitICP: open checkpoint ``id`` for :meth:`add_var_icp`; ``activate`` false: the next do nothing."""
        self._check_open()
        self._icp.init(id, level, activate)

    @one_at_a_time
    def add_var_icp(self, var_id: int) -> None:
        """FTI_AddVarICP: write protected variable ``var_id`` into the open checkpoint now."""
        self._check_open()
        self._icp.add(var_id)

    @one_at_a_time
    def finalize_icp(self) -> CheckpointInfo | None:
        """FTI_FinalizeICP: commit the open checkpoint (refused if a variable is missing); None if not activated."""
        self._check_open()
        return self._icp.finalize()

    def _abort_icp(self, why: str = "") -> None:
        """Drop the open incremental checkpoint without committing it (the previous one stays); ``why``: on an
        exception of the application, on every rank (collective)."""
        if why:
            self._icp.drop(why)
        else:
            self._icp.abort()

    def incremental(self, id: int, level: int) -> icp.Incremental:
        """``with ctx.incremental(id, level) as icp: icp.add(var_id)``: iCP as a context manager."""
        return icp.Incremental(self, id, level)

    # --- snapshot and finalize ---------------------------------------------------------------------

    @one_at_a_time
    def snapshot(self) -> int:
        """FTI_Snapshot: recover on a restart, otherwise checkpoint the levels that are due.

        After ``recover(ids=...)`` or ``recover_var`` on a restart, it recovers the other protected variables only,
        from the same checkpoint: never again those recovered, which the application may have changed since (a
        checkpoint committed since ends the restart: nothing more is recovered).

        Returns FTI_SCES (nothing to do, or recovered) or FTI_DONE (a checkpoint was written).
        """
        self._check_open()
        self._async.inflight.raise_unobserved()
        pr = self.progress
        if self._status != STATUS_FRESH and not pr.recovered_all:  # a restart whose recovery is not complete
            rest = [vid for vid in self._vars if vid not in pr.recovered_ids]
            self._async.inflight.drain()  # a checkpoint in flight commits first: then it ends the restart below
            with self._calls.nested("recover"):
                if not pr.recovered and pr.last_checkpoint is None:  # (else: never roll back what it wrote)
                    self.recover()
                elif rest and pr.last_checkpoint is None:
                    # the others from the same checkpoint; never again those recovered, which may have changed since
                    self.recover(*(pr.recovered_from or (None, None)), ids=rest)
            pr.recovered_all = True  # every variable recovered: FTI_Status is 0, as after FTI_Snapshot's recovery
            return constants.FTI_SCES
        due = self._schedule.due()
        if not due:
            return constants.FTI_SCES
        with self._calls.nested("checkpoint"):
            self.checkpoint(max(self.progress.next_ckpt_id, self._async.next_id), due[-1])  # FTI's precedence
        self._schedule.written()
        return constants.FTI_DONE

    @one_at_a_time
    def finalize(self) -> None:
        """FTI_Finalize: flush the last checkpoint to L4 if ``keep_last_ckpt``, else clean up; close the context.

        Once the ranks agree on the call, the context ends closed whatever happens, as FTI_Finalize tears down: its
        run lock released, its threads and channels stopped. Should the clean-up fail (or be interrupted), its error
        is raised and the run keeps its checkpoints; a later ``finalize()`` raises :class:`FTIError` saying so (a
        closed context cannot retry): ``ftidask.init(..., exec_id=...)`` restarts the run and its ``finalize()``
        cleans up. Refused at the ranks' call check (MPI: another rank is in another call), the context stays open.
        While another context of this process holds the run (a second init of it), it closes this one only.
        """
        if self._closed:
            if self._unfinished is not None:
                raise lifecycle.unfinished_error(self._unfinished, self.exec_id)
            return
        if os.getpid() != self._pid:  # a forked child (its with block ending): the run is its parent's, left alone
            log.warning("finalize() in process %d, forked from process %d whose context this is: closed here only, "
                        "the run's checkpoints are its parent's", os.getpid(), self._pid)
            self._unfinished = lifecycle.forked_error(self._pid)
            self._close()
            return
        agree_call(self.transport, "finalize", lambda: ({}, None), FTIError)  # not beside another rank's checkpoint
        try:
            staging_failed, cleaned = lifecycle.end_run(self)
        except BaseException as exc:  # a Ctrl-C too: the run is left as it is, for a restart
            self._unfinished = exc
            raise
        finally:
            self._close()
        if cleaned:
            self._retention.prune_run_dirs()
        self._staging.report(staging_failed)
        self._async.inflight.raise_unobserved()

    def _close(self) -> None:
        """Close every part, even when one fails (the first error raised after): never a lock held for good."""
        self._closed = True
        dcp = self._dcp
        lifecycle.close_all([
            self._icp.close,  # an incremental checkpoint left open is dropped, its file closed
            self._async.close,  # what is in flight is finished first
            dcp.close if dcp is not None else None,
            self._writer.close,
            self._retention.close,
            self.transport.close,
            self._run_lock.release if self._run_lock is not None else None,  # last: no longer written by us
        ])

    def _flush_to_l4(self, record: CommitRecord) -> None:
        """keep_last_ckpt: copy the last checkpoint to L4, its lost L2/L3 files rebuilt first (the Dask backend has
        its own)."""
        self.recovery.repair(record)
        self._committer.flush_to_l4(record, self.recovery.rank_file(record))

    @property
    def comm(self) -> Any:
        """The communicator the application must use (FTI_COMM_WORLD: heads excluded); None without MPI.

        Its ranks need not be those of the communicator given to ``init``: a restart on the run's hosts in another
        order renumbers the processes as the checkpoint placed them, so that each rank finds its node-local files
        (FTI_ReorderNodes, docs/mpi.md)."""
        return getattr(self.transport, "comm", None)

    def wait_post_processing(self) -> dict[str, Any] | None:
        """Wait for the heads' post-processing of the last checkpoint: their reply ``{"ok", "error", ...}``, or None
        (no heads, or the last checkpoint needed no post-processing)."""
        self._async.drain()  # the background's request too: its transport shares the head's state
        return self.transport.wait_post()

    def post_processing_done(self) -> bool:
        """Whether the head has finished post-processing the last checkpoint (never blocks; False while an
        asynchronous checkpoint is still being written: its request to the head is not even sent)."""
        return not self._async.inflight.busy and self.transport.post_done()

    def _check_open(self) -> None:
        if self._closed:
            if self._unfinished is not None:
                raise lifecycle.unfinished_error(self._unfinished, self.exec_id)
            raise FTIError("this context is finalized; call ftidask.init() again (with MPI heads: once per job)")
        if os.getpid() != self._pid:  # its checkpoint retired the parent's, its commit raced the parent's in flight
            raise lifecycle.forked_error(self._pid)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:  # died with an error: the checkpoints stay, for the next run to restart
            with self._calls.enter("__exit__"):  # once another thread's call in progress ends (never closed under it)
                lifecycle.close_after_error(self, exc)

    __repr__ = display.context_repr  # one line in a terminal; never raises, computes nothing (api/display.py)
    _repr_html_ = display.context_html  # a table in a notebook
