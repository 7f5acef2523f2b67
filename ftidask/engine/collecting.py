"""When the garbage collection after a checkpoint looks at every directory of the run, and when only at the level
directories that checkpoint wrote (see :meth:`~ftidask.engine.retention.Retention.collect_garbage`).

A full collection lists up to seven directories (each local level, the global L4 one, the commit records, the run's
state): 0.26 ms of the 3.5 ms a 4 KiB checkpoint cost on a 2-core machine. It is needed wherever something may have
left garbage that this process does not know of: an earlier run killed (the collection at init), a checkpoint of
this process that failed or was interrupted anywhere (its clean-up is best effort), a head's post-processing. After
a checkpoint of this process that succeeded, with nothing else begun since the last collection, the only directories
anything of this process wrote in are the new checkpoint's level directories (its files renamed into place, the
retired ones' removed): a light collection looks there only. Every :data:`FULL_EVERY`-th collection is full whatever
happened, so that what another process leaves meanwhile (a second context of the run in this process, an
application's own copy) is still removed within that many checkpoints, as is a retired checkpoint's trash that could
not be deleted (logged).
"""

from __future__ import annotations

from pathlib import Path

from ..storage.files import RunPaths
from .runstate import CommitRecord, RunState

#: A collection looks at every directory of the run at least once in this many.
FULL_EVERY = 16


class CollectSchedule:
    """Which collection comes next: full, or light at one level (see the module's docstring). Counted on each rank
    alike (every step counted is collective); the collection still takes rank 0's answer on every rank."""

    def __init__(self, heads: bool) -> None:
        self.heads = heads  # a head post-processes checkpoints in another process: every collection is full
        self.begun = 0  # checkpoints begun (planned) since the last collection that succeeded
        self.level: int | None = None  # the level of the checkpoint retired after, once its retirement succeeded
        self.light_in_a_row: int | None = None  # light collections since the last full one; None before any

    def began(self) -> None:
        """A checkpoint is planned (its directory may be made from now on, whatever becomes of it)."""
        self.begun += 1

    def retired(self, level: int) -> None:
        """The checkpoint begun last committed at ``level``, and what it made obsolete is removed."""
        self.level = level

    def light_level(self) -> int | None:
        """The level whose directories the next collection looks at only; None: every directory."""
        if (self.heads or self.light_in_a_row is None or self.light_in_a_row >= FULL_EVERY - 1 or self.begun != 1
                or self.level is None):
            return None
        return self.level

    def collected(self, light: bool) -> None:
        """A collection succeeded (``light``: at one level only)."""
        self.begun, self.level = 0, None
        self.light_in_a_row = (self.light_in_a_row or 0) + 1 if light else 0


def collection_roots(paths: RunPaths, state: RunState, rank: int, node: int, light: int | None,
                     gone: list[int]) -> list[Path]:
    """The directories a collection looks into on rank ``rank`` (of node ``node``): light, those of level ``light``
    (the global L4 one on rank 0); full, every level directory of the node, and on rank 0 the global L4 one, the
    commit records, the run's state, and the level directories of ``gone``, nodes of an earlier start on more of
    them (a restart on fewer ranks), which no rank of this run has: rank 0 removes what it sees there, as it does
    for the checkpoints retired (see :meth:`~ftidask.engine.retention.Retention.remove_checkpoint`)."""
    if light is not None:
        return [paths.local_dir(light, node)] + ([paths.level_dir(4, 0)] if light == 4 and rank == 0 else [])
    roots = [paths.local_dir(level, node) for level in (1, 2, 3, 4)]
    if rank == 0:
        roots += [paths.level_dir(4, 0), state.records_dir, state.root]
        roots += [paths.local_dir(level, n) for n in gone for level in (1, 2, 3, 4)]
    return roots


#: A retired checkpoint whose files on any node add up to at most this many bytes is deleted at once, on the
#: committing thread: the hand-off to the remover's thread costs more (2 cores, 4 KiB checkpoints back to back:
#: 0.1-0.5 ms each, the thread's GIL traffic slowing the next one; the same with other work between them).
#: Larger ones are deleted in the background: freeing a GiB-sized file takes a noticeable time.
REMOVE_NOW_BYTES = 1 << 20


def small(record: CommitRecord) -> bool:
    """Whether ``record``'s files on each node are few enough bytes to delete at once (:data:`REMOVE_NOW_BYTES`)."""
    per_node: dict[int, int] = {}
    for f in record.files:
        per_node[f.node] = per_node.get(f.node, 0) + f.size
    return max(per_node.values(), default=0) <= REMOVE_NOW_BYTES
