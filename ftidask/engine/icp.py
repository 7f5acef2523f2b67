"""Incremental checkpointing (FTI's InitICP / AddVarICP / FinalizeICP).

A checkpoint is opened, each protected variable is written as soon as the application is done
with it (any order; the array may change right after), and the checkpoint is committed at the
end. Nothing is visible to recovery before that commit: a checkpoint that misses a protected
variable is refused there, and the previous checkpoint stays the newest one. Differential levels
(5-8) work too: each variable's changed blocks are written when it is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model.errors import CheckpointError, FTIError, ProtectError
from ..transport.collective import reason

if TYPE_CHECKING:
    from ..api.context import Context
    from .checkpointing import CheckpointInfo
    from .pending import PendingCheckpoint


def check_none_open(ctx: Any) -> None:
    """Refuse to start a checkpoint while an incremental one is open (any backend)."""
    if ctx._icp is not None:
        raise CheckpointError(f"incremental checkpoint {ctx._icp.ckpt_id} is open; finalize_icp() first")


def open_icp(ctx: Any) -> Any:
    """The open incremental checkpoint of ``ctx`` (any backend), or a :class:`CheckpointError`."""
    ctx._check_open()
    if ctx._icp is None:
        raise CheckpointError("no incremental checkpoint is open; call init_icp(id, level) first")
    return ctx._icp


def protected_var(ctx: Any, var_id: Any) -> Any:
    """The protected variable ``var_id`` to add, or a :class:`ProtectError`."""
    protected = ctx.variables.get(var_id) if isinstance(var_id, int) and not isinstance(var_id, bool) else None
    if protected is None:
        raise ProtectError(f"variable {var_id!r} is not protected; protect it before init_icp")
    return protected


def init_icp(ctx: Context, ckpt_id: int, level: int) -> None:
    """Open incremental checkpoint ``ckpt_id`` at ``level`` (levels 1-8, as for checkpoint)."""
    check_none_open(ctx)
    ctx._icp = ctx._begin_checkpoint(ckpt_id, ctx._check_level(level), incremental=True)


def add_var_icp(ctx: Context, var_id: int) -> None:
    """Write protected variable ``var_id`` into the open checkpoint now."""
    pending: PendingCheckpoint = open_icp(ctx)
    protected = protected_var(ctx, var_id)
    if pending.error:
        return  # reported, on every rank together, by finalize_icp
    try:
        pending.write_var(protected.id, protected.name, protected.array)
    except CheckpointError:
        raise  # this call was wrong (variable added twice, resized): the checkpoint stays open
    except Exception as exc:  # noqa: BLE001 - any failure of the write: reported on every rank by finalize_icp
        pending.error = f"rank {ctx.transport.rank}: {reason(exc)}"


def finalize_icp(ctx: Context) -> CheckpointInfo:
    """Commit the open checkpoint; a :class:`CheckpointError` (previous one kept) if a variable is missing."""
    pending: PendingCheckpoint = open_icp(ctx)
    ctx._icp = None
    missing = sorted(set(pending.sizes) - pending.written)
    if missing and not pending.error:
        pending.error = (f"rank {ctx.transport.rank}: incremental checkpoint {pending.ckpt_id} misses protected "
                         f"variables {missing}")
    return ctx._commit_checkpoint(pending)


def abort_icp(ctx: Context) -> None:
    """Drop the open checkpoint without committing it (the previous one stays)."""
    pending = ctx._icp
    ctx._icp = None
    if pending is not None:
        pending.abort()
        from ..storage.files import remove_tree

        remove_tree(pending.directory)
        if ctx._dcp is not None:
            ctx._dcp.discard(pending.base_level, pending.seq)


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
        self.ctx.add_var_icp(var_id)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.info = self.ctx.finalize_icp()
        elif self.ctx._icp is not None:
            try:
                self.ctx._abort_icp()
            except (OSError, FTIError):
                pass  # the original exception matters more
