"""The open contexts of this process, by run: an init of a run that a context of this process still writes
replaces that context (a notebook's init cell run again, the first context never finalized).

Two contexts writing one run would undo each other: the new one's start collects the files of the old one's
checkpoint in flight as garbage of an interrupted checkpoint (its commit then fails, or names files gone),
and the old one's ``finalize`` removes every checkpoint, the new one's included. So the old context finishes
what it has in flight, is closed as a process that dies would be (its checkpoints stay: the new init restarts
from them), and refuses every later call, saying why. Contexts of other ranks of the run (a group of threads,
one context per rank) are never replaced.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

log = logging.getLogger("ftidask")

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # Context objects not closed


def _run_of(ctx: Any) -> tuple[str, str, int]:
    return os.path.realpath(ctx.paths.meta_dir), ctx.exec_id, ctx.transport.rank


def replace_older(ctx: Any) -> None:
    """Register ``ctx`` (its run claimed) and close every other open context of this process on the same run and
    rank, once it has finished its checkpoints in flight (their failures stay with their handles)."""
    run = _run_of(ctx)
    for old in list(_OPEN):
        if old is ctx or getattr(old, "_closed", True) or _run_of(old) != run:
            continue
        log.warning("run %s: an init of this run replaces the context opened before (never finalized); that "
                    "context is closed, its checkpoints kept", ctx.exec_id)
        old._closed_why = ("this context was replaced by a later ftidask.init() of the same run (a notebook's init "
                           "cell run again): use the context that init returned")
        try:
            old._async.drain()  # the checkpoint in flight committed (or failed) before the new run reads the files
        finally:
            old._close()
    _OPEN.add(ctx)
