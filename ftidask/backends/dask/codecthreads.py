"""The codec's frame threads on a Dask worker: bounded by twice the worker's ``nthreads``.

A compressed container of more than 4 MiB is encoded and decoded in frames on a pool of the process
(:func:`ftidask.ftiff.compression.limit_frame_threads`), up to 8 threads by default: right for one
process that owns the machine. A Dask worker is not that process. It runs ``nthreads`` tasks at once,
and a machine holds several workers, their ``nthreads`` together being its cores (the usual layout:
``LocalCluster`` splits the cores that way; ``dask worker --nworkers N --nthreads T`` is sized so). With
8 frame threads per worker, 8 workers of 2 threads on 16 cores could run 64 codec threads beside their
16 task threads. So each worker's frame pool is bounded by its share of the cores, doubled: a task that
writes a rank file alternates encoding its containers with writing them, and while it writes, its core
would idle (measured on 2 workers of one thread on 2 cores: a 128 MiB compressed checkpoint took
1.4-1.7x as long with one frame thread per worker as with two). A machine's codec threads then stay
within twice its cores when every worker encodes at once, instead of up to 8 per worker.
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
    """The frame threads a worker gets: twice its ``nthreads`` (see the module's text; the pool caps it)."""
    state = getattr(worker, "state", None)
    nthreads = getattr(state, "nthreads", None) or getattr(worker, "nthreads", None) or 1
    return 2 * max(1, int(nthreads))


class CodecThreadsPlugin(WorkerPlugin):
    """Bounds the frame pool of every worker (present and future) by twice its ``nthreads``."""

    name = NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        """Bound ``worker``'s frame pool by :func:`worker_share`."""
        used = compression.limit_frame_threads(worker_share(worker))
        log.debug("worker %s: compressed frames on at most %d thread(s)", getattr(worker, "address", "?"), used)


def register(client: Client) -> None:
    """Bound the frame threads of every worker of ``client``'s cluster, and of every worker that joins later."""
    client.register_plugin(CodecThreadsPlugin(), name=NAME)
