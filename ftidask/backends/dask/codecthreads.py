"""The codec's frame threads on a Dask worker: bounded by the worker's ``nthreads``.

A compressed container of more than 4 MiB is encoded and decoded in frames on a pool of the process
(:func:`ftidask.ftiff.compression.limit_frame_threads`), up to 8 threads by default: right for one
process that owns the machine. A Dask worker is not that process. It runs ``nthreads`` tasks at once,
and a machine holds several workers, their ``nthreads`` together being its cores (the usual layout:
``LocalCluster`` splits the cores that way; ``dask worker --nworkers N --nthreads T`` is sized so). With
8 frame threads per worker, 8 workers of 2 threads on 16 cores could run 64 codec threads beside their
16 task threads. So each worker's frame pool gets the worker's ``nthreads``: the frames of all its tasks
share that many threads, and a machine's codec threads stay within its cores, as Dask's own threads do
(and as distributed sets ``OMP_NUM_THREADS=1`` for the BLAS pools of its workers' processes).
"""

from __future__ import annotations

import logging
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from ...ftiff import compression

log = logging.getLogger("ftidask")
NAME = "ftidask-codec-threads"


def worker_share(worker: Any) -> int:
    """The frame threads a worker gets: its ``nthreads`` (at least one)."""
    state = getattr(worker, "state", None)
    nthreads = getattr(state, "nthreads", None) or getattr(worker, "nthreads", None) or 1
    return max(1, int(nthreads))


class CodecThreadsPlugin(WorkerPlugin):
    """Bounds the frame pool of every worker (present and future) by its ``nthreads``."""

    name = NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        used = compression.limit_frame_threads(worker_share(worker))
        log.debug("worker %s: compressed frames on at most %d thread(s)", getattr(worker, "address", "?"), used)


def register(client: Client) -> None:
    """Bound the frame threads of every worker of ``client``'s cluster, and of every worker that joins later."""
    client.register_plugin(CodecThreadsPlugin(), name=NAME)
