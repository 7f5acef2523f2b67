"""Recovery from the previous differential checkpoint, kept as the spares, on a Dask cluster (FTI's dCP
"go back one layer"; see docs/dcp.md, design points 6-7), and what recovery shares with it: which
worker serves each file.

When a differential checkpoint is retired, each worker renames its own file to its spare
(:meth:`~ftidask.backends.dask.dcp_levels.DaskSpares.keep`) and the client writes the checkpoint's commit
record as the level's fallback (:meth:`~ftidask.engine.runstate.RunState.write_fallback`). Recovery tries it
after every newer checkpoint: rank ``r``'s file is its spare, ``{level dir of node r}/dcp/Spare-Rank{r}.fti``,
checked (FB hash from the record, every block's hash, every chunk where the record places it) on the worker
that wrote it when it is alive and sees it, else on any worker that sees it, before any array is touched.
A fallback's redundancy (L2 partner copies, L3 parity) was the committed checkpoint's: it is never rebuilt,
so a rank whose spare is lost or damaged makes the fallback unrecoverable.
"""

from __future__ import annotations

import collections
import uuid
from typing import TYPE_CHECKING

from ...engine.runstate import CommitRecord
from ...model.errors import FTIError, RecoveryError
from . import recorded, tasks
from .dcp_levels import spare_path

if TYPE_CHECKING:
    from .context import DaskContext


class Unrecoverable(FTIError):
    """This checkpoint cannot be rebuilt; an older one may still be."""


class Placer:
    """Chooses the worker that serves each file: the one that wrote it if alive, else the least loaded."""

    def __init__(self, workers: list[str], seen: dict[str, list[int]], paths: list[str]) -> None:
        """``seen``: each worker's :func:`~ftidask.backends.dask.tasks.sizes` of ``paths`` (-1: not seen)."""
        self.workers = workers
        self.load: collections.Counter[str] = collections.Counter()
        self.visible = {p: [w for w in workers if isinstance(seen.get(w), list) and seen[w][i] >= 0]
                        for i, p in enumerate(paths)}

    def pick(self, path: str, preferred: str | None = None) -> str | None:
        """The worker that serves ``path``: ``preferred`` if it sees it, else the least loaded that does."""
        cands = self.visible.get(path, [])
        if not cands:
            return None
        worker = preferred if preferred in cands else min(cands, key=lambda w: (self.load[w], self.workers.index(w)))
        self.load[worker] += 1
        return worker

    def any(self) -> str:
        """The least loaded worker (a stand-in for a file that no worker sees)."""
        worker = min(self.workers, key=lambda w: (self.load[w], self.workers.index(w)))
        self.load[worker] += 1
        return worker


def check_files(ctx: DaskContext, record: CommitRecord, own: dict[int, str], placer: Placer,
                tag: str, data: bool = True, decode: bool = True) -> tuple[dict[int, str], dict[int, dict]]:
    """Check every rank's file ``own[r]`` of ``record`` (FB hash from the record, every hash, every chunk where
    the record places it) on the worker that wrote it if it sees it, else on one that does: the worker chosen
    per rank, and the verdict of each file that some worker sees. ``data`` False: the metadata only; ``decode``
    False: the hashes, no compressed container decoded (see :func:`~ftidask.backends.dask.tasks.check_file`)."""
    cl, lay = ctx.cluster, recorded.layout(record)  # a damaged record: this checkpoint cannot be recovered
    fb = {f.rank: f.fb_hash for f in record.files}
    hosts: dict[int, str] = {}
    checks = {}
    for r in range(record.nranks):
        worker = placer.pick(own[r], lay.workers[r] if r < len(lay.workers) else None)
        if worker is not None:
            hosts[r] = worker
            checks[r] = cl.submit(tasks.check_file, own[r], fb[r], expect=lay.expected(r), data=data, decode=decode,
                                  key=f"ftidask-check-{tag}-{r}", worker=worker)
    results = cl.wait_all(list(checks.values()), set(hosts.values()), f"checking checkpoint {record.ckpt_id}")
    return hosts, dict(zip(checks, results, strict=True))


def restore_spares(ctx: DaskContext, record: CommitRecord, data: bool = True,
                   decode: bool = True) -> dict[int, tuple[str, str]]:
    """rank -> (worker, spare path) of fallback ``record``, every rank's spare verified (``data`` False: its
    metadata); :class:`Unrecoverable` when one is lost or damaged (nothing is rebuilt, nothing is written)."""
    cl = ctx.cluster
    workers = cl.workers()
    if not workers:
        raise RecoveryError("the cluster has no workers")
    recorded.layout(record)  # a damaged record: this checkpoint cannot be recovered
    ranks = sorted(f.rank for f in record.files)
    if ranks != list(range(record.nranks)):
        raise Unrecoverable(f"its record lists the files of ranks {ranks} of {record.nranks}")
    own = {r: spare_path(ctx, record.level, r) for r in range(record.nranks)}
    paths = list(own.values())
    placer = Placer(workers, cl.run(tasks.sizes, paths), paths)
    tag = f"{record.ckpt_id}-{record.seq}-spare-{uuid.uuid4().hex[:8]}"
    hosts, verdicts = check_files(ctx, record, own, placer, tag, data, decode)
    bad = [r for r in range(record.nranks) if not (r in verdicts and verdicts[r]["ok"])]
    if bad:
        why = "; ".join(verdicts[r]["message"] if r in verdicts else f"rank {r}'s spare is on no live worker"
                        for r in bad[:4])
        raise Unrecoverable(f"the previous differential checkpoint: the spares of rank(s) {bad} are lost or damaged "
                            f"({why}); a spare is never rebuilt")
    return {r: (hosts[r], own[r]) for r in range(record.nranks)}
