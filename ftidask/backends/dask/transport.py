"""The Dask backend's transport: the client is rank 0 of 1; the workers do the work (as tasks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...model.config import Config
from ...model.errors import LevelError
from ...transport.base import Transport

if TYPE_CHECKING:
    from pathlib import Path

    from .cluster import Cluster


def is_dask_collection(value: Any) -> bool:
    """Whether ``value`` is a Dask collection (an array, a bag, a delayed value...)."""
    return hasattr(value, "__dask_graph__")


def is_dask_array(value: Any) -> bool:
    """Whether ``value`` is a Dask array (a Delayed answers every attribute; a chunked xarray object has chunks and
    a dtype, and is no array to persist and write by its keys)."""
    from dask.array import Array

    return isinstance(value, Array)


class DaskTransport(Transport):
    """The client's view: one process (rank 0 of 1) driving a cluster of worker nodes."""

    name = "dask"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def ranks_text(self) -> str:  # Transport's: each worker is a rank, the client none
        """``N worker(s)``: each worker is a rank, the client none."""
        return f"{len(self.cluster.workers())} worker(s)"

    def barrier(self) -> None:
        """Nothing to wait for: the client is the only rank."""
        return None

    def allgather(self, value: Any) -> list[Any]:
        """``[value]``: the client is the only rank."""
        return [value]

    def stage_mover(self, cfg: Config, notes: Path | None = None) -> Any:
        """Staging: each copy is a task on the worker whose node directory (``node{k}``) holds the file; each
        transfer noted in ``notes`` (a restart removes what a killed one left)."""
        from .staging import DaskMover, worker_by_node_dir

        return DaskMover(self.cluster.client, worker_by_node_dir(self.cluster.workers), self.cluster.run_id, notes)

    def levels(self) -> tuple[int, ...]:
        """Levels 1-4 with at least 2 workers, else only 1 and 4."""
        return (1, 2, 3, 4) if len(self.cluster.workers()) >= 2 else (1, 4)

    def check_level(self, level: int) -> None:
        """As :meth:`Transport.check_level`; L2 and L3 need at least 2 workers."""
        if level in (1, 4):  # any number of workers (the scheduler is not asked: a round trip each checkpoint)
            return
        if level in (2, 3) and level not in self.levels():
            raise LevelError(f"level {level} needs at least 2 Dask workers; the cluster has "
                             f"{len(self.cluster.workers())}")
        super().check_level(level)
