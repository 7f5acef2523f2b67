"""The default mover: a background thread of the caller (one process, MPI ranks without heads).

It dies with its process: the transfer under way is noted first (:mod:`ftidask.staging.journal`), so that the
restart of the run removes the temporary file it leaves at the destination.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ..model.constants import SI_ACTV, SI_FAIL, SI_SCES
from . import journal
from .copy import CANCELLED, StageRequest, TransferFailed, transfer

if TYPE_CHECKING:
    from .stager import StageTable


class ThreadMover:
    """Copies in a background thread of the caller, one request at a time, in submission order."""

    def __init__(self, notes: Path | None = None) -> None:
        """``notes``: the directory where the transfers under way are noted (:mod:`ftidask.staging.journal`)."""
        self._notes = notes
        self._queue: queue.SimpleQueue[StageRequest | None] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._table: StageTable | None = None

    def start(self, table: StageTable) -> None:
        """Start the copying thread, which reports to ``table``."""
        self._table = table
        self._thread = threading.Thread(target=self._run, name="ftidask-stager", daemon=True)
        self._thread.start()

    def submit(self, req: StageRequest) -> None:
        """Queue ``req`` for the thread."""
        self._queue.put(req)

    def _run(self) -> None:
        assert self._table is not None
        while (req := self._queue.get()) is not None:
            if self._cancel.is_set():
                self._table.update(req.id, SI_FAIL, CANCELLED)
                continue
            self._table.update(req.id, SI_ACTV)
            try:  # the note too: whatever fails, the request is reported and the thread serves the next
                if self._notes is not None:
                    journal.begin(self._notes, req)
                transfer(req, self._cancel.is_set)
                state, reason = SI_SCES, ""
            except TransferFailed as exc:
                state, reason = SI_FAIL, str(exc)
            except Exception as exc:  # noqa: BLE001 - a mover must report, never die silently
                state, reason = SI_FAIL, f"internal error: {exc!r}"
            finally:  # the note goes before the application can see the request done
                if self._notes is not None:
                    journal.end(self._notes, req)
            self._table.update(req.id, state, reason)

    def close(self, timeout: float) -> None:
        """Wait at most ``timeout`` s, then cancel what is left (at its next piece), reported failed."""
        assert self._table is not None and self._thread is not None
        self._queue.put(None)
        self._table.wait(None, timeout)
        self._cancel.set()  # what is left is over time: abort it at the next piece
        self._thread.join(5.0)
        self._table.fail_open([r.id for r in self._table.open_requests()], CANCELLED)
