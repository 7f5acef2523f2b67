"""The start of a run on every rank: rank 0 chooses and locks it, every rank gets its choice or its error."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..model.errors import ConfigError, FTIError, RunInUseError
from ..storage import runlock
from ..storage.runlock import RunLock
from ..transport.base import Transport
from ..transport.collective import reason
from .runstate import claim_run

log = logging.getLogger("ftidask")


def claim_everywhere(t: Transport, meta_dir: Path, configured: str | None,
                     dcp: bool = True) -> tuple[str, int, RunLock | None]:
    """``(exec_id, status, lock)``: rank 0 chooses and locks the run (:func:`ftidask.engine.runstate.claim_run`,
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
