"""How the Dask backend writes a checkpoint: each protected array persisted on the cluster, each chunk's file
written by a worker that holds it, the level's redundancy run as tasks, then the commit record written by the
client, last (:class:`DaskWriting`, a mixin of :class:`~ftidask.backends.dask.context.DaskContext`).

Separate from :mod:`ftidask.backends.dask.context` (the context's calls: protection, checkpoint requests,
incremental checkpoints, keep_last_ckpt, recovery), which makes room there.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Client, Future, futures_of

from ...engine.device import is_device_array
from ...engine.runstate import CommitRecord, FileRecord
from ...model.arrays import contiguous_items
from ...model.errors import CheckpointError, FTIError
from ...model.level import Level
from . import lineage
from .cluster import Cluster, ClusterError
from .dcp_levels import run_dcp_levels, sticky_owners
from .full_levels import run_full_levels
from .plan import VarSpec, chunk_table
from .report import DaskCheckpointInfo, human
from .transport import is_dask_array

if TYPE_CHECKING:
    from ...engine.commit import Committer
    from ...engine.recovering import Progress
    from ...engine.runstate import SeqReservation
    from ...engine.variables import Protected
    from .retention import DaskRetention

log = logging.getLogger("ftidask")


class DaskWriting:
    """The checkpoint writing of a Dask context, which holds ``client``, ``cluster``, ``progress``, ``_vars``,
    ``_dcp``, ``_seqs``, ``_committer`` and ``_dask_retention``."""

    client: Client
    cluster: Cluster
    progress: Progress
    _vars: dict[int, Protected]
    _dcp: Any
    _seqs: SeqReservation
    _committer: Committer
    _dask_retention: DaskRetention

    def _chunk_futures(self, copy: bool = False) -> tuple[list[VarSpec], dict[tuple[int, tuple[int, ...]], Future]]:
        """Persist every protected array (once) and return its chunks' futures by grid index; ``copy``: a NumPy
        array is scattered as a copy (an asynchronous checkpoint: a cluster of threads in this process keeps the
        object scattered, not its bytes, and the application may write the array once the call returns)."""
        if not self.cluster.workers():  # the chunks would wait for a worker for ever (a recovery refuses too)
            raise CheckpointError("the cluster has no workers: nothing can compute or write the protected arrays")
        specs, futures = [], {}
        for vid, p in self._vars.items():
            arr = p.array
            if is_dask_array(arr):
                kind = "dask"
                if not _persisted(arr, self.client):  # (again: a new graph of the same futures, for nothing)
                    arr = p.array = self.client.persist(arr)  # later checkpoints and the user reuse the chunks
            else:
                kind = "numpy"
                data = contiguous_items(arr, copy)  # (a structured dtype's padding too)
                future = self.client.scatter(data.reshape(arr.shape), hash=False)  # 0-d stays 0-d
                futures[vid, tuple(0 for _ in arr.shape)] = future
            spec = VarSpec(vid, p.name, np.dtype(arr.dtype), tuple(int(n) for n in arr.shape),
                           tuple(tuple(int(c) for c in dim) for dim in arr.chunks) if kind == "dask"
                           else tuple((int(n),) for n in arr.shape), kind,
                           p.state.kind if p.state is not None else "", is_device_array(getattr(arr, "_meta", None)))
            specs.append(spec)
            if kind == "dask":
                by_key = {f.key: f for f in futures_of(arr)}
                for key in _flatten(arr.__dask_keys__()):
                    futures[vid, tuple(key[1:])] = by_key[key]
        return specs, futures

    def _owners(self, ckpt_id: int, futures: dict[tuple[int, tuple[int, ...]], Future]
                ) -> tuple[list[str], dict[Any, Any], dict[tuple[int, tuple[int, ...]], int]]:
        """Once the chunks are computed: the live workers (ranks), where each chunk is, and the rank that writes it
        (one holding it)."""
        try:
            # Never cancelled: they are the application's array's chunks (persisted once, kept by it and by the next
            # checkpoints); a cancel lost those computed too, and the next checkpoint said "cancelled", not why
            self.cluster.wait_all(list(futures.values()), [], "computing the protected arrays", gather=False,
                                  cancel=False)
        except FTIError as exc:
            raise CheckpointError(f"checkpoint {ckpt_id}: the protected arrays could not be computed: {exc}") from exc
        # After the chunks: a worker lost meanwhile has its chunks recomputed.
        workers, who_has = self.cluster.workers_holding([f.key for f in futures.values()])
        rank_of = {w: r for r, w in enumerate(workers)}
        owner = {}
        for place, key in [(place, f.key) for place, f in futures.items()]:  # no future left bound in this frame
            holders = sorted(rank_of[w] for w in who_has.get(key, ()) if w in rank_of)
            if not holders:
                raise CheckpointError(f"checkpoint {ckpt_id}: chunk {place} is held by no live worker")
            owner[place] = holders[0]
        return workers, who_has, owner

    def _write_checkpoint(self, ckpt_id: int, parsed: Level, specs: list[VarSpec],
                          futures: dict[tuple[int, tuple[int, ...]], Future], start: float,
                          held: dict[int, Any], codecs: dict[int, dict[str, Any]]) -> DaskCheckpointInfo:
        differential = parsed.differential  # L5-L8: differential L1-L4 (enable_dcp = 1)
        level = parsed.base
        self._dask_retention.pins.settled = False  # only the lineage cut below spares the retirement a barrier
        # Retired before the write (a differential one may patch their files). A full one's write tasks discard
        # their directories first, each on its worker: no round trip of their own (here, if they do not run).
        retired = self._dask_retention.retire_deferred(carried=not differential)
        try:
            workers, who_has, owner = self._owners(ckpt_id, futures)
            if differential:
                owner = sticky_owners(self, level, owner, workers)
            seq = self._seqs.take()
            # The chunks aliased under their lineage keys meanwhile, on their workers: that round trip overlaps the
            # writes (the scheduler is told of them once the checkpoint is committed, see lineage.cut).
            aliasing = lineage.Aliasing(self.cluster, ckpt_id, seq, specs, futures, who_has, owner, workers)
        except BaseException:
            self._dask_retention.discard_now(retired)
            raise
        try:
            return self._commit(ckpt_id, parsed, specs, futures, start, held, codecs, retired, workers, owner, seq,
                                aliasing)
        except BaseException:  # not committed, or its lineage not cut: the aliases go (once the scheduler was told
            aliasing.abandon()  # of them, they stay: they are its keys)
            raise

    def _commit(self, ckpt_id: int, parsed: Level, specs: list[VarSpec],
                futures: dict[tuple[int, tuple[int, ...]], Future], start: float, held: dict[int, Any],
                codecs: dict[int, dict[str, Any]], retired: list[str], workers: list[str], owner: dict[Any, int],
                seq: int, aliasing: lineage.Aliasing) -> DaskCheckpointInfo:
        """:meth:`_write_checkpoint` once the writers are chosen: the writes, the level's redundancy, the commit,
        the lineage cut and the retirement."""
        differential = parsed.differential
        shown_level, level = parsed.number, parsed.base
        failed = f"checkpoint {ckpt_id} at level {shown_level} failed; the previous checkpoint is kept"

        def discard() -> None:  # what a checkpoint that is not committed leaves, on every worker
            aliasing.abandon()
            if differential:
                self._dcp.discard()
            self._dask_retention.remove_dirs(ckpt_id, seq, level, len(workers), also=retired, failed=True)

        try:  # (the checkpoint's directories: a task of it orphaned by a restart removes them)
            with self.cluster.batch(), self.cluster.cleaning(self._dask_retention.dir_patterns(ckpt_id, seq)):
                if differential:
                    plans, written, groups = run_dcp_levels(self, ckpt_id, level, seq, specs, futures, owner, workers)
                else:
                    plans, written, groups = run_full_levels(self, ckpt_id, level, seq, specs, futures, owner,
                                                             workers, codecs, retired)
        except FTIError as exc:
            discard()
            # A lost worker or a failed task is said in one sentence, without Dask's chained traceback.
            cluster_error = isinstance(exc, ClusterError)
            raise CheckpointError(f"{failed}: {exc.detail if cluster_error else exc}") from (
                None if cluster_error else exc)
        except BaseException:  # (interrupted) whether the write tasks ran or not: the retired ones go
            self._dask_retention.discard_now(retired)
            raise
        record = CommitRecord(seq, ckpt_id, level, time.time(), len(workers),
                              tuple(FileRecord(w["rank"], w["node"], w["size"], w["fb_hash"]) for w in written),
                              {"backend": "dask", "workers": workers, "groups": groups,
                               "vars": [s.to_json() for s in specs], "chunks": chunk_table(plans)}
                              | ({"dcp": True} if differential else {}))
        # The workers collect interrupted checkpoints' leftovers while the client writes the commit record (this
        # checkpoint's directories kept): that round trip overlaps the seal's fsyncs and the cut.
        self._dask_retention.collect_early(record.dirname)
        try:
            self._committer.seal(record, failed, discard)  # the commit point, as on every backend
            if differential:  # its files are sound: retired, they become the spares (and the fallback)
                self._dcp.written(record)
            self.progress.layout = None  # the workers plan their files afresh each time
            # Chunks lost later are read back from the checkpoint.
            arrays = lineage.cut_after_commit(self, record, specs, futures, held, aliasing)
            futures.clear()  # the chunks as computed are ours no more (shared with the caller): a checkpoint that
            held.clear()  # they were computed from is retired below unless the application still holds them
            self._committer.retire_after(record, shown_level)
        finally:
            self._dask_retention.settle()
        variables = tuple({"id": s.id, "name": s.name, "dtype": str(s.dtype), "shape": s.shape,
                           "nchunks": len(s.grid()), "nbytes": sum(s.chunk_nbytes(i) for i in s.grid())}
                          for s in specs)
        info = DaskCheckpointInfo(ckpt_id, shown_level, seq, sum(w["data_bytes"] for w in written),
                                  sum(w.get("file_bytes", w["size"]) for w in written), time.perf_counter() - start,
                                  sum(w["blocks_changed"] for w in written) if differential else None,
                                  sum(w["blocks_total"] for w in written) if differential else None,
                                  blocks_hashed=sum(w["blocks_hashed"] for w in written) if differential else None,
                                  workers=tuple(workers), file_sizes=tuple(w["size"] for w in written),
                                  variables=variables,
                                  partner_bytes=sum(w["partner_bytes"] for w in written)
                                  if differential and level == 2 else None,
                                  array_refs={vid: weakref.ref(a) for vid, a in arrays.items()})
        self.progress.last_checkpoint = info
        self.progress.next_ckpt_id = max(self.progress.next_ckpt_id, ckpt_id + 1)
        log.info("checkpoint %d (level %d) written by %d workers: %s", ckpt_id, shown_level, len(workers),
                 human(info.bytes_written))
        return info


def _persisted(arr: Any, client: Client) -> bool:
    """Whether each chunk of Dask array ``arr`` is a future of ``client`` (persisted, or its lineage cut)."""
    done = {f.key for f in futures_of(arr) if f.client is client}
    return bool(done) and all(k in done for k in _flatten(arr.__dask_keys__()))


def _flatten(keys: Any) -> list[Any]:
    if isinstance(keys, list):
        return [k for sub in keys for k in _flatten(sub)]
    return [keys]
