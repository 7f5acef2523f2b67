"""Incremental checkpointing (FTI's InitICP / AddVarICP / FinalizeICP).

A checkpoint is opened, each protected variable is written as soon as the application is done
with it (any order; the array may change right after), and the checkpoint is committed at the
end. Nothing is visible to recovery before that commit: a checkpoint that misses a protected
variable is refused there, and the previous checkpoint stays the newest one. Differential levels
(5-8) work too: each variable's changed blocks are written when it is added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.arrays import check_ckpt_id, check_id
from ..model.errors import CheckpointError, FTIError, ProtectError
from ..model.level import Level
from ..storage.files import remove_tree
from ..transport.collective import agree_call, reason
from .variables import download

if TYPE_CHECKING:
    from ..api.context import Context
    from ..transport.base import Transport
    from .checkpointing import CheckpointInfo
    from .commit import Committer
    from .pending import PendingCheckpoint
    from .variables import Protected


_DROPPED = "dropped on an exception"  # a rank's drop, which makes the others' finalize_icp drop theirs too


class IcpSlot:
    """The incremental checkpoint a context has open, at most one (any backend's kind of it)."""

    def __init__(self) -> None:
        self.current: Any = None
        #: init_icp(..., activate=False) was the last call: FTI's FTI_ICP_NINI, in which FTI_AddVarICP and
        #: FTI_FinalizeICP return FTI_SCES and write nothing (loops call the three at every iteration).
        self.inactive = False

    def skip(self) -> None:
        """init_icp(..., activate=False): the following add and finalize calls do nothing."""
        self.check_none_open()
        self.inactive = True

    def skipping(self) -> bool:
        """Whether add and finalize do nothing (an inactive init_icp, nothing open)."""
        return self.current is None and self.inactive

    def check_none_open(self, error: type[FTIError] = CheckpointError) -> None:
        """Refuse to start a checkpoint (or a recovery: ``error``) while an incremental one is open."""
        if self.current is not None:
            raise error(f"incremental checkpoint {self.current.ckpt_id} is open; finalize_icp() first")

    def get(self) -> Any:
        """The open incremental checkpoint, or a :class:`CheckpointError`."""
        if self.current is None:
            raise CheckpointError("no incremental checkpoint is open; call init_icp(id, level) first")
        return self.current

    def take(self) -> Any:
        """The open incremental checkpoint (or None), no longer open."""
        current, self.current = self.current, None
        return current


def protected_var(variables: Mapping[int, Any], var_id: Any) -> Any:
    """The protected variable ``var_id`` to add, or a :class:`ProtectError`."""
    protected = variables.get(check_id(var_id, "add_var_icp: variable id"))
    if protected is None:
        raise ProtectError(f"variable {var_id!r} is not protected; protect it before init_icp")
    return protected


def check_activate(activate: Any) -> None:
    """init_icp's ``activate``: a bool ("no" would be true, and open a checkpoint the program meant to skip)."""
    if not isinstance(activate, (bool, np.bool_)):
        raise CheckpointError(f"init_icp(activate=...) takes True or False, got {activate!r}")


def checked_level(level: Any, dcp: bool, *, enable_dcp: bool, transport: Transport) -> Level:
    """The level a checkpoint asks for, parsed once (1-4; 5-8 or ``dcp=True`` with enable_dcp), and
    refused here when ``transport`` cannot provide it."""
    parsed = Level.parse(level, dcp=dcp, enable_dcp=enable_dcp)
    transport.check_level(parsed.base)
    return parsed


def agreed_request(transport: Transport, call: str, ckpt_id: Any, level: Callable[[], Level], slot: IcpSlot,
                   wait: Any = None, asynchronous: Callable[[], bool] = bool,
                   also: Callable[[], dict[str, Any]] = dict) -> tuple[int, Level, bool]:
    """Checkpoint ``ckpt_id`` at the parsed ``level()`` (and whether it is asynchronous), once every rank is
    known to ask for the same (collective: :func:`~ftidask.transport.collective.agree_call`). Ranks that asked
    for another id or level would each commit a checkpoint of their own that no recovery finds. ``also``: more
    checked arguments every rank must give alike (init_icp's ``activate``)."""
    def step() -> tuple[dict[str, Any], tuple[int, Level, bool]]:
        checked, parsed = check_ckpt_id(ckpt_id), level()
        if wait is not None and not isinstance(wait, (bool, np.bool_)):
            raise CheckpointError(f"{call}(wait=...) takes True, False or None, got {wait!r}")
        slot.check_none_open()
        out = (checked, parsed, asynchronous())
        shared = {"id": checked, "level": parsed.number, **({"wait": not out[2]} if call == "checkpoint" else {})}
        return {**shared, **also()}, out

    return agree_call(transport, call, step, CheckpointError)


class IncrementalCheckpoints:
    """FTI's InitICP / AddVarICP / FinalizeICP over the checkpoint protocol (one process or MPI ranks).

    Made of the context's collaborators, never of the context itself: no collaborator holds the
    context, so an unfinalized context dropped releases its run lock at once."""

    def __init__(self, slot: IcpSlot, variables: Mapping[int, Protected], committer: Committer,
                 settle: Callable[[], None], check_level: Callable[[int], Level]) -> None:
        self.slot, self.variables, self.committer = slot, variables, committer
        self._settle, self._check_level = settle, check_level

    def init(self, ckpt_id: int, level: int, activate: bool = True) -> None:
        """Open incremental checkpoint ``ckpt_id`` at ``level`` (levels 1-8, as for checkpoint); with
        ``activate`` false, nothing is opened and add and finalize do nothing (the arguments are still checked)."""
        def checked_level() -> Level:
            check_activate(activate)
            return self._check_level(level)

        # Collective, activate false too (FTI_InitICP then writes nothing): every rank the same id, level and
        # activate, or a rank that skips would leave the others' next collective paired with its next call.
        ckpt_id, parsed, _ = agreed_request(self.committer.transport, "init_icp", ckpt_id, checked_level, self.slot,
                                            also=lambda: {"activate": bool(activate)})
        if not activate:
            self.slot.skip()
            return
        self.slot.inactive = False
        self._settle()  # nothing may be in flight
        self.slot.current = self.committer.begin(ckpt_id, parsed, True)

    def add(self, var_id: int) -> None:
        """Write protected variable ``var_id`` into the open checkpoint now."""
        if self.slot.skipping():
            return
        pending: PendingCheckpoint = self.slot.get()
        protected = protected_var(self.variables, var_id)
        if pending.error:
            return  # reported, on every rank together, by finalize
        try:
            problem = download(protected, self.committer.transport.rank) if protected.device is not None else ""
            if problem:  # a device array: its value at this call (init_icp brought the values of then)
                raise OSError(problem)
            pending.write_var(protected.id, protected.name, protected.array)
        except CheckpointError:
            raise  # this call was wrong (variable added twice, resized): the checkpoint stays open
        except Exception as exc:  # noqa: BLE001 - any failure of the write: reported on every rank by finalize
            pending.error = f"rank {self.committer.transport.rank}: {reason(exc)}"

    def finalize(self) -> CheckpointInfo | None:
        """Commit the open checkpoint; a :class:`CheckpointError` (previous one kept) if a variable is missing.
        None after an inactive init."""
        def step() -> tuple[dict[str, Any], PendingCheckpoint | None]:
            return ({"active": False}, None) if self.slot.skipping() else ({"active": True}, self.slot.get())

        # Collective: a rank in another call (or with nothing open) would pair the commit's collectives with it.
        # Dropped by a rank on an exception (:meth:`drop`), it is dropped on every rank.
        try:
            pending = agree_call(self.committer.transport, "finalize_icp", step, CheckpointError)
        except CheckpointError as exc:  # (ranks in other calls: it stays open, finalize_icp can be called again)
            if _DROPPED in str(exc) and self.slot.current is not None:
                self.abort()
            raise
        if pending is None:
            self.slot.inactive = False
            return None
        self.slot.take()
        missing = sorted(set(pending.sizes) - pending.written)
        late = sorted(set(self.variables) - set(pending.sizes))  # a restart protecting them could not recover it
        if (missing or late) and not pending.error:
            said = ([f"variables {missing} never added"] if missing else []) + (
                [f"variables {late} protected after init_icp (a checkpoint begun after it holds them)"] if late else [])
            pending.error = (f"rank {self.committer.transport.rank}: incremental checkpoint {pending.ckpt_id} "
                             f"misses protected {'; '.join(said)}")
        return self.committer.finish(pending)

    def close(self) -> None:
        """At finalize: the open checkpoint is dropped, its file closed and removed; nothing is left open."""
        with contextlib.suppress(OSError, FTIError):
            if hasattr(self.slot.current, "abort"):  # this engine's own (the Dask backend's pins arrays only)
                self.abort()
        self.slot.current, self.slot.inactive = None, False

    def drop(self, why: str) -> None:
        """The open checkpoint dropped on an exception inside ``with ctx.incremental(...)`` (``why``), on every
        rank: collective, met by the others' :meth:`finalize` (which drop theirs and raise) or their own drop."""
        if self.slot.current is None:
            return
        ckpt_id = self.slot.current.ckpt_id

        def step() -> tuple[dict[str, Any], None]:
            raise CheckpointError(f"incremental checkpoint {ckpt_id} {_DROPPED} ({why}); "
                                  "the previous checkpoint is kept")

        try:
            if self.committer.transport.size > 1:
                agree_call(self.committer.transport, "finalize_icp", step, CheckpointError)
        except FTIError:  # (FTIError: ranks in other calls)
            pass  # the application's exception matters more
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the open checkpoint without committing it (the previous one stays)."""
        pending = self.slot.take()
        if pending is not None:
            pending.abort()
            remove_tree(pending.directory)
            store = self.committer.spares.store
            if store is not None:  # its spare may be half patched: not a base any more
                store.discard(pending.base_level, pending.seq)


class Incremental:
    """``with ctx.incremental(id, level) as icp: icp.add(var_id)`` commits on a clean exit.

    On an exception the checkpoint is dropped and the previous one stays. ``info`` holds the
    :class:`~ftidask.CheckpointInfo` after the commit.
    """

    def __init__(self, ctx: Context, ckpt_id: int, level: int) -> None:
        self.ctx, self.ckpt_id, self.level = ctx, ckpt_id, level
        self.info: CheckpointInfo | None = None

    def __enter__(self) -> Incremental:
        self.ctx.init_icp(self.ckpt_id, self.level)  # the backend's own (Dask has one)
        return self

    def add(self, var_id: int) -> None:
        """Write protected variable ``var_id`` into the open checkpoint now (:meth:`Context.add_var_icp`)."""
        self.ctx.add_var_icp(var_id)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.info = self.ctx.finalize_icp()
        else:
            try:
                self.ctx._abort_icp(reason(exc) if isinstance(exc, BaseException) else exc_type.__name__)
            except (OSError, FTIError):
                pass  # the original exception matters more
