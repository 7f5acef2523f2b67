"""The recovery calls of a :class:`ftidask.Context` (FTI_Recover, FTI_RecoverVar, FTI_GetStoredSize, FTI_Realloc,
FTI_Status, and :meth:`~RecoveryCalls.recover_file`): a mixin over the context's
:class:`~ftidask.engine.recovering.Recovery`, which does the work (see docs/api.md).

Separate from :mod:`ftidask.api.context` so that the context module keeps room for its other areas
(protection, checkpoints, finalize); the Dask backend overrides these calls in its own context.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..engine.asyncckpt import AsyncCheckpoints
from ..engine.filerecovery import PreparedFile
from ..engine.icp import IcpSlot
from ..engine.recovering import Progress, Recovery
from ..engine.recoverplan import var_id_of
from ..engine.runstate import STATUS_FRESH, CommitRecord
from ..model.arrays import check_bool, check_id
from ..model.errors import RecoveryError
from ..transport.base import Transport
from ..transport.collective import agree_call
from .callguard import one_at_a_time


class RecoveryCalls:
    """The recovery methods of a context, which holds ``recovery``, ``progress``, ``transport``, ``_status``,
    ``_icp_slot``, ``_async`` and ``_check_open``."""

    recovery: Recovery
    progress: Progress
    transport: Transport
    _status: int
    _icp_slot: IcpSlot
    _async: AsyncCheckpoints

    def _check_open(self) -> None:  # the context's own
        raise NotImplementedError

    @property
    def recovered_from(self) -> tuple[int, int] | None:
        """``(ckpt_id, level)`` of the checkpoint recovered last, or None."""
        return self.progress.recovered_from

    def status(self) -> int:
        """FTI_Status: 0 fresh start (or after a full recover(), as FTI), 1 restart, 2 restart from a kept L4 one."""
        return STATUS_FRESH if self.progress.recovered_all else self._status

    @one_at_a_time
    def recover(self, ckpt_id: int | None = None, level: int | None = None, *,
                ids: int | Iterable[int] | None = None) -> dict[int, Any]:
        """FTI_Recover: fill the protected arrays (and Python states) from the newest checkpoint that verifies.

        ``ids`` (FTI_RecoverVar): recover only these variables, the others untouched. Every hash is checked before any
        array is written; on failure nothing is touched. Raises :class:`NoCheckpointError` when nothing can be
        recovered. A full recovery sets :meth:`status` to 0, as FTI_Recover does."""
        return self._recover(ckpt_id, level, ids, lambda: None)

    def _recover(self, ckpt_id: Any, level: Any, ids: Any, check: Any) -> dict[int, Any]:
        """recover(), with ``check`` of the caller's own arguments made with the others (collective)."""
        self._check_open()
        self._async.quiesce()  # never a checkpoint half written by this run, or raised by a head

        def refusals() -> None:  # with the arguments', so that a rank refused tells the others (never a wait)
            self._icp_slot.check_none_open(RecoveryError)  # the checkpoint would mix values from before and after
            check()

        out = self.recovery.recover(ckpt_id, level, ids, refusals)
        self.progress.recovered_all |= ids is None  # FTI_RecoverVar leaves FTI_Status as it is
        self.progress.recovered_ids.update(out)  # what snapshot() no longer recovers
        return out

    @one_at_a_time
    def recover_var(self, id: int, ckpt_id: int | None = None, level: int | None = None) -> Any:
        """FTI_RecoverVar: recover variable ``id`` only (every other protected variable is untouched). Raises
        :class:`NoCheckpointError` where FTI returns FTI_NSCS: on a fresh start, nothing is committed to recover."""
        vid: list[int] = []  # checked in recover's first step: a rank refused tells the others (never a wait)
        out = self._recover(ckpt_id, level, [id], lambda: vid.append(var_id_of(id, "recover_var(...)")))
        return out[vid[0]]

    @one_at_a_time
    def recover_file(self, path: str | os.PathLike[str], meta: str | os.PathLike[str] | None = None,
                     rank: int | None = None) -> dict[int, Any]:
        """Fill the protected arrays from one checkpoint file, outside the run's checkpoints (this rank only).

        ``path`` is an FTI-FF file, written by ftidask or by FTI (1.1 or later), or a Zarr store of level 4. With
        ``meta`` (a meta file ``sector*-group*.fti``, or its directory), a file of FTI's POSIX I/O (a rank file, a
        partner copy, a differential ``dcp-id*-rank*.fti``) or FTI's MPI-IO file ``Ckpt{id}-mpiio.fti``, whose part
        ``rank`` (default: this context's rank; given for that file only) is read. Every byte is verified against
        its hash (FTI's files: their MD5 in the meta file) before any array is touched. Raises
        :class:`RecoveryError` for an argument refused, a file damaged or not one of these, or one whose
        variables do not fit those protected; nothing is touched then. Returns the recovered arrays by id
        (docs/format.md)."""
        return self._prepare_file(path, meta, rank).load()

    def _prepare_file(self, path: str | os.PathLike[str], meta: str | os.PathLike[str] | None = None,
                      rank: int | None = None) -> PreparedFile:
        """:meth:`recover_file` up to the first array written: the file verified and checked against the protected
        arrays; its ``load()`` fills them (:func:`ftidask.tools.fti_run.recover_fti_run`'s ranks agree between)."""
        self._file_checks()
        return self.recovery.prepare_file(path, meta, rank)

    def _file_checks(self) -> None:
        """What a recovery from a file refuses before any file is looked at: a closed context, an open iCP."""
        self._check_open()
        self._icp_slot.check_none_open(RecoveryError)  # as recover(): the iCP would commit a mix of both
        self._async.drain()

    @one_at_a_time
    def stored_size(self, id: int, *, total: bool = False) -> int:
        """FTI_GetStoredSize: bytes of variable ``id`` in this rank's file of the checkpoint (last written, or to
        recover), 0 if none; ``total=True``: the job's, summed over the ranks (collective: every rank asks it)."""
        self._check_open()
        if total is not False:  # a collective sum: the ranks agree on the call first (a refused argument: everywhere)
            agree_call(self.transport, "stored_size", lambda: ({}, (check_id(id, "variable id"), check_bool(
                total, "stored_size(total=...)", RecoveryError))), RecoveryError)
        self._async.quiesce()
        size = self.recovery.stored_size(id)  # the id checked there, after the ranks' collective read
        return sum(self.transport.allgather(size)) if total else size

    @one_at_a_time
    def realloc(self, id: int, array: Any = None) -> Any:
        """FTI_Realloc: a new array of the stored size (``array`` itself where it already fits; without ``array``,
        the protected one where it fits, its values kept), which becomes the protected one; for a Python state
        (``State``, ``Value``, a generator), the protected object itself. On a fresh start (nothing committed,
        :meth:`stored_size` 0) it raises :class:`NoCheckpointError`, as recover() does."""
        self._check_open()
        self._async.quiesce()
        return self.recovery.realloc(id, array)  # the id checked there, with the other ranks

    def _rank_file(self, record: CommitRecord) -> Path:  # this rank's file of ``record`` (the tests corrupt it)
        return self.recovery.rank_file(record)
