"""Orphans: the tasks of a dead client that a surviving cluster still runs, kept out of the run's next client's files.

A Dask cluster outlives the program that drives it (``dask scheduler`` / ``dask worker``, dask-jobqueue). When the
client dies, distributed releases its keys, but a task already running on a worker thread runs to its end. The
program restarted on the same cluster takes the run over: its checkpoints never reuse a sequence number of an earlier
client (:class:`~ftidask.engine.runstate.SeqReservation`), so their directories, temporary names and task keys are
never an orphan's. Its ``init`` then tells every worker that it, client ``id``, now writes the run
(:func:`take_over`, before the run's garbage collection), and every task it submits goes through :func:`call`: a
task of another client of the run refuses to start there, and one that was running removes, once its function
returns, the directories of its checkpoint (never committed: its client died) that it may have written after the
garbage collection, or after the new client's ``finalize``.

Plain functions of strings (no ``distributed`` import); a worker keeps the run's client in this module.
"""

from __future__ import annotations

import glob
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...model.errors import FTIError
from ...storage import files as storage

_writers: dict[str, str] = {}  # run (its meta directory) -> the id of the client that writes it now
_lock = threading.Lock()


class OrphanedTask(FTIError):
    """A task of a client whose run another client took over (the first one died)."""


def take_over(run: str, client: str) -> None:
    """On every worker, at ``init`` (``client.run``): client ``client`` writes run ``run`` from now on."""
    with _lock:
        _writers[run] = client


def orphaned(run: str, client: str) -> bool:
    """Whether another client has taken run ``run`` over from client ``client`` on this worker."""
    with _lock:
        writer = _writers.get(run)
    return writer is not None and writer != client


def call(fn: Callable[..., Any], run: str, client: str, cleanup: Sequence[str], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for client ``client`` of run ``run``, unless the run was taken over; an orphan that
    was running when it was removes the directories that match ``cleanup`` (glob patterns: its checkpoint's) once
    ``fn`` is done."""
    if orphaned(run, client):
        raise OrphanedTask(f"run {run} is written by another client now: this task of client {client} does nothing")
    try:
        return fn(*args, **kwargs)
    finally:
        if cleanup and orphaned(run, client):  # after fn's last rename: the take-over's collection may have missed it
            for pattern in cleanup:
                for path in glob.glob(pattern):
                    storage.remove_tree(Path(path))
