"""A staging mover for the Dask backend: each transfer is a task on the worker that holds the file.

The file lives on a worker's node-local disk, so the copy runs there (``workers=[address]``); the
client never sees the bytes. The task announces ``SI_ACTV`` through a worker event (topic
``ftidask-stage-{token}``) and returns ``{"state", "reason"}``; the client's done-callback records the
final state. A finalize that times out sets a distributed ``Event`` that running copies poll between
pieces, so they stop and remove their temporary file. Only this module (in ftidask's staging) imports
``distributed``.

A copy belongs to the run's client (:mod:`.fence`): once a restarted program's client took the run over (the
first one died, its copy still running on a worker, an orphan), the copy stops at its next piece, or at the latest
before it publishes (under the fence's lock), and removes its temporary file; a copy not started yet never starts.
The new client's copy of the same destination then publishes, not the dead client's older file.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distributed import Client, Event, get_worker
from distributed.diagnostics.plugin import SchedulerPlugin

from ...model.constants import SI_ACTV, SI_FAIL, SI_SCES
from ...staging import journal
from ...staging.copy import CANCELLED, StageRequest, TransferFailed, transfer
from ...staging.settle import settle
from . import fence

_CANCEL_REASON = CANCELLED


def run_transfer(raw: dict[str, Any], topic: str, cancel_name: str,
                 owner: tuple[str, str] | None = None) -> dict[str, Any]:
    """The task body, on the worker: announce, copy, report (JSON-able result). ``owner``: the (run, client) the
    copy belongs to: refused, or stopped before it publishes, once another client writes the run."""
    req = StageRequest.from_json(raw)
    worker = get_worker()
    who = tuple(owner) if owner else None
    if who is not None and fence.orphaned(*who):
        return {"id": req.id, "state": SI_FAIL, "worker": worker.address,
                "reason": f"run {who[0]} is written by another client now: this copy was not started"}
    worker.log_event(topic, {"id": req.id, "state": SI_ACTV, "worker": worker.address})
    cancel = Event(cancel_name)

    def cancelled() -> bool:
        if who is not None and fence.orphaned(*who):
            raise TransferFailed(f"run {who[0]} is written by another client now: this copy was stopped")
        return bool(cancel.is_set())

    try:
        transfer(req, cancelled, functools.partial(_publishing, who))
    except TransferFailed as exc:
        return {"id": req.id, "state": SI_FAIL, "reason": str(exc), "worker": worker.address}
    return {"id": req.id, "state": SI_SCES, "reason": "", "worker": worker.address}


@contextlib.contextmanager
def _publishing(who: tuple[str, str] | None) -> Iterator[None]:
    """The publication of a copy of ``who``'s, under the worker's fence lock: never once the run was taken over."""
    if who is None:
        yield
        return
    try:
        with fence.acting(who), fence.exclusive():
            yield
    except fence.OrphanedTask as exc:
        raise TransferFailed(f"{exc} (the copy was not published)") from None


def worker_by_node_dir(workers: Callable[[], list[str]]) -> Callable[[StageRequest], str | None]:
    """A ``worker_for`` for the Dask backend's layout: a file under ``.../node{k}/...`` is on worker ``k``.

    ``workers()`` lists the live worker addresses in rank order (the backend's sorted addresses).
    A path without a ``node{k}`` component, or a ``k`` beyond the cluster, may run anywhere (None).
    """
    cache: list[str] = []  # asking the scheduler on every send_file would cost a round trip

    def worker_for(req: StageRequest) -> str | None:
        for part in reversed(Path(req.src).parts[:-1]):
            if part.startswith("node") and part[4:].isdigit():
                k = int(part[4:])
                if k >= len(cache):
                    cache[:] = workers()
                return cache[k] if k < len(cache) else None
        return None

    worker_for.refresh = cache.clear  # type: ignore[attr-defined] - called when a worker leaves
    return worker_for


class _WorkerWatch(SchedulerPlugin):
    """On the scheduler: tells the mover's client when a worker leaves (its requests cannot finish)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.name = f"{topic}-watch"

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        scheduler.log_event(self.topic, {"removed": worker})


class DaskMover:
    """Runs transfers as Dask tasks.

    ``worker_for(req)`` names the worker address holding ``req.src`` (None: any worker, for disks
    every worker can read, as on a LocalCluster). ``notes``: where the client notes each transfer until its task
    is over (:mod:`ftidask.staging.journal`; None: not noted): a job killed whole (client and workers) leaves the
    temporary files of its copies under way, which the run's restart removes by these notes. The
    :class:`ftidask.staging.stager.Staging` of a context sets it when the transport did not.
    """

    def __init__(self, client: Client, worker_for: Callable[[StageRequest], str | None] | None = None,
                 run: str | None = None, notes: Path | None = None) -> None:
        self.client = client
        self.notes = notes
        self._noted: dict[int, StageRequest] = {}  # the transfers noted, by request id, until they are over
        self.worker_for = worker_for
        self.owner = (run, str(client.id)) if run else None  # the copies are fenced by the run (see .fence)
        self._token = uuid.uuid4().hex[:12]
        self.topic = f"ftidask-stage-{self._token}"
        self._cancel = Event(f"ftidask-stage-cancel-{self._token}", client=client)
        self._futures: dict[int, Any] = {}
        self._where: dict[int, str | None] = {}
        self.ran_on: dict[int, str] = {}  # request id -> the worker that ran it
        self._watch = _WorkerWatch(self.topic)
        self._lock = threading.Lock()
        self._table: Any = None

    def start(self, table: Any) -> None:
        """Report to ``table``: subscribe to the transfers' events and watch for workers that leave."""
        self._table = table
        self.client.subscribe_topic(self.topic, self._on_event)
        self.client.register_plugin(self._watch, name=self._watch.name)

    def _on_event(self, event: Any) -> None:
        _when, msg = event
        if isinstance(msg, dict) and "removed" in msg:
            refresh = getattr(self.worker_for, "refresh", None)
            if refresh is not None:
                refresh()
            self._worker_removed(str(msg["removed"]))
            return
        with contextlib.suppress(KeyError, TypeError, ValueError):
            rid, state = int(msg["id"]), int(msg["state"])
            if "worker" in msg:
                self.ran_on[rid] = str(msg["worker"])
            req = self._noted.get(rid) if state in (SI_SCES, SI_FAIL) else None
            if req is not None:  # over: its note goes before the application can see the request done
                self._end_note(req)
            self._table.update(rid, state)

    def _worker_removed(self, address: str) -> None:
        """The worker holding some files died: their requests are settled (a task bound to it would wait forever).
        Claimed here, so that their futures' callbacks leave them alone; settled in a thread (this runs in the
        client's event loop, and telling a published copy from a lost one may read files)."""
        with self._lock:
            lost = [(rid, self._futures.pop(rid, None)) for rid, where in list(self._where.items())
                    if where == address]
            for rid, _future in lost:
                del self._where[rid]
        if lost:
            threading.Thread(target=self._settle_lost, args=(lost, f"mover died (worker {address} left the cluster)"),
                             name="ftidask-stage-settle", daemon=True).start()

    def _settle_lost(self, lost: list[tuple[int, Any]], reason: str) -> None:
        for rid, future in lost:
            info = self._table.info(rid)
            if info is not None:
                self._settled(info.request, reason)
            if future is not None:  # after the report: its callback would find the request claimed anyway
                with contextlib.suppress(Exception):
                    future.cancel()

    def _settled(self, req: StageRequest, reason: str) -> None:
        """Report ``req``, whose task died with its worker: ``SI_SCES`` if the copy was published before the death
        (:mod:`ftidask.staging.settle`), else ``SI_FAIL`` with ``reason``, its temporary file removed first."""
        state = settle(req)
        self._end_note(req)
        self._table.update(req.id, state, reason if state == SI_FAIL else "")

    def _end_note(self, req: StageRequest) -> None:
        if self.notes is not None and self._noted.pop(req.id, None) is not None:
            journal.end(self.notes, req)

    def submit(self, req: StageRequest) -> None:
        """Submit ``req`` as a task on the worker holding its file (``worker_for``), no retries."""
        address = self.worker_for(req) if self.worker_for is not None else None
        if self.notes is not None:  # before the worker can create the temporary file
            journal.begin(self.notes, req)
            self._noted[req.id] = req
        future = self.client.submit(
            run_transfer, req.to_json(), self.topic, self._cancel.name, self.owner,
            key=f"ftidask-stage-{self._token}-{req.id}", pure=False, retries=0,
            workers=[address] if address else None, allow_other_workers=False)
        with self._lock:
            self._futures[req.id] = future
            self._where[req.id] = address
        future.add_done_callback(lambda fut, req=req: self._done(req, fut))

    def _done(self, req: StageRequest, future: Any) -> None:
        with self._lock:
            mine = self._futures.pop(req.id, None) is not None  # else claimed by _worker_removed, which settles it
            self._where.pop(req.id, None)
        if future.status == "finished":  # the task's own answer: the truth, whoever claimed the request
            result = future.result()
            self.ran_on[req.id] = str(result.get("worker", ""))
            self._end_note(req)  # (before the request is seen done)
            self._table.update(req.id, int(result["state"]), str(result.get("reason", "")))
            return
        if not mine:
            return
        if future.status == "cancelled":
            reason = _CANCEL_REASON
        else:
            try:
                exc = future.exception()
            except Exception as err:  # noqa: BLE001 - whatever the scheduler says, it is the reason
                exc = err
            reason = f"the staging task failed on its worker: {exc!r}"
        # The task may have died after it published (a worker killed, KilledWorker): settled as a dead mover's.
        self._settled(req, reason)

    def close(self, timeout: float) -> None:
        """Wait at most ``timeout`` s, cancel the requests still open (reported failed), stop watching the cluster."""
        self._table.wait(None, timeout)
        open_ids = [r.id for r in self._table.open_requests()]
        if open_ids:
            self._cancel.set()  # running copies stop at their next piece and remove their temporary file
            with self._lock:
                futures = list(self._futures.values())
            with contextlib.suppress(Exception):
                self.client.cancel([f for f in futures if f.status == "pending"])
            self._table.wait(open_ids, 30.0)
            self._table.fail_open([r.id for r in self._table.open_requests()], _CANCEL_REASON)
        with contextlib.suppress(Exception):
            self.client.unsubscribe_topic(self.topic)
        with contextlib.suppress(Exception):
            self.client.unregister_scheduler_plugin(self._watch.name)
