"""The open contexts of this process, by run: an init of a run that a context of this process still writes
(a notebook's init cell run again, the first context never finalized) waits for that context's checkpoints
in flight before it reads the run.

The new init collects what interrupted checkpoints left: a checkpoint in flight in the old context (its file
renamed into place, its commit record not yet written) looked like one, and was removed; its commit then named
files gone, was reported written, and retired the previous checkpoint: nothing was left to recover. Both
contexts stay usable (inits of one run in one process share its lock, see :mod:`ftidask.storage.runlock`).
Contexts of other ranks of the run (a group of threads, one context per rank) are not waited for.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # Context objects made in this process


def _run_of(ctx: Any) -> tuple[str, str, int]:
    return os.path.realpath(ctx.paths.meta_dir), ctx.exec_id, ctx.transport.rank


def settle_older(ctx: Any) -> None:
    """Register ``ctx`` (its run claimed) and wait until every other open context of this process on the same run
    and rank has finished its checkpoints in flight (their failures stay with their handles)."""
    run = _run_of(ctx)
    for old in list(_OPEN):
        if old is not ctx and not getattr(old, "_closed", True) and _run_of(old) == run:
            old._async.drain()
    _OPEN.add(ctx)
