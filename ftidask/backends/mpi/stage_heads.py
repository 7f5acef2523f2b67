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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpi4py import MPI

from ...model.constants import SI_ACTV, SI_FAIL, SI_SCES
from ...staging import journal
from ...staging.copy import StageRequest, TransferFailed, transfer
from .transport import _TAG_REQ, recv_json, send_json

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

    def _poll(self) -> None:
        if self.node_comm == MPI.COMM_NULL:  # freed: the context closed (its exit hook may still ask)
            return
        while self.node_comm.Iprobe(source=0, tag=TAG_STAGE):
            msg, _src = recv_json(self.node_comm, 0, TAG_STAGE)
            state = int(msg["state"])
            if state != SI_ACTV and self.notes is not None and int(msg["id"]) in self._noted:
                journal.end(self.notes, self._noted.pop(int(msg["id"])))  # published or removed by the head
            self._table.update(int(msg["id"]), state, str(msg.get("reason", "")))

    def close(self, timeout: float) -> None:
        """Wait at most ``timeout`` s; what is still open is reported failed, not cancelled (the head cannot be
        interrupted)."""
        self._table.wait(None, timeout)
        # The head copies in order and cannot be interrupted: what is left is reported, not cancelled.
        self._table.fail_open([r.id for r in self._table.open_requests()],
                              "timed out: not finished at finalize (stage_timeout); the head may still "
                              "complete it")


def serve_stage_request(node_comm: MPI.Comm, msg: dict[str, Any], source: int) -> None:
    """On the head: run one staging request of application rank ``source`` and report to it."""
    try:
        req = StageRequest.from_json(msg["req"])
    except (KeyError, TypeError, ValueError):
        return
    send_json(node_comm, {"id": req.id, "state": SI_ACTV, "reason": ""}, source, TAG_STAGE)
    try:
        transfer(req)
    except TransferFailed as exc:
        reply = {"id": req.id, "state": SI_FAIL, "reason": f"head: {exc}"}
    except Exception as exc:  # noqa: BLE001 - the head keeps serving
        reply = {"id": req.id, "state": SI_FAIL, "reason": f"head: internal error: {exc!r}"}
    else:
        reply = {"id": req.id, "state": SI_SCES, "reason": ""}
    send_json(node_comm, reply, source, TAG_STAGE)
