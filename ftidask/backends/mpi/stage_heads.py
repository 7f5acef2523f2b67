"""Staging through the node's head (``head = 1``, MPI): FTI_SendFile's bytes moved by the head process.

Application rank -> head: ``{"op": "stage", "req": StageRequest.to_json()}`` on the node
communicator (the heads' request tag). Head -> rank: ``{"id", "state", "reason"}`` with
:data:`TAG_STAGE`, first ``SI_ACTV`` then ``SI_SCES``/``SI_FAIL``. The head runs
:func:`ftidask.staging.copy.transfer` between post-processing requests, one request at a time, in
arrival order. The rank needs no thread: it probes for the head's answers whenever the application
asks for a state (:meth:`StageTable.set_poller`). JSON both ways, never pickle.

A head killed in a transfer takes the job down with it: nobody is left to remove its temporary file at the
destination. So the rank notes each transfer before it hands it to the head and drops the note once the head
reported its end, as a mover thread does (:mod:`ftidask.staging.journal`): the run's restart removes the
temporary files of the transfers still noted.

A finalize past ``stage_timeout`` cancels what is still open: the rank sends ``{"op": "stage-cancel", "ids": [...]}``
after its requests (same tag, so after them in the head's order) and waits for the head's answer to each. The head
reads its requests ahead (:class:`StageInbox`), so it learns of a cancel before it starts any request the cancel
names: those it answers ``SI_FAIL`` (cancelled) without a copy, and the copy under way stops at its next piece (its
temporary file removed) unless it was already publishing, then reported ``SI_SCES``. Every state the rank reports is
the head's own: no file is published after the application was told it failed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ...model.constants import SI_ACTV, SI_FAIL, SI_SCES
from ...staging import journal
from ...staging.copy import CANCELLED, StageRequest, TransferFailed, transfer
from ...staging.stager import FINAL
from .transport import _TAG_REQ, recv_json, send_json

log = logging.getLogger("ftidask")

TAG_STAGE = 3  # head -> application rank: staging states (requests travel with the heads' request tag)


class HeadStageMover:
    """The application rank's mover: requests go to the node's head (position 0 of ``node_comm``); the transfers
    under way are noted in ``notes`` (None: not noted)."""

    def __init__(self, node_comm: MPI.Comm, notes: Path | None = None) -> None:
        self.node_comm = node_comm
        self.notes = notes
        self._noted: dict[int, StageRequest] = {}  # the transfers handed to the head whose end it has not reported
        self._table: Any = None

    def start(self, table: Any) -> None:
        """Report to ``table``, polled at each query (no thread: the rank probes for the head's answers)."""
        self._table = table
        table.set_poller(self._poll)

    def submit(self, req: StageRequest) -> None:
        """Note the transfer (with ``notes``), then send ``req`` to the node's head."""
        if self.notes is not None:  # before the head can create the temporary file
            journal.begin(self.notes, req)
            self._noted[req.id] = req
        send_json(self.node_comm, {"op": "stage", "req": req.to_json()}, 0, _TAG_REQ)

    def _usable(self) -> bool:
        # Freed (the context closed; its exit hook may still ask), or MPI already finalized at interpreter exit.
        return not MPI.Is_finalized() and self.node_comm != MPI.COMM_NULL

    def _poll(self) -> None:
        if not self._usable():
            return
        while self.node_comm.Iprobe(source=0, tag=TAG_STAGE):
            msg, _src = recv_json(self.node_comm, 0, TAG_STAGE)
            state = int(msg["state"])
            if state != SI_ACTV and self.notes is not None and int(msg["id"]) in self._noted:
                journal.end(self.notes, self._noted.pop(int(msg["id"])))  # published or removed by the head
            self._table.update(int(msg["id"]), state, str(msg.get("reason", "")))

    def close(self, timeout: float) -> None:
        """Wait at most ``timeout`` s, then cancel what is still open and wait for the head's answer to each: queued
        requests are skipped, the copy under way stops at its next piece (or, publishing already, completes)."""
        self._table.wait(None, timeout)
        open_ids = [r.id for r in self._table.open_requests()]
        if not open_ids:
            return
        if not self._usable():  # nobody to tell: the head ended with MPI (it copies nothing after that)
            self._table.fail_open(open_ids, CANCELLED)
            return
        send_json(self.node_comm, {"op": "stage-cancel", "ids": open_ids}, 0, _TAG_REQ)
        # No limit: the head answers each once it is back from the piece it writes (or from a post-processing that
        # finalize waits for next anyway); a state made up here could be contradicted by the file the head publishes.
        while not all(i.state in FINAL for i in self._table.wait(open_ids, 60.0).values()):
            log.warning("staging: still waiting for the node's head to answer the cancel of %d request(s)",
                        len(self._table.open_requests()))


class StageInbox:
    """The head's requests (``_TAG_REQ`` from the node's application ranks), read ahead: staging requests are served
    in arrival order as they come, and a rank's cancel is seen before the head starts any request it names, even one
    that arrived earlier (and while a copy runs: it stops at its next piece)."""

    def __init__(self, node_comm: MPI.Comm) -> None:
        self.comm = node_comm
        self._queue: collections.deque[tuple[Any, int]] = collections.deque()
        self._cancelled: set[tuple[int, int]] = set()  # (application rank, request id)

    def _take(self, msg: Any, source: int) -> None:
        if isinstance(msg, dict) and msg.get("op") == "stage-cancel":
            with contextlib.suppress(TypeError, ValueError):
                self._cancelled.update((source, int(i)) for i in msg.get("ids", ()))
        else:
            self._queue.append((msg, source))

    def _drain(self) -> None:
        """Read every request that has arrived (cancels take effect now, the others queue in order)."""
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_REQ):
            self._take(*recv_json(self.comm, MPI.ANY_SOURCE, _TAG_REQ))

    def next(self) -> tuple[Any, int]:
        """The next request that is not staging's, and its sender; the staging requests before it are served first."""
        while True:
            if not self._queue:
                self._take(*recv_json(self.comm, MPI.ANY_SOURCE, _TAG_REQ))
                continue
            msg, source = self._queue.popleft()
            if not (isinstance(msg, dict) and msg.get("op") == "stage"):
                return msg, source
            self._serve(msg, source)

    def _serve(self, msg: dict[str, Any], source: int) -> None:
        """Run one staging request of application rank ``source`` and report to it (skipped if cancelled)."""
        try:
            req = StageRequest.from_json(msg["req"])
        except (KeyError, TypeError, ValueError):
            return
        key = (source, req.id)
        self._drain()
        if key in self._cancelled:
            self._cancelled.discard(key)
            send_json(self.comm, {"id": req.id, "state": SI_FAIL, "reason": f"head: {CANCELLED}"}, source, TAG_STAGE)
            return
        send_json(self.comm, {"id": req.id, "state": SI_ACTV, "reason": ""}, source, TAG_STAGE)

        def cancelled() -> bool:  # polled by the copy between pieces and before it publishes
            self._drain()
            return key in self._cancelled

        try:
            transfer(req, cancelled)
        except TransferFailed as exc:
            reply = {"id": req.id, "state": SI_FAIL, "reason": f"head: {exc}"}
        except Exception as exc:  # noqa: BLE001 - the head keeps serving
            reply = {"id": req.id, "state": SI_FAIL, "reason": f"head: internal error: {exc!r}"}
        else:
            reply = {"id": req.id, "state": SI_SCES, "reason": ""}
        self._cancelled.discard(key)
        send_json(self.comm, reply, source, TAG_STAGE)
