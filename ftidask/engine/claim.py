"""The start of a run on every rank: rank 0 chooses and locks it, every rank gets its choice or its error.

Which run an init gets (:func:`claim_run`), with ``{meta_dir}/current_exec_id`` naming the run that
an init without ``exec_id`` restarts:

* ``exec_id`` configured: that run; refused (:class:`~ftidask.model.errors.RunInUseError`) while a live
  process holds it (see :mod:`ftidask.storage.runlock`).
* no ``exec_id``: the run ``current_exec_id`` names when it is dead, was not finalized (or kept its
  last checkpoint) and has committed checkpoints; dead, not finalized, with nothing committed (killed before
  its first commit): that run too, started afresh, so that its start removes what it left; otherwise a new run.
* ``current_exec_id`` is written only by a run that starts while the run it names is not live: a
  run started beside a live one (a side run) never replaces it, so that a restart of the live run,
  should it die, still finds its own run. A side run is restarted by naming its ``exec_id``; killed before its
  first commit, what it wrote is removed by the next start of any run (:mod:`ftidask.api.abandoned`).
* ``current_exec_id`` damaged (it is written atomically, so only by outside harm): the unfinished run
  whose last commit is the newest, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from ..model.config import check_exec_id
from ..model.errors import ConfigError, FTIError, RunInUseError
from ..storage import files as storage
from ..storage import runlock
from ..storage.runlock import RunLock
from ..transport.base import Transport
from ..transport.collective import reason
from .runstate import STATUS_FRESH, STATUS_KEPT, RunState, new_exec_id, read_current_exec_id

log = logging.getLogger("ftidask")


@dataclasses.dataclass
class Claim:
    """The run an init got: its identity, its status, the lock its writer holds, and the run it started beside."""

    exec_id: str
    status: int
    lock: runlock.RunLock
    beside: str | None = None  # the live run current_exec_id names, when this is a side run


def claim_run(meta_dir: Path, configured: str | None, dcp: bool = True) -> Claim:
    """Choose the run of an init (see the module's docstring) and lock it for this process. Without ``dcp``
    (differential checkpoints off) the fallback records go: the spares they name are removed at the start.

    Raises :class:`RunInUseError` when ``configured`` names a run that a live process writes.
    """
    try:
        storage.makedirs(meta_dir)
        with runlock.choosing(meta_dir):
            return _claim(meta_dir, configured, dcp)
    except OSError as exc:
        raise FTIError(f"cannot start a run in meta_dir {meta_dir}: {exc}") from exc


def _unfinished(meta_dir: Path, exec_id: str, dcp: bool) -> bool:
    """Whether the run ``exec_id`` is to be started again, when dead: it has a checkpoint to restart from, or it
    never committed one and was not finalized (killed before its first commit, or in its finalize once every
    record was gone). Such a run starts afresh (status 0) under its own name, so that the start removes what its
    interrupted checkpoint left: a new run would never look there, and the files stayed for good."""
    state = RunState(meta_dir, exec_id)
    if state.start_status(dcp) != STATUS_FRESH:
        return True
    return state.run_info().get("state") == "running" and not runlock.held_here(meta_dir / exec_id)


def _claim(meta_dir: Path, configured: str | None, dcp: bool) -> Claim:
    current = read_current_exec_id(meta_dir)
    lock = None
    if configured is not None:
        exec_id = check_exec_id(configured, "config key [restart] exec_id")
        lock = runlock.acquire(meta_dir / exec_id)
        if lock is None:
            raise RunInUseError(f"run {exec_id!r} in {meta_dir} is in use by {runlock.holder(meta_dir / exec_id)}: "
                                "two processes must not write the same run. Wait for it to end, or start another "
                                "run (another exec_id, or none for a new one)")
    else:
        if current is not None and _unfinished(meta_dir, current, dcp):
            lock = runlock.acquire(meta_dir / current)  # None: alive in another process, never adopted
        exec_id = current if lock is not None else new_exec_id()
        while lock is None:
            if not (meta_dir / exec_id).exists():  # a new name: nobody else has it
                lock = runlock.acquire(meta_dir / exec_id)
            exec_id = exec_id if lock is not None else new_exec_id()
    try:
        state = RunState(meta_dir, exec_id)
        status = state.start_status(dcp)
        if status == STATUS_FRESH or not dcp:  # a finalized run's, left by a kill during its finalize (never this
            state.delete_fallbacks()  # run's), or ones whose spares this run removes at its start (no dCP)
        if status in (STATUS_FRESH, STATUS_KEPT):  # seq stays: a finished run's mark (next_seq). Kept: should the run
            state.write_run(state="running", keep_last=False)  # die now, its next start is a restart (1)
        beside = current if current not in (None, exec_id) and runlock.is_live(meta_dir / current) else None
        if beside is None and current != exec_id:
            state.make_current()
    except BaseException:  # released now: a traceback kept (a notebook's) would keep the run "in use" until collected
        if lock is not None:
            lock.release()
        raise
    return Claim(exec_id, status, lock, beside)


def claim_everywhere(t: Transport, meta_dir: Path, configured: str | None,
                     dcp: bool = True) -> tuple[str, int, RunLock | None]:
    """``(exec_id, status, lock)``: rank 0 chooses and locks the run (:func:`claim_run`,
    ``dcp``: differential checkpoints on) and holds the lock; every rank gets its choice, or the same error."""
    outcome: dict[str, Any] | None = None
    error: FTIError | None = None
    lock: RunLock | None = None
    if t.rank == 0:
        try:
            claim = claim_run(meta_dir, configured, dcp)
        except FTIError as exc:
            error = exc
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - an OS error, anything: every rank must hear of it
            error = FTIError(f"ftidask.init: cannot start or resume the run in {meta_dir}: rank 0: {reason(exc)}")
            error.__cause__ = exc
            outcome = {"error": "FTIError", "message": str(error)}
        else:
            lock = claim.lock
            outcome = {"exec_id": claim.exec_id, "status": claim.status}
            if claim.beside is not None:
                log.warning("meta_dir %s is in use by the live run %s (%s): this run is a new one, %s. A restart "
                            "without exec_id restarts %s; to restart this run, pass exec_id=%r", meta_dir,
                            claim.beside, runlock.holder(meta_dir / claim.beside), claim.exec_id, claim.beside,
                            claim.exec_id)
    outcome = t.bcast(outcome)
    if "error" in outcome:
        if error is not None:
            raise error
        kind = {"RunInUseError": RunInUseError, "ConfigError": ConfigError}.get(outcome["error"], FTIError)
        raise kind(outcome["message"])
    return str(outcome["exec_id"]), int(outcome["status"]), lock
