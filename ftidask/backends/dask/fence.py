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

A differential checkpoint patches a file that outlives the checkpoint: a spare (its rank file, at L2 the partner
copy, at L3 the parity), renamed into the checkpoint once complete. A task never patches it where it lies: it first
*claims* it, renaming it into its own checkpoint's directory (:func:`exclusive`, under the lock that
:func:`take_over` takes, refused once the run was taken over), and patches it there. An orphan that claimed a spare
before the take-over patches a file that no other client names (its checkpoint's directory, removed); one that had
not claims nothing more. The restart's tasks find the spare where the dead client left it, or none (written in full).

Plain functions of strings (no ``distributed`` import); a worker keeps the run's client in this module.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...model.errors import FTIError
from ...storage import files as storage

_writers: dict[str, str] = {}  # run (its meta directory) -> the id of the client that writes it now
# The directory patterns of checkpoints that failed (their client gave up), in the order they failed (a dict's keys)
_abandoned: dict[tuple[str, ...], None] = {}
_ABANDONED_KEPT = 1024
_lock = threading.Lock()
_task = threading.local()  # owner: the (run, client) of the task this thread runs, while call runs it


class OrphanedTask(FTIError):
    """A task of a client whose run another client took over (the first one died)."""


def take_over(run: str, client: str) -> None:
    """On every worker, at ``init`` (``client.run``): client ``client`` writes run ``run`` from now on."""
    with _lock:
        _writers[run] = client


def abandon(patterns: Sequence[str]) -> None:
    """On every worker, when a checkpoint fails (its directories' glob ``patterns``, as :func:`call` gets them): its
    tasks yet to start do nothing, and one still running removes its directories once it returns. The client removed
    them already, but cancelling a task does not stop its thread, which renamed its file into a new directory after:
    left until the next commit's collection, for ever after a finalize."""
    with _lock:
        _abandoned[tuple(patterns)] = None
        while len(_abandoned) > _ABANDONED_KEPT:  # a failed checkpoint's tasks end soon after: the oldest go
            del _abandoned[next(iter(_abandoned))]


def _given_up(patterns: Sequence[str]) -> bool:
    with _lock:
        return bool(patterns) and tuple(patterns) in _abandoned


def orphaned(run: str, client: str) -> bool:
    """Whether another client has taken run ``run`` over from client ``client`` on this worker."""
    with _lock:
        return _taken(run, client)


def _taken(run: str, client: str) -> bool:
    writer = _writers.get(run)
    return writer is not None and writer != client


def owner() -> tuple[str, str] | None:
    """The (run, client) of the task that this thread runs (None outside :func:`call`)."""
    return getattr(_task, "owner", None)


@contextlib.contextmanager
def acting(who: tuple[str, str] | None) -> Iterator[None]:
    """This thread works for the task of ``who`` (:func:`owner` of the task's thread): a helper thread of a task."""
    outer, _task.owner = owner(), who
    try:
        yield
    finally:
        _task.owner = outer


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the worker's fence lock while this thread's task moves a file that outlives its checkpoint (a spare):
    :class:`OrphanedTask` once the task's run was taken over. :func:`take_over` waits for the block to end."""
    with _lock:
        who = owner()
        if who is not None and _taken(*who):
            raise OrphanedTask(f"run {who[0]} is written by another client now: client {who[1]}'s task moves nothing")
        yield


def claim(moves: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]]) -> list[bool]:
    """Rename each ``src`` to ``dst`` (in this task's checkpoint directory, which exists), all under
    :func:`exclusive`: this task alone patches them now. Which ones were there."""
    done = []
    with exclusive():
        for src, dst in moves:
            try:
                os.replace(src, dst)
                done.append(True)
            except FileNotFoundError:
                done.append(False)
    return done


def call(fn: Callable[..., Any], run: str, client: str, cleanup: Sequence[str], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for client ``client`` of run ``run``, unless the run was taken over; an orphan that
    was running when it was removes the directories that match ``cleanup`` (glob patterns: its checkpoint's) once
    ``fn`` is done."""
    if orphaned(run, client):
        raise OrphanedTask(f"run {run} is written by another client now: this task of client {client} does nothing")
    if _given_up(cleanup):
        raise OrphanedTask(f"the checkpoint of this task of client {client} failed: it does nothing")
    outer, _task.owner = owner(), (run, client)
    try:
        return fn(*args, **kwargs)
    finally:
        _task.owner = outer
        # after fn's last rename: the take-over's collection, or the failed checkpoint's discard, may have missed it
        if cleanup and (orphaned(run, client) or _given_up(cleanup)):
            for pattern in cleanup:
                for path in glob.glob(pattern):
                    storage.remove_tree(Path(path))
