"""How a :class:`ftidask.Context` closes: every part closed whatever fails (FTI_Finalize tears down), and a clear
error for a context closed with its run left unfinished (a finalize that failed, a ``with`` block left by an error).

It also keeps the open contexts of this process, for a run initialised again in it (a notebook's init cell run
again, the first context never finalized). The new init waits for the older context's checkpoints in flight
(:func:`settle_older`): it collects what interrupted checkpoints left, and a checkpoint in flight (its file renamed
into place, its commit record not yet written) looked like one; removed, its commit then named files gone and retired
the previous checkpoint. And while another context holds the run, a finalize leaves the run to it (:func:`end_run`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ..model.errors import FTIError
from ..transport.collective import reason

log = logging.getLogger("ftidask")
_contexts: weakref.WeakSet[Any] = weakref.WeakSet()  # the contexts made in this process


def close_all(steps: Iterable[Callable[[], Any] | None]) -> None:
    """Run every step (None: nothing to close), each even when an earlier one raised; then raise the first error.

    A part left open by its neighbour's failure would hold what the next run needs: the run lock (another process
    could not restart the run until this one exits), the heads' channel (they would wait for good), a thread."""
    first: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException as exc:  # a Ctrl-C too: the other parts still close, then it is raised
            first = first or exc
    if first is not None:
        raise first


def end_run(ctx: Any) -> tuple[list[Any], bool]:
    """finalize()'s work before ``ctx`` closes: wait for its staging requests and asynchronous checkpoints, then
    FTI_Finalize's clean-up; ``(staging failures, whether the run was cleaned up)``.

    Not while another context of this process holds the run (a second init of it, as a notebook's init cell run
    again): the run is that one's too, and removing its checkpoints under it lost those it committed next (a restart
    found the run finalized and started afresh). The last context's finalize cleans up."""
    staging_failed = ctx._staging.finish()  # wait for pending SendFile requests (stage_timeout)
    ctx._async.drain()  # a failure nobody asked for is raised at the end, once finalized
    ctx._async.close()
    ctx.transport.wait_post()
    if ctx.transport.bcast(_shared(ctx)):  # rank 0 holds the lock: the ranks do as it says
        log.warning("run %s is still open in another context of this process (a second init of it): this finalize "
                    "closes this context only; the last one's finalize cleans the run up", ctx.exec_id)
        return staging_failed, False
    ctx._retention.end_run(ctx.recovery.all_candidates(None, None, FTIError), ctx._flush_to_l4)
    return staging_failed, True


def _run_of(ctx: Any) -> tuple[str, str, int]:
    return os.path.realpath(ctx.paths.meta_dir), ctx.exec_id, ctx.transport.rank


def settle_older(ctx: Any) -> None:
    """Wait until every other open context of this process on ``ctx``'s run and rank has finished its checkpoints in
    flight (their failures stay with their handles). Contexts of other ranks (ranks as threads) are not waited for."""
    run = _run_of(ctx)
    for old in list(_contexts):
        if old is not ctx and not getattr(old, "_closed", True) and _run_of(old) == run:
            old._async.drain()


def register(ctx: Any) -> None:
    """Note ``ctx`` among this process's contexts (once its run is claimed)."""
    _contexts.add(ctx)


def _shared(ctx: Any) -> bool:
    """Whether another open context of this process holds ``ctx``'s run (ranks as threads: rank 0's alone does)."""
    mine = ctx._run_lock
    return mine is not None and any(
        other is not ctx and not other._closed and other._run_lock is not None and other._run_lock.held
        and other._run_lock.path == mine.path for other in list(_contexts))


def unfinished_error(cause: BaseException, exec_id: str) -> FTIError:
    """The error of a call on a context closed with its run unfinished (``cause``: why), chained to ``cause``."""
    error = FTIError(
        f"finalize() failed or did not run ({reason(cause)}), and this context is closed all the same (as "
        f"FTI_Finalize, it always tears down): it cannot retry. Run {exec_id!r} is left as that failure left it (its "
        f"checkpoints kept, unless the clean-up had removed them): ftidask.init(..., exec_id={exec_id!r}) restarts it "
        "from the last one left (status() != 0), and its finalize() retries the clean-up")
    error.__cause__ = cause
    return error


def forked_error(pid: int) -> FTIError:
    """The error of a call of a context in a process forked from ``pid``, the one that made it."""
    return FTIError(f"this process ({os.getpid()}) was forked from process {pid}, whose context this is: a child "
                    "must not write or finalize its parent's run (its checkpoint retired the parent's ones, its "
                    "finalize removed them); call ftidask.init() in the child with directories of its own")


def close_after_error(ctx: Any, exc: BaseException | None) -> None:
    """A ``with`` block left by ``exc``: close ``ctx`` without finalizing its run (its checkpoints stay for a restart).
    A failure while closing is logged, never raised over the application's own error, which is the one to see."""
    if ctx.finalized:  # a finalize inside the block closed it (and raised the error leaving it)
        return
    ctx._unfinished = exc if exc is not None else FTIError("the with block was left by an error")
    try:
        try:
            ctx._staging.finish()  # its failures are logged by the stager
        finally:
            ctx._close()
    except Exception as error:  # noqa: BLE001 - the application's error propagates
        log.warning("closing the context after the error that left its with block failed too: %s", reason(error))
