"""Run under mpiexec by test_staging_mpi.py: staging from several MPI ranks, with or without a head.

``nohead``: every rank stages its own files with a ThreadMover (FTI without heads).
``head``: rank 0 plays the node's head: it runs ``staging_process.serve`` on requests that the other
ranks send as JSON over MPI, and answers with JSON states (the protocol an MPI head uses); the
application ranks receive the states in a thread. ``headpoll``: the same, but the application
ranks probe for the states when they query (``StageTable.set_poller``), without a thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from mpi4py import MPI

from ftidask import SI_NINI, SI_SCES
from ftidask.staging.process import serve
from ftidask.staging.stager import Stager, ThreadMover

TAG_REQ, TAG_STATE = 71, 72


class MPIHeadMover:
    """The application rank's side: requests to the head, states back from it (a receiver thread)."""

    def __init__(self, comm: MPI.Comm, head: int) -> None:
        self.comm, self.head = comm, head

    def start(self, table) -> None:
        self.table = table
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while True:
            msg = json.loads(self.comm.recv(source=self.head, tag=TAG_STATE))
            if msg is None:
                return
            self.table.update(int(msg["id"]), int(msg["state"]), msg.get("reason", ""))

    def submit(self, req) -> None:
        self.comm.send(json.dumps(req.to_json()), dest=self.head, tag=TAG_REQ)

    def close(self, timeout: float) -> None:
        self.table.wait(None, timeout)
        self.comm.send(json.dumps(None), dest=self.head, tag=TAG_REQ)
        self.thread.join(30)


class MPIHeadPollMover(MPIHeadMover):
    """The same without a thread: answers are probed for whenever the application asks (no THREAD_MULTIPLE)."""

    def start(self, table) -> None:
        self.table = table
        self.ended = False
        table.set_poller(self._poll)

    def _poll(self) -> None:
        while not self.ended and self.comm.Iprobe(source=self.head, tag=TAG_STATE):
            msg = json.loads(self.comm.recv(source=self.head, tag=TAG_STATE))
            if msg is None:
                self.ended = True
                return
            self.table.update(int(msg["id"]), int(msg["state"]), msg.get("reason", ""))

    def close(self, timeout: float) -> None:
        self.table.wait(None, timeout)
        self.comm.send(json.dumps(None), dest=self.head, tag=TAG_REQ)
        while not self.ended:
            self._poll()


def run_head(comm: MPI.Comm) -> None:
    open_ranks = set(range(1, comm.size))
    source = {"rank": -1}

    def next_request():
        while open_ranks:
            status = MPI.Status()
            raw = json.loads(comm.recv(source=MPI.ANY_SOURCE, tag=TAG_REQ, status=status))
            if raw is None:  # that rank is done: release its receiver thread
                open_ranks.discard(status.Get_source())
                comm.send(json.dumps(None), dest=status.Get_source(), tag=TAG_STATE)
                continue
            source["rank"] = status.Get_source()
            return raw
        return None

    serve(next_request, lambda msg: comm.send(json.dumps(msg), dest=source["rank"], tag=TAG_STATE))


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    comm = MPI.COMM_WORLD
    if mode in ("head", "headpoll") and comm.rank == 0:
        if mode == "head" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            comm.Abort(3)  # the application ranks' receiver threads need MPI_THREAD_MULTIPLE
        run_head(comm)
        comm.gather(True, root=1)
        comm.Barrier()
        return
    stage = root / "local" / "stage" / "node0" / f"rank{comm.rank}"
    stage.mkdir(parents=True, exist_ok=True)
    mover = (ThreadMover() if mode == "nohead" else MPIHeadMover(comm, 0) if mode == "head"
             else MPIHeadPollMover(comm, 0))
    stager = Stager(stage, root / "global", mover)
    sizes = [0, 1, 4096, 100_000, 3 << 20]
    ids = {}
    for i in range(20):
        data = os.urandom(sizes[i % len(sizes)])
        (stage / f"f{i}").write_bytes(data)
        ids[i] = (stager.send(stage / f"f{i}", f"r{comm.rank}/f{i}"), data)
    ok = True
    for i, (req, data) in ids.items():
        ok &= stager.wait(req, 120) == SI_SCES and stager.table.query(req) == SI_SCES
        ok &= stager.table.query(req) == SI_NINI
        ok &= (root / "global" / f"r{comm.rank}" / f"f{i}").read_bytes() == data
    ok &= not any(stage.iterdir())
    ok &= stager.close(60) == []
    results = comm.gather(bool(ok), root=0 if mode == "nohead" else 1)
    if results is not None:
        print("STAGING-OK" if all(results) else f"STAGING-FAILED {results}", flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
